"""A routed expert whose matrices are in the q8 kernel's interleaved layout (engine/kernels/q8.py, engine/csrc/q8.h).

A resident expert is rearranged once, in place, so the q8 kernels read a 4-row block as one forward stream
the hardware prefetchers follow (docs/kernels.md, "The interleaved layout"). Products are summed in the same
order, so every output bit equals the row-major expert's: placement changes speed, never tokens. Only the
int8-activation kernels read the layout; other paths compute from a row-major copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kernels.q8 import deinterleave, interleavable, interleave
from engine.kernels.quant import KERNEL_SCALES, QuantizedExpert, QuantizedMatrix


@dataclass(frozen=True)
class InterleavedMatrix:
    """``interleave``'s bytes of one matrix: uint8 [out / 4, spans, span bytes], codes and scales together."""

    packed: torch.Tensor
    code: str
    scale_dtype: torch.dtype
    group_size: int
    in_dim: int
    out_dim: int

    def row_major(self) -> QuantizedMatrix:
        """The matrix as its record held it (a copy)."""
        q, scales = deinterleave(self.packed, self.code, self.scale_dtype, self.group_size)
        return QuantizedMatrix(q.contiguous(), scales, self.code, self.group_size, self.in_dim)


@dataclass(frozen=True)
class InterleavedExpert:
    """A routed expert's gate (w1), down (w2) and up (w3) matrices in the interleaved layout."""

    w1: InterleavedMatrix
    w2: InterleavedMatrix
    w3: InterleavedMatrix
    # q8_experts' plan, as QuantizedExpert keeps it
    q8_plan: tuple[()] | tuple[tuple[object, ...], tuple[int, ...]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def device(self) -> torch.device:
        return self.w1.packed.device

    def tensors(self) -> list[torch.Tensor]:
        """Gate, up, then down: the order a call reads them."""
        return [self.w1.packed, self.w3.packed, self.w2.packed]

    def row_major(self) -> QuantizedExpert:
        """The expert as its record held it (copies)."""
        return QuantizedExpert(self.w1.row_major(), self.w2.row_major(), self.w3.row_major())

    def __call__(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """x [N, dim] -> [N, dim], the row-major expert's bits (a fallback)."""
        return self.row_major()(x, limit)


def interleaves(expert: QuantizedExpert) -> bool:
    """Whether ``interleave_into`` takes this expert: CPU matrices the q8 kernel reads, in shapes the layout tiles."""
    return all(
        m.q.device.type == "cpu"
        and m.scales.dtype in KERNEL_SCALES
        and interleavable(m.code, m.in_dim, m.out_dim, m.group_size)
        for m in (expert.w1, expert.w2, expert.w3)
    )


def interleave_into(
    expert: QuantizedExpert, memory: torch.Tensor, scratch: torch.Tensor | None = None
) -> InterleavedExpert:
    """The expert rearranged into ``memory`` (uint8 1-D, possibly the expert's own bytes): w1, w3, w2 back to
    back, no bytes added. ``interleaves`` must hold. ``scratch`` (``scratch_bytes``) may be reused across
    experts: a fresh allocation per expert costs its page faults."""
    needed = sum(t.nbytes for t in _sources(expert))
    if memory.dtype != torch.uint8 or memory.dim() != 1 or memory.numel() < needed:
        raise ValueError(f"interleave_into: needs {needed} bytes of uint8 memory, got {memory.dtype} {memory.shape}")
    scratch = torch.empty(scratch_bytes(expert), dtype=torch.uint8) if scratch is None else scratch
    copies, at = [], 0
    for t in _sources(expert):  # copy all sources before writing: memory may be theirs
        copies.append(scratch[at : at + t.nbytes].view(t.dtype).view(t.shape).copy_(t))
        at += _aligned(t.nbytes)
    matrices, at = {}, 0
    for (name, m), q, scales in zip(_matrices(expert), copies[0::2], copies[1::2], strict=True):
        size = q.nbytes + scales.nbytes
        packed = interleave(q, scales, m.code, m.group_size, out=memory[at : at + size])
        matrices[name] = InterleavedMatrix(packed, m.code, m.scales.dtype, m.group_size, m.in_dim, m.out_dim)
        at += size
    return InterleavedExpert(matrices["w1"], matrices["w2"], matrices["w3"])


def scratch_bytes(expert: QuantizedExpert) -> int:
    """Bytes of ``interleave_into``'s scratch: the six arrays, each 64-byte aligned."""
    return sum(_aligned(t.nbytes) for t in _sources(expert))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _sources(expert: QuantizedExpert) -> list[torch.Tensor]:
    return [t for _, m in _matrices(expert) for t in (m.q, m.scales)]


def _matrices(expert: QuantizedExpert) -> list[tuple[str, QuantizedMatrix]]:
    return [("w1", expert.w1), ("w3", expert.w3), ("w2", expert.w2)]
