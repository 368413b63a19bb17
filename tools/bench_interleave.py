"""The dense codes (or the routed experts) row-major vs in the q8 kernel's interleaved layout
(engine/csrc/q8.h), int8 activations, experts resident: the same model loaded twice in one process,
alternating rounds so machine noise hits both alike.

python tools/bench_interleave.py CONTAINER [--part dense|experts] [--threads 1,2] [--rounds 5] [--tokens 64]

CONTAINER: one converted with `--dense int8` or `--dense int4` (e.g. from `tools/make_stress_model.py`).
Per thread count it prints the kernel alone (dense: every interleaved matrix of the model once per sweep,
one row of x, GB/s of codes and scales) and decode tok/s (the median round), and whether the greedy ids
agree (they must: the same products in the same order). ``--part experts``: both models' dense codes
interleaved, the experts row-major in one (engine/kernels/interleaved_expert.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

import colibri_stream.experts.codec as codec
import colibri_stream.runtime.loader as loader
import engine.kernels.int8_dense as int8_dense
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import LoadedModel, load_container
from engine.kernels.int8_dense import CodedLinear
from engine.kernels.q8 import deinterleave, q8_matmul
from engine.kernels.quant import KERNEL_SCALES
from storage.container.layout import ExpertRecordLayout

LAYOUTS = ("row-major", "interleaved")


def row_major_settler(layout: ExpertRecordLayout) -> Callable[[object], object]:
    """What the loader's Settler would be if it left every record row-major."""
    return partial(codec.expert_from_record, layout)


def load_both(container: Path, part: str) -> dict[str, LoadedModel]:
    held_dense, held_experts = int8_dense.interleave_codes, codec.Settler
    try:  # the loader's names for them
        if part == "dense":
            loader.interleave_codes = lambda model: 0  # type: ignore[attr-defined]
        else:
            loader.Settler = row_major_settler  # type: ignore[attr-defined,assignment]
        row_major = load_container(container, int8_activations=True)
    finally:
        loader.interleave_codes, loader.Settler = held_dense, held_experts  # type: ignore[attr-defined]
    return {"row-major": row_major, "interleaved": load_container(container, int8_activations=True)}


def kernel_sweeps(model: torch.nn.Module, rounds: int) -> dict[str, float]:
    """GB/s of one q8 gemm row over every interleaved matrix, in each layout (the median of ``rounds``)."""
    layers = [m for m in model.modules() if isinstance(m, CodedLinear) and m.interleaved]
    row_major = [deinterleave(m.q, m.code, m.scales.dtype, m.group_size) for m in layers]
    total = sum(q.nbytes + s.nbytes for q, s in row_major)
    xs = [torch.randn(1, m.in_dim) for m in layers]

    def sweep(layout: str) -> float:
        started = time.perf_counter()
        for m, (q, s), x in zip(layers, row_major, xs, strict=True):
            kind = KERNEL_SCALES[m.scales.dtype]
            if layout == "interleaved":
                q8_matmul(x, m.q, m.scales, m.code, m.group_size, kind, out_dim=m.out_dim)
            else:
                q8_matmul(x, q, s, m.code, m.group_size, kind)
        return total / (time.perf_counter() - started) / 1e9

    rates: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for _ in range(rounds):
        for layout in LAYOUTS:
            rates[layout].append(sweep(layout))
    return {layout: statistics.median(values) for layout, values in rates.items()}


def decode_rounds(models: dict[str, LoadedModel], prompt: list[int], tokens: int, rounds: int) -> dict[str, float]:
    rates: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    ids = {}
    for loaded in models.values():
        generate(loaded.model, prompt, 8, loaded.experts)  # first-use work (plans, pages) outside the rounds
    for _ in range(rounds):
        for layout, loaded in models.items():
            result = generate(loaded.model, prompt, tokens, loaded.experts)
            rates[layout].append(result.stats.decode_tokens / max(result.stats.decode_s, 1e-9))
            ids[layout] = result.ids
    if ids["row-major"] != ids["interleaved"]:
        raise SystemExit("the layouts gave different tokens")
    return {layout: statistics.median(values) for layout, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("container", type=Path)
    parser.add_argument("--part", choices=("dense", "experts"), default="dense", help="what one model holds row-major")
    parser.add_argument("--threads", default="1,2", help="comma-separated kernel thread counts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    models = load_both(args.container, args.part)
    interleaved = sum(m.interleaved for m in models["interleaved"].model.modules() if isinstance(m, CodedLinear))
    print(f"{interleaved} dense matrices interleaved")
    prompt = [10 + (31 * j) % 1000 for j in range(32)]
    print("| threads | kernel GB/s row-major | interleaved | decode tok/s row-major | interleaved | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        nothing = {layout: float("nan") for layout in LAYOUTS}
        kernel = kernel_sweeps(models["interleaved"].model, 3 * args.rounds) if args.part == "dense" else nothing
        decode = decode_rounds(models, prompt, args.tokens, args.rounds)
        ratio = decode["interleaved"] / decode["row-major"]
        print(
            f"| {threads} | {kernel['row-major']:.1f} | {kernel['interleaved']:.1f} | {decode['row-major']:.1f} | "
            f"{decode['interleaved']:.1f} | {ratio:.3f} |"
        )


if __name__ == "__main__":
    main()
