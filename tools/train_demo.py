"""Train the demo model shipped in colibri_stream/demo_model (recipe in its README.md; the code is
colibri_stream/devtools/train_demo.py).

python tools/train_demo.py [DST] [--steps N] [--seed S] [--threads T] [--max-minutes M]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from colibri_stream.devtools.train_demo import TrainOptions, make_demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dst", nargs="?", default="colibri_stream/demo_model")
    parser.add_argument("--steps", type=int, help=f"optimizer steps (default {TrainOptions.steps})")
    parser.add_argument("--seed", type=int, help=f"seed (default {TrainOptions.seed})")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--max-minutes", type=float, help="stop training early after this long (safety cap)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    changes = {"steps": args.steps, "seed": args.seed}
    options = dataclasses.replace(TrainOptions(), **{k: v for k, v in changes.items() if v is not None})
    max_seconds = args.max_minutes * 60 if args.max_minutes else None
    meta = make_demo(args.dst, options, max_seconds=max_seconds)
    print(json.dumps({k: meta[k] for k in ("training", "total_minutes")} | {"quality": meta["quality"]}, indent=1))


if __name__ == "__main__":
    main()
