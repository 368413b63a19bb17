"""The bench's llama.cpp section alone, on a stress model of the size you choose (the full bench's 20 layers x
64 experts takes most of an hour; the ratios at 100% RAM depend on the bytes a token reads, which the layer
count scales alike for both contenders and the expert count does not change).

    python tools/bench_llama_cpp.py --work /tmp/llb [--layers 12] [--experts 16] [--budgets 100] [--prefill 128]
                                    [--prefill-activations int8|int8-tiles] [--with-decode]

A --prefill longer than the stress model's 4096 positions makes a model whose context holds it (a new --work).

Needs `pip install 'colibri-stream[peers]'` and `colibri-stream bench --setup-peers` once. Prints the
section's report (each llama.cpp file against ours computed as it is), the ratios and the limit line;
--out keeps results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from colibri_stream.bench.report_peers import llama_cpp_lines
from colibri_stream.bench.stress_model import StressShape
from colibri_stream.bench.suite import FULL, run_bench

CONTEXT_FOR_ANSWER = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="the generated model, our containers, the GGUFs")
    parser.add_argument("--out", type=Path, default=Path("bench-llama-cpp"), help="results.json goes here")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--budgets", default="100", help="comma-separated RAM budgets in %% (the bench: 25,100)")
    parser.add_argument("--prefill", type=int, default=128, help="tokens of the long-prompt TTFT rows")
    parser.add_argument(
        "--prefill-activations",
        choices=("int8", "int8-tiles"),
        help="our path in the long-prompt rows (default: int8-tiles where the CPU has AVX-512 VNNI, else int8)",
    )
    parser.add_argument(
        "--with-decode", action="store_true", help="the decode section too: our default exact path's rows (exact_*)"
    )
    args = parser.parse_args()
    # the context: the longest prompt with room for its answer (an 8192-token prompt needs more than the 4096 default)
    context = max(StressShape().max_position_embeddings, args.prefill + CONTEXT_FOR_ANSWER)
    shape = replace(
        StressShape(), num_hidden_layers=args.layers, n_routed_experts=args.experts, max_position_embeddings=context
    )
    budgets = tuple(int(b) for b in args.budgets.split(","))
    settings = replace(
        FULL,
        shape=shape,
        budgets_pct=budgets,
        llama_cpp_budgets_pct=budgets,
        prefill_tokens=args.prefill,
        prefill_activations=args.prefill_activations,
    )
    command = " ".join(sys.argv)
    results = run_bench(settings, args.work, args.out, command, lambda line: print(f"[bench] {line}", file=sys.stderr),
                        sections=("decode", "llama_cpp") if args.with_decode else ("llama_cpp",))  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print("\n".join(llama_cpp_lines(results)))
    print(f"\nratios: {results['ratios']}")
    for name, row in results["limit_line"]["contenders"].items():
        print(f"limit line {name}: {row['bytes_per_token']} measured {row['measured_tok_per_s']} "
              f"fastest {row['fastest_tok_per_s']} fraction {row['fraction_of_limit']}")  # fmt: skip


if __name__ == "__main__":
    main()
