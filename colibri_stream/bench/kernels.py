"""Side-by-side measurement of the int4 expert FFN against memcpy of the same bytes.

Both walk the same working set of expert records (larger than the CPU caches, as experts streaming
through RAM slots are), so the ratio says how close expert compute gets to memory bandwidth.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from engine.quant import QuantizedExpert, QuantizedMatrix, dequantize_torch, int4_kernel_available, quantized_matrix


def _best_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def make_experts(n: int, dim: int, inter: int, group: int = 64, seed: int = 0) -> list[QuantizedExpert]:
    gen = torch.Generator().manual_seed(seed)

    def matrix(out_dim: int, in_dim: int) -> QuantizedMatrix:
        return quantized_matrix(torch.randn(out_dim, in_dim, generator=gen) * 0.02, 4, group)

    return [QuantizedExpert(matrix(inter, dim), matrix(dim, inter), matrix(inter, dim)) for _ in range(n)]


def expert_bytes(expert: QuantizedExpert) -> int:
    return sum(m.q.numel() + m.scales.numel() * 2 for m in (expert.w1, expert.w2, expert.w3))


def measure(n_experts: int = 8, dim: int = 7168, inter: int = 2048, rows: int = 1, repeats: int = 3) -> dict:
    """GB/s of int4 expert bytes through the FFN (kernel, and torch dequantise+matmul on a sample)
    against memcpy GB/s over the same total bytes; one process, one run. Defaults: 8 experts of
    DeepSeek-V3's real shape (7168 x 2048, 23 MB each at int4: 188 MB, beyond the caches)."""
    experts = make_experts(n_experts, dim, inter)
    total = sum(expert_bytes(e) for e in experts)
    x = torch.randn(rows, dim)
    source = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    target = np.empty_like(source)
    memcpy_s = _best_seconds(lambda: np.copyto(target, source), repeats)
    kernel_s = _best_seconds(lambda: [e(x) for e in experts], repeats)
    sample = experts[:4]

    def torch_path() -> None:
        for e in sample:
            w1, w2, w3 = (dequantize_torch(m) for m in (e.w1, e.w2, e.w3))
            F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    torch_s = _best_seconds(torch_path, repeats) * n_experts / len(sample)
    return {
        "int4_kernel": int4_kernel_available(),
        "threads": torch.get_num_threads(),
        "rows": rows,
        "expert_shape": [dim, inter],
        "working_set_bytes": total,
        "memcpy_GBps": round(total / memcpy_s / 1e9, 2),
        "int4_ffn_GBps": round(total / kernel_s / 1e9, 2),
        "torch_dequant_matmul_GBps": round(total / torch_s / 1e9, 3),
        "ratios": {
            "int4_ffn_vs_memcpy": round(memcpy_s / kernel_s, 3),
            "int4_ffn_vs_torch_dequant": round(torch_s / kernel_s, 1),
        },
    }
