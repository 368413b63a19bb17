"""`colibri-stream bench --kernels`: expert-compute micro-benchmarks measured side by side.

The full side-by-side bench (raw disk, budgets, the accelerate peer, Belady, sessions) is not built
yet; asking for it says so instead of printing partial numbers.
"""

from __future__ import annotations

import argparse
import json

import torch

from colibri_stream.kernel_bench import measure


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "bench",
        help="measure expert compute against memcpy (--kernels)",
        description="Micro-benchmarks of the int4 expert FFN and memcpy over the same bytes, in one run.",
        epilog="example: colibri-stream bench --kernels --json",
    )
    parser.add_argument("--kernels", action="store_true", help="run the expert-FFN vs memcpy micro-benchmarks")
    parser.add_argument("--experts", type=int, default=8, help="experts in the working set (default 8)")
    parser.add_argument("--dim", type=int, default=7168, help="hidden size of the experts (default 7168, DeepSeek-V3)")
    parser.add_argument("--inter", type=int, default=2048, help="expert intermediate size (default 2048, DeepSeek-V3)")
    parser.add_argument("--rows", type=int, default=1, help="activation rows per expert call (default 1: decode)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.set_defaults(handler=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    if not args.kernels:
        raise ValueError("only `bench --kernels` exists so far; the full side-by-side benchmark is not built yet")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(n_experts=args.experts, dim=args.dim, inter=args.inter, rows=args.rows)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"int4 expert FFN {result['int4_ffn_GBps']} GB/s, memcpy {result['memcpy_GBps']} GB/s "
            f"(ratio {result['ratios']['int4_ffn_vs_memcpy']}), torch dequantise+matmul "
            f"{result['torch_dequant_matmul_GBps']} GB/s"
        )
    return 0
