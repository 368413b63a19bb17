"""Group-wise quantised matrices (pure functions) and the quantised routed expert.

A weight [out, in] has one scale per ``group_size`` consecutive input columns; a row's last group may be
partial (its scale from its own elements). Nibble group sizes are even, so no byte holds two groups.

Codes: int4 nibble n -> n - 8 (ours -7..7, pack-quantized -8..7); fp4 nibble -> e2m1 (bit 3 sign, bits 0-2
index 0, 0.5, 1, 1.5, 2, 3, 4, 6: MXFP4, V4's experts); int8. Nibbles two per byte, even column low; an odd
row ends with a padding nibble (8 / +0.0); row r starts at byte r * ceil(in / 2).

Scales: float16 (ours: its rounding is far below int4's step), bfloat16 (pack-quantized, as shipped), or e8m0
(uint8 exponent e -> 2^(e - 127), MXFP4's and V4's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.kernels.activation import swiglu
from engine.kernels.modes import activations_are_int8
from engine.kernels.native import _kernels
from engine.kernels.q8 import q8_kernel_handles, q8_matmul
from engine.kernels.rows import by_segment, computing_alone, in_row_chunks, kernel_threads, linear, row_segments

QMAX = {4: 7, 8: 127}
SCALE_DTYPE = torch.float16
NIBBLE_CODES = ("int4", "fp4")
E8M0 = torch.uint8  # e8m0 scales are held as their raw exponent bytes (any device, numpy too)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# The C kernels' names for codes and scale dtypes (engine/csrc/nibble.h); int8 stays on torch.
KERNEL_CODES = {"int4": 0, "fp4": 1}
KERNEL_SCALES = {torch.float16: 0, torch.bfloat16: 1, E8M0: 2}
# Up to this many rows, unpacking the codes once per MAX_ROWS beats dequantising once for sgemm
# (docs/kernels.md, "A short prompt's rows through the kernels"); the bits depend on the row count alone.
PROMPT_KERNEL_ROWS = 128


def n_groups(in_dim: int, group_size: int) -> int:
    """Groups per row; the last one may be partial."""
    return -(-in_dim // group_size)


def packed_width(in_dim: int) -> int:
    """Bytes per row of nibble codes."""
    return -(-in_dim // 2)


def check_group_size(code: str, group_size: int) -> None:
    """Refuse only group sizes no layout can hold."""
    if type(group_size) is not int or group_size < 1:
        raise ValueError(f"group size {group_size!r:.40} is not a positive integer")
    if code in NIBBLE_CODES and group_size % 2:
        raise ValueError(
            f"group size {group_size} is odd: {code} packs two weights per byte, so an odd group would "
            "split a byte between two scales"
        )


def _pad_columns(w: torch.Tensor, width: int) -> torch.Tensor:
    return w if w.shape[1] == width else F.pad(w, (0, width - w.shape[1]))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] values 0..15 -> uint8 [out, ceil(in / 2)], even column low; odd widths padded
    with 8 (int4's zero)."""
    if codes.shape[1] % 2:
        codes = F.pad(codes, (0, 1), value=8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def quantize(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (q, scales [out, ceil(in / group)] float16), symmetric absmax per group.

    q is uint8 [out, ceil(in / 2)] (int4 nibbles) for 4 bits, int8 [out, in] for 8 bits."""
    check_group_size("int4" if bits == 4 else "int8", group_size)
    out_dim, in_dim = w.shape
    groups = n_groups(in_dim, group_size)
    qmax = QMAX[bits]
    # zero padding changes no group's absmax, so the partial group's scale is its own elements'
    padded = _pad_columns(w.float(), groups * group_size).reshape(out_dim, groups, group_size)
    scales = (padded.abs().amax(dim=-1) / qmax).to(SCALE_DTYPE)
    # Quantise against the float16 scale actually stored, so dequantisation inverts exactly this.
    safe = torch.where(scales == 0, torch.ones_like(scales), scales).float()
    q = torch.round(padded / safe[..., None]).clamp_(-qmax, qmax).reshape(out_dim, -1)[:, :in_dim].to(torch.int8)
    if bits == 8:
        return q.contiguous(), scales
    return pack_nibbles((q + 8).to(torch.uint8)), scales


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """Stored scales -> float32 (e8m0: 2^(e - 127), 0xFF NaN as in the MX spec)."""
    if scales.dtype == torch.float8_e8m0fnu:
        scales = scales.view(E8M0)
    if scales.dtype != E8M0:
        return scales.to(torch.float32)
    e = scales.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)  # 2^-127 is float32-subnormal
    values = bits.view(torch.float32)
    return torch.where(e == 255, torch.full_like(values, float("nan")), values)


def code_values(q: torch.Tensor, code: str, in_dim: int) -> torch.Tensor:
    """The unscaled element values [out, in] float32 of stored codes."""
    if code == "int8":
        return q.to(torch.float32)
    out_dim = q.shape[0]
    nibbles = torch.empty((out_dim, q.shape[1], 2), dtype=torch.uint8, device=q.device)
    nibbles[..., 0] = q & 0x0F
    nibbles[..., 1] = q >> 4
    nibbles = nibbles.view(out_dim, -1)[:, :in_dim]
    if code == "int4":
        return nibbles.to(torch.float32).sub_(8)
    table = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=torch.float32, device=q.device)
    return table[nibbles.long()]


@dataclass(frozen=True)
class QuantizedMatrix:
    """A group-quantised [out, in] weight: codes ``q``, one scale per group."""

    q: torch.Tensor  # int4/fp4: uint8 [out, ceil(in / 2)]; int8: int8 [out, in]
    scales: torch.Tensor  # float16 | bfloat16 | uint8 (e8m0) [out, ceil(in / group_size)]
    code: str
    group_size: int
    in_dim: int

    @property
    def out_dim(self) -> int:
        return self.q.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> [out, in] in ``dtype`` (computed in float32, then cast); C and torch give the same bits."""
        if _kernel_handles(self):
            w = torch.empty((self.out_dim, self.in_dim), dtype=torch.float32)
            _kernels.dequant(self.q.data_ptr(), self.scales.data_ptr(), w.data_ptr(), *_kernel_shape(self))
            return w.to(dtype)
        return dequantize_torch(self, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] @ W^T: up to PROMPT_KERNEL_ROWS float32 CPU rows (any number inside rows_alone() or
        int8_activations()) through a C kernel, else dequantise once and a dense matmul."""
        if x.shape[0] and row_segments(x.shape[0]) is not None:
            return by_segment(self.matmul, x)
        if activations_are_int8() and _q8_handles(self, x):
            return q8_matmul(x, self.q, self.scales, self.code, self.group_size, KERNEL_SCALES[self.scales.dtype])
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":
            # not torch's bf16 matmul: oneDNN keeps a primitive per shape, and expert row counts vary, so
            # memory grows (docs/benchmarks-log.md, "Figures behind the code")
            return self.matmul(x.float()).to(torch.bfloat16)
        alone = computing_alone()
        if _kernel_handles(self) and x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[0] > 0:
            if alone or x.shape[0] <= PROMPT_KERNEL_ROWS:
                return in_row_chunks(x, _kernels.MAX_ROWS, lambda rows: kernel_matmul(rows, self, alone=alone))
        return linear(x, self.dequantize(x.dtype))


def quantized_matrix(w: torch.Tensor, bits: int, group_size: int) -> QuantizedMatrix:
    """Our own symmetric quantisation of a float matrix (int4 or int8, float16 scales)."""
    q, scales = quantize(w, bits, group_size)
    return QuantizedMatrix(q, scales, "int4" if bits == 4 else "int8", group_size, w.shape[1])


def dequantize_torch(m: QuantizedMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference dequantisation in torch (any device); temporaries ~2x the result, as it runs per token."""
    groups = m.scales.shape[1]
    w = _pad_columns(code_values(m.q, m.code, m.in_dim), groups * m.group_size)
    w.view(m.out_dim, groups, m.group_size).mul_(scale_values(m.scales)[..., None])
    return w[:, : m.in_dim].to(dtype)


def int4_kernel_available() -> bool:
    return _kernels is not None


def _kernel_handles(m: QuantizedMatrix) -> bool:
    """Whether the C kernel takes this matrix (4-bit codes, contiguous, on the CPU)."""
    return (
        _kernels is not None
        and m.code in KERNEL_CODES
        and m.scales.dtype in KERNEL_SCALES
        and m.q.device.type == "cpu"
        and m.q.is_contiguous()
        and m.scales.is_contiguous()
    )


def _q8_handles(m: QuantizedMatrix, x: torch.Tensor) -> bool:
    """Whether the int8-activation kernel takes this matrix and x."""
    return (
        m.q.device.type == "cpu"
        and m.q.is_contiguous()
        and m.scales.is_contiguous()
        and m.scales.dtype in KERNEL_SCALES
        and q8_kernel_handles(m.code, m.group_size, x)
    )


def _kernel_shape(m: QuantizedMatrix) -> tuple[int, int, int, int, int]:
    """(out, in, group, code, scale kind): the C dequantiser's trailing arguments."""
    return m.out_dim, m.in_dim, m.group_size, KERNEL_CODES[m.code], KERNEL_SCALES[m.scales.dtype]


KERNEL_ISA = {"best": 2, "avx2": 1, "scalar": 0}  # nibble.h nibble_gemm's simd cap


def kernel_matmul(x: torch.Tensor, m: QuantizedMatrix, alone: bool = False, isa: str = "best") -> torch.Tensor:
    """x [rows <= MAX_ROWS, in] float32 @ dequant(m)^T -> [rows, out] (C kernel). ``alone``: each row as a
    one-row call. ``isa`` caps the loops ("scalar" sums in another order than the SIMD ones)."""
    rows, in_dim = x.shape
    if in_dim != m.in_dim:
        raise ValueError(f"x has {in_dim} columns, the quantised matrix {m.in_dim} inputs")
    x = x.contiguous()
    y = torch.empty((rows, m.out_dim), dtype=torch.float32)
    work = torch.empty(_kernels.work_floats(max(rows, 1), in_dim, m.group_size), dtype=torch.float32)
    _kernels.gemm(
        m.q.data_ptr(),
        m.scales.data_ptr(),
        x.data_ptr(),
        y.data_ptr(),
        rows,
        in_dim,
        m.out_dim,
        m.group_size,
        work.data_ptr(),
        KERNEL_ISA[isa],
        kernel_threads(),
        KERNEL_CODES[m.code],
        KERNEL_SCALES[m.scales.dtype],
        alone,
    )
    return y


@dataclass(frozen=True)
class QuantizedExpert:
    """A routed expert whose gate (w1), down (w2) and up (w3) matrices are group-quantised."""

    w1: QuantizedMatrix
    w2: QuantizedMatrix
    w3: QuantizedMatrix
    # q8_experts' plan for the fused call (None: not yet, (): not fusable); kept here because a store builds
    # its experts once per slot, not once per read
    q8_plan: tuple[()] | tuple[tuple[object, ...], tuple[int, ...]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # nibble_experts' plan for the fused float32 call
    nibble_plan: tuple[()] | tuple[tuple[int, ...], tuple[int, ...]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def device(self) -> torch.device:
        return self.w1.q.device

    def fusable(self) -> bool:
        """Whether one fused C call takes it: contiguous CPU matrices, one scale dtype, w3 as w1, w2 transposed."""
        w1, w3, w2 = self.w1, self.w3, self.w2
        return (
            all(m.q.device.type == "cpu" and m.q.is_contiguous() and m.scales.is_contiguous() for m in (w1, w3, w2))
            and w1.scales.dtype == w3.scales.dtype == w2.scales.dtype
            and (w3.code, w3.group_size, w3.in_dim, w3.out_dim) == (w1.code, w1.group_size, w1.in_dim, w1.out_dim)
            and (w2.in_dim, w2.out_dim) == (w1.out_dim, w1.in_dim)
        )

    def tensors(self) -> list[torch.Tensor]:
        """Codes and scales in the order a call reads them: gate, up, down."""
        return [t for m in (self.w1, self.w3, self.w2) for t in (m.q, m.scales)]

    def __call__(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """x [N, dim] -> [N, dim]: the SwiGLU FFN, clamped at ``limit`` if set."""
        return self.w2.matmul(swiglu(self.w1.matmul(x), self.w3.matmul(x), limit))
