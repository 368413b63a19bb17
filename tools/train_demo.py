"""Train the demo model shipped in colibri_stream/demo_model (recipe in its README.md; the code is
colibri_stream/devtools/train_demo.py).

python tools/train_demo.py [DST] [--steps N] [--seed S] [--threads T] [--max-minutes M]
"""

from __future__ import annotations

import json

from colibri_stream.devtools.train_demo import TrainOptions, make_demo, training_command


def main() -> None:
    run = training_command(__doc__, TrainOptions())
    meta = make_demo(run.dst, run.options, max_seconds=run.max_seconds)
    print(json.dumps({k: meta[k] for k in ("training", "total_minutes")} | {"quality": meta["quality"]}, indent=1))


if __name__ == "__main__":
    main()
