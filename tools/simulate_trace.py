"""Replay a routing trace (`colibri-stream run ... --trace FILE`) at several cache capacities and print
the hit rate of LRU, the hybrid, learned pins and Belady's MIN (the offline optimum).

    python tools/simulate_trace.py TRACE --capacities 16,32,64 --room 16
"""

from __future__ import annotations

import argparse
import json

from storage.tiers.simulate import compare_policies, read_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--capacities", required=True, help="comma-separated slot counts")
    parser.add_argument("--room", type=int, default=0, help="slots left unpinned for the learned-pins policy")
    args = parser.parse_args()
    capacities = [int(c) for c in args.capacities.split(",")]
    for row in compare_policies(read_trace(args.trace), capacities, args.room):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
