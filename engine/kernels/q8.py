"""int8 activations (``int8_activations()``): x quantised per block of 32 columns (absmax / 127, ties to
even), integer dot products against the stored int4/int8 records (engine/csrc/q8.c), as llama.cpp's Q8.

Lossy in x, so opt-in: the exact float path is what the oracle suites check. Each row's accumulation is
independent of the other rows, so batching stays bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.kernels.modes import activations_are_int8, rows_are_prompt
from engine.kernels.native import _kernels
from engine.kernels.rows import kernel_threads

BLOCK = 32  # columns of x per int8 scale
CHUNK = 64  # columns per step of the kernels (q8.h Q8_CHUNK)
SPAN = 512  # columns per span of the interleaved layout (q8.h Q8_SPAN)
WEIGHT_KINDS = {"int4": 0, "int8": 1}  # the kernel's weight kinds (q8.h)
BF16_KIND = 2  # q8.h Q8_WEIGHTS_BF16: the float32 path's bf16 matrices in the fused C steps
ISA_SCALAR, ISA_AVX2, ISA_BEST = 0, 1, 2  # q8.h Q8_ISA_*
ISA_AMX = 3  # q8.h Q8_ISA_AMX: the tile products on the AMX unit where the CPU has it (every other product: ISA_BEST)
TILES = 8  # q8.h Q8_TILES, OR'd into an isa: the products in q8_tiles.h's numbers (a prompt's rows)


def q8_isa() -> int:
    """The isa the int8 matmuls pass: the best, as tile GEMMs (AMX where present) inside ``prompt_rows()``."""
    return ISA_AMX | TILES if rows_are_prompt() else ISA_BEST


def amx_tiles() -> bool:
    """Whether the tile GEMMs run on the AMX unit here (AMX-INT8 and the kernel's grant); the same bytes."""
    return _kernels is not None and bool(_kernels.Q8_AMX)


def tiles_fast() -> bool:
    """Whether the tile GEMMs have their vector path here (AVX-512 VNNI); elsewhere the plain C loop."""
    return _kernels is not None and bool(_kernels.Q8_TILES_FAST)


def q8_kernel_handles(code: str, group_size: int, x: torch.Tensor) -> bool:
    """Whether q8_matmul takes these weights and activations."""
    return (
        _kernels is not None
        and code in WEIGHT_KINDS
        and group_size % BLOCK == 0
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.shape[0] > 0
    )


def q8_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    scales: torch.Tensor,
    code: str,
    group_size: int,
    scale_kind: int,
    isa: int | None = None,
    out_dim: int | None = None,
) -> torch.Tensor:
    """int8(x) [rows, in] @ dequant(w, scales)^T -> [rows, out] float32. ``w``: int4 nibbles uint8
    [out, ceil(in / 2)], int8 [out, in], or ``interleave``'s bytes (``out_dim`` given, ``scales`` unused).
    ``isa`` caps the instruction set (every level gives the same bytes; default ``q8_isa()``)."""
    rows, in_dim = x.shape
    x = x.contiguous()
    out = w.shape[0] if out_dim is None else out_dim
    y = torch.empty((rows, out), dtype=torch.float32)
    _kernels.q8_gemm(
        w.data_ptr(),
        scales.data_ptr(),
        x.data_ptr(),
        y.data_ptr(),
        rows,
        in_dim,
        out,
        group_size,
        q8_isa() if isa is None else isa,
        kernel_threads(),
        WEIGHT_KINDS[code],
        scale_kind,
        out_dim is not None,
    )
    return y


def chunk_bytes(code: str) -> int:
    """Bytes of one row's chunk of CHUNK columns: int4 codes two a byte, int8 one."""
    return CHUNK // 2 if code == "int4" else CHUNK


def interleavable(code: str, in_dim: int, out_dim: int, group_size: int) -> bool:
    """Whether ``interleave`` takes this shape (q8.h q8_interleavable): whole spans, 4-row blocks, groups
    of whole chunks that tile a span."""
    return (
        code in WEIGHT_KINDS
        and in_dim >= SPAN
        and in_dim % SPAN == 0
        and out_dim >= 4
        and out_dim % 4 == 0
        and group_size % CHUNK == 0
        and SPAN % group_size == 0
    )


