"""int4 expert FFN vs memcpy of the same bytes, measured side by side (colibri_stream/bench/kernels.py).

python tools/bench_kernels.py [--rows 1] [--experts 48]
"""

from __future__ import annotations

import argparse
import json

from colibri_stream.bench.kernels import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dim", type=int, default=7168)
    parser.add_argument("--inter", type=int, default=2048)
    args = parser.parse_args()
    print(json.dumps(measure(n_experts=args.experts, dim=args.dim, inter=args.inter, rows=args.rows)))


if __name__ == "__main__":
    main()
