"""Write a generated DeepSeek-V3-shaped checkpoint (see colibri_stream/bench/stress_model.py).

python tools/make_stress_model.py DST [--quick] [--layers N] [--experts N] [--context N] [--seed S]

--context: max_position_embeddings (default 4096); an 8192-token prompt (tools/profile_prefill.py --tokens 8192)
needs more than 8192.
"""

from __future__ import annotations

import argparse
import dataclasses

from colibri_stream.bench.stress_model import QUICK, StressShape, write_stress_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dst")
    parser.add_argument("--quick", action="store_true", help="a small model that builds in seconds")
    parser.add_argument("--layers", type=int, help="num_hidden_layers")
    parser.add_argument("--experts", type=int, help="n_routed_experts")
    parser.add_argument("--context", type=int, help="max_position_embeddings: the longest prompt + answer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = QUICK if args.quick else StressShape()
    changes = {
        "num_hidden_layers": args.layers,
        "n_routed_experts": args.experts,
        "max_position_embeddings": args.context,
    }
    shape = dataclasses.replace(shape, **{k: v for k, v in changes.items() if v is not None})
    print(write_stress_checkpoint(args.dst, shape, args.seed))


if __name__ == "__main__":
    main()