def interleave(
    q: torch.Tensor, scales: torch.Tensor, code: str, group_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """q ([out, in / 2] int4 bytes or [out, in] int8) and scales [out, in / group] in the kernel's
    interleaved layout (q8.h): per 4-row block and SPAN-column span, the chunks row by row, then the 4 rows'
    scales. uint8 [out / 4, spans, span bytes], written into ``out`` where given."""
    out_dim, row_bytes = q.shape
    step = chunk_bytes(code)
    spans = row_bytes // (SPAN // CHUNK * step)
    code_bytes = SPAN // CHUNK * 4 * step
    blocks = out_dim // 4
    shape = (blocks, spans, code_bytes + scales.nbytes // (blocks * spans))
    packed = torch.empty(shape, dtype=torch.uint8) if out is None else out.view(shape)
    # copy as 8-byte words where both sides are aligned: far faster than as bytes
    aligned = q.data_ptr() % 8 == 0 and packed.data_ptr() % 8 == 0 and packed.shape[2] % 8 == 0
    unit = torch.int64 if aligned else torch.uint8
    codes = q.view(torch.uint8).view(unit).view(blocks, 4, spans, SPAN // CHUNK, -1).permute(0, 2, 3, 1, 4)
    packed[:, :, :code_bytes].view(unit).view(blocks, spans, SPAN // CHUNK, 4, -1).copy_(codes)
    scale_bytes = scales.contiguous().view(torch.uint8).view(blocks, 4, spans, -1).permute(0, 2, 1, 3)
    packed[:, :, code_bytes:].view(blocks, spans, 4, -1).copy_(scale_bytes)
    return packed


def deinterleave(
    packed: torch.Tensor, code: str, scale_dtype: torch.dtype, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``interleave``'s inverse: (q, scales) in the row-major layout, for the paths that dequantise."""
    blocks, spans, _ = packed.shape
    step = chunk_bytes(code)
    code_bytes = SPAN // CHUNK * 4 * step
    codes = packed[:, :, :code_bytes].reshape(blocks, spans, SPAN // CHUNK, 4, step).permute(0, 3, 1, 2, 4)
    q = codes.reshape(blocks * 4, -1).view(torch.int8 if code == "int8" else torch.uint8)
    scale_bytes = packed[:, :, code_bytes:].reshape(blocks, spans, 4, -1).permute(0, 2, 1, 3).reshape(blocks * 4, -1)
    return q, scale_bytes.contiguous().view(scale_dtype)


def quantized_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of the kernel's activation quantisation (q8_prepare's numbers): x [rows, in] float32 -> xq
    [rows, blocks, 32] (integer values, float32; zeros past in) and the block scales d [rows, blocks, 1]."""
    rows, in_dim = x.shape
    blocks = -(-in_dim // BLOCK)
    padded = torch.nn.functional.pad(x.float(), (0, blocks * BLOCK - in_dim)).view(rows, blocks, BLOCK)
    amax = padded.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(padded * inv), amax / 127.0  # ties to even, as nearbyintf


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 -> its int8 quantisation dequantised, [rows, in] (quantized_blocks)."""
    q, d = quantized_blocks(x)
    return (q * d).view(x.shape[0], -1)[:, : x.shape[1]]


# (w, scales, kind, scale kind, in, group, interleaved) as the C steps take a matrix
CMatrix = tuple[int, int, int, int, int, int, int]


class KernelMatrix:
    """A linear whose weights the fused C steps read as they are (CodedLinear, Bf16Linear); declared here
    because both import this module."""

    def c_matrix(self) -> CMatrix | None:
        """The matrix as the C steps take it (CMatrix); None where they cannot."""
        return None


def c_matrix_of(linear: object) -> CMatrix | None:
    """A linear's weights as the fused C steps take a matrix, None for a module they cannot read."""
    return linear.c_matrix() if isinstance(linear, KernelMatrix) else None


def c_computes_as_modules(matrices: Iterable[CMatrix]) -> bool:
    """Whether the C steps compute these matrices as their modules do now: int8 records only with int8
    activations on (else the module computes in float where C would quantise x)."""
    return activations_are_int8() or all(m[2] == BF16_KIND for m in matrices)


def q8_mlp(w1: object, w2: object, w3: object, x: torch.Tensor, limit: float | None = None) -> torch.Tensor | None:
    """w2(swiglu(w1 x, w3 x)) for x [..., dim] in one C call where the C steps read all three matrices,
    else None. The SwiGLU uses C's expf, not torch's: call it only where decode_ops' C ops apply."""
    cpu_float32 = x.dtype == torch.float32 and x.device.type == "cpu"
    if not (cpu_float32 and _kernels is not None):
        return None
    gate, up, down = (c_matrix_of(m) for m in (w1, w3, w2))
    if gate is None or up is None or down is None or x.numel() == 0:
        return None
    if not c_computes_as_modules((gate, up, down)):
        return None
    dim, inter = gate[4], down[4]
    flat = x.reshape(-1, dim).contiguous()
    out = torch.empty(flat.shape, dtype=torch.float32)
    _kernels.q8_mlp(
        gate, up, down, flat.data_ptr(), flat.shape[0], dim, inter, limit is not None, float(limit or 0.0),
        out.data_ptr(), q8_isa(), kernel_threads(),
    )  # fmt: skip
    return out.view(x.shape)
