"""The int8 kernels side by side on one matrix (a benchmark, not a test): q8_gemm (every decoded row), the tile
GEMMs (a prompt's rows under --activations int8-tiles, engine/csrc/q8_tiles.c) in both weight layouts, on the AMX
unit where the CPU has it (interleaved), and
torch._int_mm (oneDNN: the bench's int8 limit) at the same shape, best of 5, for each row count.

    python tools/bench_q8_tiles.py [--rows 4,16,96,256] [--shape 1024x2048] [--code int4|int8] [--threads 2]

GMAC/s of each call (x's quantisation included for ours; _int_mm gets int8 inputs, at 17 rows or more).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from engine.kernels.q8 import ISA_AMX, ISA_BEST, TILES, amx_tiles, interleave, q8_matmul, tiles_fast
from engine.kernels.quant import quantized_matrix

GROUP = 64


def rate(call: Callable[[], object], macs: int, repeats: int = 10) -> float:
    """GMAC/s of the best of 5 timings of ``repeats`` calls."""
    call()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - start) / repeats)
    return macs / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="4,16,96,256", help="comma-separated row counts")
    parser.add_argument("--shape", default="1024x2048", help="OUTxIN of the weight")
    parser.add_argument("--code", choices=("int4", "int8"), default="int4")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out, in_dim = (int(v) for v in args.shape.split("x"))
    m = quantized_matrix(torch.randn(out, in_dim) * 0.02, 4 if args.code == "int4" else 8, GROUP)
    packed = interleave(m.q, m.scales, m.code, GROUP)
    print(f"{args.code} {out} x {in_dim}, {args.threads} threads; tile vector path: {tiles_fast()}, AMX: {amx_tiles()}")
    print("| rows | q8_gemm | tiles, interleaved | tiles, row-major | tiles on AMX | torch._int_mm |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, in_dim)
        macs = rows * out * in_dim

        def ours(isa: int, interleaved: bool, x: torch.Tensor = x) -> Callable[[], object]:
            if interleaved:
                return lambda: q8_matmul(x, packed, m.scales, m.code, GROUP, 0, isa, out)
            return lambda: q8_matmul(x, m.q, m.scales, m.code, GROUP, 0, isa)

        a = torch.randint(-127, 128, (max(rows, 17), in_dim), dtype=torch.int8)  # _int_mm wants more than 16 rows
        b = torch.randint(-127, 128, (in_dim, out), dtype=torch.int8)
        cells = [
            rate(ours(ISA_BEST, True), macs),
            rate(ours(ISA_BEST | TILES, True), macs),
            rate(ours(ISA_BEST | TILES, False), macs),
            rate(ours(ISA_AMX | TILES, True), macs),
            rate(lambda a=a, b=b: torch._int_mm(a, b), max(rows, 17) * out * in_dim),
        ]
        print(f"| {rows} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
