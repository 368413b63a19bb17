"""Side-by-side measurement of the 4-bit expert FFN against memcpy of the same bytes, per record kind.

Each kind walks a working set of expert records larger than the CPU caches (as experts streaming
through RAM slots are), so the ratio of packed bytes/s through the FFN to memcpy's says how close
expert compute gets to memory bandwidth, for one row (decode) and a few rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels.quant import (
    E8M0,
    QuantizedExpert,
    QuantizedMatrix,
    dequantize_torch,
    int4_kernel_available,
    quantized_matrix,
)

# record kind -> (code, scale dtype, group): our int4, compressed-tensors pack-quantized, MXFP4
KINDS = {
    "int4-f16-g64": ("int4", torch.float16, 64),
    "int4-bf16-g32": ("int4", torch.bfloat16, 32),
    "mxfp4-e8m0-g32": ("fp4", E8M0, 32),
}
LEGACY_KIND = "int4-f16-g64"  # the top-level int4_* keys


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def make_experts(n: int, dim: int, inter: int, group: int = 64, seed: int = 0) -> list[QuantizedExpert]:
    """Experts quantised by our own int4 quantiser from random weights (realistic codes, slower to make)."""
    gen = torch.Generator().manual_seed(seed)

    def matrix(out_dim: int, in_dim: int) -> QuantizedMatrix:
        return quantized_matrix(torch.randn(out_dim, in_dim, generator=gen) * 0.02, 4, group)

    return [QuantizedExpert(matrix(inter, dim), matrix(dim, inter), matrix(inter, dim)) for _ in range(n)]


def random_kind_matrix(
    code: str, scale_dtype: torch.dtype, group: int, out_dim: int, in_dim: int, gen: torch.Generator
) -> QuantizedMatrix:
    """Random codes (an odd width's padding nibble random too) and random scales of one kind: e8m0
    exponents 2^-8 .. 2^-3 as trained MXFP4 scales are, float scales 0.01 .. 0.11."""
    q = torch.randint(0, 256, (out_dim, -(-in_dim // 2)), generator=gen, dtype=torch.uint8)
    shape = (out_dim, -(-in_dim // group))
    if scale_dtype == E8M0:
        scales = torch.randint(119, 125, shape, generator=gen, dtype=torch.uint8)
    else:
        scales = (torch.rand(shape, generator=gen) * 0.1 + 0.01).to(scale_dtype)
    return QuantizedMatrix(q, scales, code, group, in_dim)


def make_kind_experts(kind: str, n: int, dim: int, inter: int, seed: int = 0) -> list[QuantizedExpert]:
    """Experts of one record kind with random codes and scales (the kernel's speed does not depend on
    the values)."""
    gen = torch.Generator().manual_seed(seed)

    def matrix(out_dim: int, in_dim: int) -> QuantizedMatrix:
        return random_kind_matrix(*KINDS[kind], out_dim, in_dim, gen)

    return [QuantizedExpert(matrix(inter, dim), matrix(dim, inter), matrix(inter, dim)) for _ in range(n)]


def expert_bytes(expert: QuantizedExpert) -> int:
    """Packed bytes of an expert: codes and scales."""
    return sum(
        m.q.numel() * m.q.element_size() + m.scales.numel() * m.scales.element_size()
        for m in (expert.w1, expert.w2, expert.w3)
    )


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    return _best_seconds(lambda: np.copyto(target, source), repeats)


def measure_kind(kind: str, n_experts: int, dim: int, inter: int, rows: tuple[int, ...], repeats: int) -> dict:
    """Packed GB/s of one kind through the FFN for each row count, and memcpy over the same bytes."""
    experts = make_kind_experts(kind, n_experts, dim, inter)
    total = sum(expert_bytes(e) for e in experts)
    memcpy_s = memcpy_seconds(total, repeats)
    result: dict[str, Any] = {"working_set_bytes": total, "memcpy_GBps": round(total / memcpy_s / 1e9, 2), "rows": {}}
    for n in rows:
        x = torch.randn(n, dim)
        ffn_s = _best_seconds(lambda x=x: [e(x) for e in experts], repeats)  # type: ignore[misc]  # x bound per row
        result["rows"][str(n)] = {"ffn_GBps": round(total / ffn_s / 1e9, 2), "vs_memcpy": round(memcpy_s / ffn_s, 3)}
    return result


def torch_seconds_per_expert(experts: list[QuantizedExpert], x: torch.Tensor, repeats: int) -> float:
    """The path before the kernel: torch dequantise, then F.linear (slow: time it on a few experts)."""

    def run() -> None:
        for e in experts:
            w1, w2, w3 = (dequantize_torch(m) for m in (e.w1, e.w2, e.w3))
            F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    return _best_seconds(run, repeats) / len(experts)


def measure(
    n_experts: int = 8, dim: int = 7168, inter: int = 2048, rows: int = 1, few_rows: int = 4, repeats: int = 3
) -> dict:
    """Per record kind (``kinds``): packed GB/s through the FFN at ``rows`` and ``few_rows`` rows against
    memcpy over the same bytes; the top-level int4_* keys are int4-f16-g64 at ``rows``, with torch's
    dequantise + matmul for comparison. Defaults: 8 experts of DeepSeek-V3's shape (7168 x 2048,
    ~23 MB each at 4 bits: ~190 MB per kind, beyond the caches); one process, one run."""
    row_counts = tuple(dict.fromkeys((rows, few_rows)))
    kinds = {kind: measure_kind(kind, n_experts, dim, inter, row_counts, repeats) for kind in KINDS}
    legacy = kinds[LEGACY_KIND]
    total, main = legacy["working_set_bytes"], legacy["rows"][str(rows)]
    kernel_s = total / (main["ffn_GBps"] * 1e9)
    sample = make_kind_experts(LEGACY_KIND, min(4, n_experts), dim, inter)
    torch_s = torch_seconds_per_expert(sample, torch.randn(rows, dim), repeats) * n_experts
    return {
        "int4_kernel": int4_kernel_available(),
        "threads": torch.get_num_threads(),
        "rows": rows,
        "few_rows": few_rows,
        "expert_shape": [dim, inter],
        "working_set_bytes": total,
        "memcpy_GBps": legacy["memcpy_GBps"],
        "int4_ffn_GBps": main["ffn_GBps"],
        "torch_dequant_matmul_GBps": round(total / torch_s / 1e9, 3),
        "ratios": {
            "int4_ffn_vs_memcpy": main["vs_memcpy"],
            "int4_ffn_vs_torch_dequant": round(torch_s / kernel_s, 1),
        },
        "kinds": kinds,
    }
