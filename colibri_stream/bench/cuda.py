"""CUDA micro-benchmarks of the VRAM tier, side by side in one process (only where CUDA is present).

- h2d: pinned host -> VRAM copy GB/s of expert records (what promotes a RAM hit into VRAM);
- gpu_ffn: GB/s of int4 expert bytes through the FFN on the GPU (dequantise + float32 matmul, one row);
- overlap: copy-then-compute of a working set of experts with the copies on the compute stream vs on
  the store's side stream (storage.tiers.device_copy.DeviceCopies); ``ratios.side_stream_speedup`` > 1 means
  the copies hide behind compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from colibri_stream.bench.kernels import expert_bytes, make_experts
from engine.kernels.quant import QuantizedExpert
from storage.tiers.device_copy import DeviceCopies


def _best_cuda_seconds(fn: Callable[[], None], repeats: int) -> float:
    """Best of ``repeats`` timings with CUDA events, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def _flat(expert: QuantizedExpert) -> list[torch.Tensor]:
    return [t for m in (expert.w1, expert.w2, expert.w3) for t in (m.q, m.scales)]


def _on(expert: QuantizedExpert, tensors: list[torch.Tensor]) -> QuantizedExpert:
    """The expert over ``tensors`` (same order as _flat)."""
    it = iter(tensors)
    return QuantizedExpert(*(replace(m, q=next(it), scales=next(it)) for m in (expert.w1, expert.w2, expert.w3)))


def measure_cuda(n_experts: int = 8, dim: int = 7168, inter: int = 2048, repeats: int = 5) -> dict:
    """Defaults: 8 experts of DeepSeek-V3's shape (23 MB each at int4)."""
    device = torch.device("cuda")
    experts = make_experts(n_experts, dim, inter)
    total = sum(expert_bytes(e) for e in experts)
    host = [[t.pin_memory() for t in _flat(e)] for e in experts]
    vram = [[torch.empty_like(t, device=device) for t in ts] for ts in host]
    on_gpu = [_on(e, ts) for e, ts in zip(experts, vram, strict=True)]
    x = torch.randn(1, dim, device=device)

    def copy_all() -> None:
        for src, dst in zip(host, vram, strict=True):
            for s, d in zip(src, dst, strict=True):
                d.copy_(s, non_blocking=True)

    def compute_all() -> None:
        for e in on_gpu:
            e(x)

    def serial() -> None:  # every copy on the compute stream: nothing overlaps
        for e, src, dst in zip(on_gpu, host, vram, strict=True):
            for s, d in zip(src, dst, strict=True):
                d.copy_(s, non_blocking=True)
            e(x)

    copies = DeviceCopies(device)
    slots = {(i, j): n for n, (i, j) in enumerate((i, j) for i, ts in enumerate(host) for j in range(len(ts)))}

    def side_stream() -> None:  # as the tiered store does: copies on a side stream, compute waits per expert
        for i, e in enumerate(on_gpu):
            for j, (s, d) in enumerate(zip(host[i], vram[i], strict=True)):
                copies.copy((i, j), slots[i, j], d, s)  # every tensor its own slot
            e(x)
        for key, slot in slots.items():
            copies.release(key, slot)

    h2d_s = _best_cuda_seconds(copy_all, repeats)
    ffn_s = _best_cuda_seconds(compute_all, repeats)
    serial_s = _best_cuda_seconds(serial, repeats)
    side_s = _best_cuda_seconds(side_stream, repeats)
    return {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "expert_shape": [dim, inter],
        "working_set_bytes": total,
        "h2d_GBps": round(total / h2d_s / 1e9, 2),
        "gpu_ffn_GBps": round(total / ffn_s / 1e9, 2),
        "copy_then_compute_serial_s": round(serial_s, 6),
        "copy_then_compute_side_stream_s": round(side_s, 6),
        "ratios": {"side_stream_speedup": round(serial_s / side_s, 3)},
    }
