"""A routed expert whose matrices are in the q8 kernel's interleaved layout (engine/kernels/q8.py, engine/csrc/q8.h).

An expert that stays in one piece of memory for the rest of a run (every expert resident in RAM) can
have its bytes rearranged once, in place: per block of 4 output rows and span of 512 columns, the
span's codes chunk by chunk and row by row, then the 4 rows' scales. The q8 kernels then read a 4-row
block as one forward stream, which the hardware prefetchers follow; row-major, four rows a row apart,
they do not (docs/kernels.md, "The interleaved layout"). The products are the same and summed in the
same order, so every output bit equals the row-major expert's: placement changes speed, never tokens.

Only the int8-activation kernels read the layout (engine/kernels/q8_experts.py's one C call per layer and
engine/csrc/decode_step.c); any other path computes from a row-major copy (``row_major``).
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
    # engine/kernels/q8_experts.py's plan for the fused q8 call, as QuantizedExpert keeps it
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
        """The expert as its record held it (copies): for the paths that do not read the layout."""
        return QuantizedExpert(self.w1.row_major(), self.w2.row_major(), self.w3.row_major())

    def __call__(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """x [N, dim] -> [N, dim], the row-major expert's bits (a fallback: the fused call reads the layout)."""
        return self.row_major()(x, limit)


def interleaves(expert: QuantizedExpert) -> bool:
    """Whether ``interleave_into`` takes this expert: every matrix on the CPU, of codes and a scale dtype the q8
    kernel reads, in a shape the layout tiles (real models' widths; odd test widths are not)."""
    return all(
        m.q.device.type == "cpu"
        and m.scales.dtype in KERNEL_SCALES
        and interleavable(m.code, m.in_dim, m.out_dim, m.group_size)
        for m in (expert.w1, expert.w2, expert.w3)
    )


def interleave_into(
    expert: QuantizedExpert, memory: torch.Tensor, scratch: torch.Tensor | None = None
) -> InterleavedExpert:
    """The expert rearranged into ``memory`` (uint8, 1-D; it may be the memory the expert's own arrays view,
    which this overwrites): w1, w3 then w2, each ``interleave``'s bytes, one after another from the start.
    ``interleaves`` must hold. The layout adds no bytes: the three take what their codes and scales took.
    ``scratch``: uint8 memory of ``scratch_bytes(expert)`` to copy the sources to first, reused by a caller
    that settles many experts (a new allocation per expert costs its page faults: half the time)."""
    needed = sum(t.nbytes for t in _sources(expert))
    if memory.dtype != torch.uint8 or memory.dim() != 1 or memory.numel() < needed:
        raise ValueError(f"interleave_into: needs {needed} bytes of uint8 memory, got {memory.dtype} {memory.shape}")
    scratch = torch.empty(scratch_bytes(expert), dtype=torch.uint8) if scratch is None else scratch
    copies, at = [], 0
    for t in _sources(expert):  # every source copied before anything is written: memory may be theirs
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
    """Bytes of ``interleave_into``'s scratch for this expert: its six arrays, each from a 64-byte boundary."""
    return sum(_aligned(t.nbytes) for t in _sources(expert))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _sources(expert: QuantizedExpert) -> list[torch.Tensor]:
    return [t for _, m in _matrices(expert) for t in (m.q, m.scales)]


def _matrices(expert: QuantizedExpert) -> list[tuple[str, QuantizedMatrix]]:
    return [("w1", expert.w1), ("w3", expert.w3), ("w2", expert.w2)]
