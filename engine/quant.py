"""Group-wise symmetric quantisation primitives (pure functions) and the quantised routed expert.

A weight [out, in] is cut into groups of ``group_size`` consecutive input columns; each group gets one
scale = absmax / qmax and values q = round(w / scale) clamped to [-qmax, qmax]. int4 stores q + 8 as
nibbles, two per byte along the input dimension (even column in the low nibble); int8 stores q as
int8. Scales are float16: 10 mantissa bits put the scale's own rounding error (<= 2^-11 relative)
far below int4's step (1/7 of the group's absmax), at half the bytes of float32; bf16's 7 bits would
not be negligible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # the C kernel (engine/csrc/int4.c), built at install time when a compiler is there
    from engine import _int4
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    _int4 = None


QMAX = {4: 7, 8: 127}
SCALE_DTYPE = torch.float16


def quantize(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (q, scales [out, in // group] float16).

    q is uint8 [out, in // 2] (packed nibbles) for 4 bits, int8 [out, in] for 8 bits.
    """
    out_dim, in_dim = w.shape
    if in_dim % group_size:
        raise ValueError(f"input dimension {in_dim} is not a multiple of the group size {group_size}")
    qmax = QMAX[bits]
    groups = w.float().reshape(out_dim, in_dim // group_size, group_size)
    scales = (groups.abs().amax(dim=-1) / qmax).to(SCALE_DTYPE)
    # Quantise against the float16 scale actually stored, so dequantisation inverts exactly this.
    safe = torch.where(scales == 0, torch.ones_like(scales), scales).float()
    q = torch.round(groups / safe[..., None]).clamp_(-qmax, qmax).reshape(out_dim, in_dim).to(torch.int8)
    if bits == 8:
        return q, scales
    nibbles = (q + 8).to(torch.uint8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize``: -> [out, in] in ``dtype`` (computed in float32, then cast).

    int4 on the CPU goes through the C kernel's one-pass dequantiser (bit-identical to the torch
    version: the same float operations), everything else through ``dequantize_torch``."""
    if bits == 4 and _int4 is not None and q.device.type == "cpu" and q.is_contiguous() and scales.is_contiguous():
        w = torch.empty((q.shape[0], q.shape[1] * 2), dtype=torch.float32)
        _int4.dequant(
            q.data_ptr(), scales.data_ptr(), w.data_ptr(), w.shape[0], w.shape[1], w.shape[1] // scales.shape[1]
        )
        return w.to(dtype)
    return dequantize_torch(q, scales, bits, dtype)


def dequantize_torch(
    q: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The reference dequantisation in torch (any device). Keeps temporaries small (peak about 1.5x
    the float32 result): experts are dequantised per call, so these bytes come and go per token."""
    out_dim = q.shape[0]
    if bits == 4:
        w = torch.empty((out_dim, q.shape[1], 2), dtype=torch.float32, device=q.device)
        w[..., 0] = q & 0x0F
        w[..., 1] = q >> 4
        w = w.view(out_dim, -1).sub_(8)
    else:
        w = q.to(torch.float32)
    in_dim = w.shape[1]
    w.view(out_dim, scales.shape[1], -1).mul_(scales.to(torch.float32)[..., None])
    return w.view(out_dim, in_dim).to(dtype)


def int4_kernel_available() -> bool:
    return _int4 is not None


def int4_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, force_scalar: bool = False) -> torch.Tensor:
    """x [rows <= MAX_ROWS, in] float32 @ dequant(q, scales)^T -> [rows, out], reading q once (C kernel)."""
    rows, in_dim = x.shape
    out_dim, groups = scales.shape
    x = x.contiguous()
    y = torch.empty((rows, out_dim), dtype=torch.float32)
    work = torch.empty(rows * (in_dim + groups), dtype=torch.float32)
    _int4.gemm(
        q.data_ptr(),
        scales.data_ptr(),
        x.data_ptr(),
        y.data_ptr(),
        rows,
        in_dim,
        out_dim,
        in_dim // groups,
        work.data_ptr(),
        force_scalar,
        torch.get_num_threads(),  # 2+: a persistent helper thread takes half of the output rows
    )
    return y


@dataclass(frozen=True)
class QuantizedMatrix:
    q: torch.Tensor
    scales: torch.Tensor
    bits: int

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.q, self.scales, self.bits, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] @ W^T. Few float32 rows on the CPU go through the int4 kernel; everything else
        (prefill-sized batches, bf16, int8, other devices) dequantises once and uses a dense matmul."""
        if (
            self.bits == 4
            and _int4 is not None
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and self.q.device.type == "cpu"
            and 0 < x.shape[0] <= _int4.MAX_ROWS
            and self.q.is_contiguous()
            and self.scales.is_contiguous()
        ):
            return int4_matmul(x, self.q, self.scales)
        return F.linear(x, self.dequantize(x.dtype))


@dataclass(frozen=True)
class QuantizedExpert:
    """A routed expert whose gate (w1), down (w2) and up (w3) matrices are group-quantised."""

    w1: QuantizedMatrix
    w2: QuantizedMatrix
    w3: QuantizedMatrix

    @property
    def device(self) -> torch.device:
        return self.w1.q.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, dim] -> [N, dim]: the SwiGLU FFN, one quantised matrix at a time."""
        hidden = F.silu(self.w1.matmul(x)) * self.w3.matmul(x)
        return self.w2.matmul(hidden)
