"""Dense weights held as the container's int8 or int4 records, for models run with int8 activations.

The exact float path dequantises them at load; with int8 activations they stay coded and the integer kernel
reads them, half (int8) or a quarter (int4) of bf16's bytes per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Self, cast

import torch
from torch import nn

from engine.kernels.q8 import (
    BLOCK,
    WEIGHT_KINDS,
    CMatrix,
    KernelMatrix,
    deinterleave,
    interleavable,
    interleave,
    q8_kernel_handles,
    q8_matmul,
    quantize_rows,
)
from engine.kernels.quant import KERNEL_SCALES, QuantizedMatrix
from engine.kernels.rows import linear

CODE_DTYPES = {"int8": torch.int8, "int4": torch.uint8}  # int4: two codes a byte, the low nibble first


class CodedLinear(nn.Module, KernelMatrix):
    """A bias-free Linear over codes q (int8 [out, in]; int4 [out, ceil(in / 2)]) and scales
    [out, ceil(in / group_size)]. After ``interleave`` q holds both and scales is empty (its dtype kept)."""

    q: torch.Tensor  # buffers, declared for the type checker
    scales: torch.Tensor

    def __init__(
        self, q: torch.Tensor, scales: torch.Tensor, group_size: int, code: str = "int8", in_dim: int | None = None
    ):
        super().__init__()
        in_dim = q.shape[-1] if in_dim is None else in_dim
        packed = -(-in_dim // 2) if code == "int4" else in_dim
        if code not in CODE_DTYPES or q.dtype != CODE_DTYPES[code] or q.dim() != 2 or q.shape[1] != packed:
            raise TypeError(f"CodedLinear needs {code} codes [out, {packed}], got {q.dtype} {list(q.shape)}")
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.group_size, self.code, self.in_dim, self.out_dim = group_size, code, in_dim, q.shape[0]
        self.interleaved = False
        self._c_matrix: CMatrix | None = None

    def interleave(self) -> bool:
        """Hold the codes in the kernel's interleaved layout where it applies; returns whether it did."""
        takes = (
            self.q.device.type == "cpu"
            and self.scales.dtype in KERNEL_SCALES
            and q8_kernel_handles(self.code, self.group_size, torch.empty(1, 1))
        )
        if self.interleaved or not (takes and interleavable(self.code, self.in_dim, self.out_dim, self.group_size)):
            return False
        self.q = interleave(self.q, self.scales, self.code, self.group_size)
        self.scales = self.scales.new_empty(0)
        self.interleaved, self._c_matrix = True, None
        return True

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        self._c_matrix = None  # .to(), ...: new buffers
        # torch leaves Module._apply unannotated (it returns self)
        return cast(Self, super()._apply(fn, recurse))  # type: ignore[no-untyped-call]

    def c_matrix(self) -> CMatrix | None:
        """The codes as the fused C steps take a matrix (CMatrix), or None where the kernel cannot read them."""
        if self._c_matrix is None and self.group_size % BLOCK == 0 and self.scales.dtype in KERNEL_SCALES:
            q, scales = self.q, self.scales
            kind, scale_kind = WEIGHT_KINDS[self.code], KERNEL_SCALES[scales.dtype]
            shape = (self.in_dim, self.group_size, int(self.interleaved))
            self._c_matrix = (q.data_ptr(), scales.data_ptr(), kind, scale_kind, *shape)
        return self._c_matrix

    @property
    def matrix(self) -> QuantizedMatrix:
        """The weights row-major (a copy when interleaved)."""
        if self.interleaved:
            q, scales = deinterleave(self.q, self.code, self.scales.dtype, self.group_size)
            return QuantizedMatrix(q, scales, self.code, self.group_size, self.in_dim)
        return QuantizedMatrix(self.q, self.scales, self.code, self.group_size, self.in_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] float32: int8 activations times the coded weights (torch without the kernel)."""
        flat = x.reshape(-1, x.shape[-1]).float()
        if q8_kernel_handles(self.code, self.group_size, flat) and self.scales.dtype in KERNEL_SCALES:
            scale_kind = KERNEL_SCALES[self.scales.dtype]
            out_dim = self.out_dim if self.interleaved else None
            out = q8_matmul(flat, self.q, self.scales, self.code, self.group_size, scale_kind, out_dim=out_dim)
        else:
            out = linear(quantize_rows(flat), self.matrix.dequantize(torch.float32))
        return out.view(*x.shape[:-1], self.out_dim)


def hold_codes(model: nn.Module, weights: dict[str, tuple[torch.Tensor, torch.Tensor, int, str, int]]) -> int:
    """Swap each bias-free nn.Linear whose weight is in ``weights`` ((q, scales, group, code, in_dim)) for a
    CodedLinear; returns the count."""
    swapped = 0
    for name, module in list(model.named_modules()):
        held = weights.get(f"{name}.weight")
        if held is None or not isinstance(module, nn.Linear) or module.bias is not None:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, CodedLinear(*held))
        swapped += 1
    return swapped


def interleave_codes(model: nn.Module) -> int:
    """Interleave every CodedLinear of a loaded ``model`` where it applies; returns how many."""
    return sum(module.interleave() for module in model.modules() if isinstance(module, CodedLinear))
