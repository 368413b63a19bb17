"""colibri-stream: run MLA/DSA Mixture-of-Experts LLMs larger than RAM by streaming routed experts."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("colibri-stream")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
