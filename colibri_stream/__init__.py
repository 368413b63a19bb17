"""colibri-stream: run MLA/DSA Mixture-of-Experts LLMs larger than RAM by streaming routed experts."""

import os
from importlib.metadata import PackageNotFoundError, version

# OpenMP threads that finish a parallel region spin for the next one by default. With one other
# CPU-bound process on the machine a spinning thread holds the core its partner needs, and each of the
# hundreds of small parallel regions per token waits for a descheduled thread: decode fell to about half
# its idle rate, and passive waiting kept it near idle without slowing an idle machine (docs/benchmarks-log.md,
# "Decode beside another CPU-bound process"). It has to be set before torch loads the OpenMP runtime; a
# value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    __version__ = version("colibri-stream")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
