"""bf16 weights computed in float32: half the memory and bytes read per token, float32 activations.

bf16 -> float32 is exact, so ``Bf16Linear`` computes what a Linear over the upcast weight computes, to float
rounding. Many rows upcast a block of output rows at a time, so no float32 copy of a large matrix (an LM
head) is ever whole (docs/kernels.md, "bf16 dense weights, float32 compute").
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from engine.kernels.native import _kernels
from engine.kernels.q8 import BF16_KIND, CMatrix, KernelMatrix
from engine.kernels.rows import by_segment, computing_alone, kernel_threads, linear, row_segments

# Linears whose weight is also used as a matrix, not only through forward, stay float32: absorbed
# attention views wkv_b per head; the indexer's weights_proj is float32 by the reference's rule.
KEEP_FLOAT32 = ("attn.wkv_b", "indexer.weights_proj")
UPCAST_BLOCK_BYTES = 64 << 20  # float32 weight rows upcast at once on the matmul path
# Up to this many rows the kernel (MAX_ROWS a call) beats upcasting for sgemm (docs/kernels.md, "A short
# prompt's rows through the kernels"); the bits depend on the row count.
PROMPT_KERNEL_ROWS = 32


def bf16_kernel_available() -> bool:
    """The kernel is built with a SIMD path here (its scalar loop is slower than float32 weights)."""
    return _kernels is not None and _kernels.BF16_SIMD > 0


ISA = {"best": 2, "avx2": 1, "scalar": 0}  # the highest SIMD path the kernel may take


class TakesBf16Weight:
    """A non-Linear module that computes from a bf16 ``weight`` itself (DeepSeek-V4's grouped output projection)."""


def bf16_matmul(
    x: torch.Tensor, weight: torch.Tensor, isa: str = "best", alone: bool = False, segments: Sequence[int] = ()
) -> torch.Tensor:
    """x [rows, in] float32 @ weight^T, weight bf16 [out, in] -> [rows, out] float32 (C kernel, MAX_ROWS rows a
    call). ``isa`` caps the SIMD path (for tests); ``alone``: each row as a one-row call; ``segments``: runs of
    rows, each the bits of its own call."""
    rows, in_dim = x.shape
    x = x.contiguous()
    y = torch.empty((rows, weight.shape[0]), dtype=torch.float32)
    runs = array("i", segments)
    _kernels.bf16_gemm(
        weight.data_ptr(),
        x.data_ptr(),
        y.data_ptr(),
        rows,
        in_dim,
        weight.shape[0],
        ISA[isa],
        kernel_threads(),
        alone,
        runs.buffer_info()[0] if runs else 0,
        len(runs),
    )
    return y


class Bf16Linear(nn.Module, KernelMatrix):
    """A bias-free Linear holding its weight [out, in] in bf16, computing in the activations' dtype."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if weight.dtype != torch.bfloat16:
            raise TypeError(f"Bf16Linear needs a bfloat16 weight, got {weight.dtype}")
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]"""
        return bf16_linear(x, self.weight)

    def c_matrix(self) -> CMatrix | None:
        """(w, 0, BF16_KIND, 0, in, 0, 0) for the fused C steps; None where forward would not take the kernel."""
        w = self.weight
        if not (bf16_kernel_available() and w.device.type == "cpu" and w.is_contiguous()):
            return None
        return (w.data_ptr(), 0, BF16_KIND, 0, w.shape[1], 0, 0)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight^T for a contiguous bf16 weight [out, in], in the activations' dtype."""
    flat = x.reshape(-1, x.shape[-1])
    alone = computing_alone()
    segments = row_segments(flat.shape[0]) if flat.shape[0] else None
    takes = bf16_kernel_available() and x.dtype == torch.float32 and x.device.type == "cpu" and 0 < flat.shape[0]
    if segments is not None:
        if not takes or max(segments) > PROMPT_KERNEL_ROWS:
            return by_segment(partial(bf16_linear, weight=weight), x)
        out = bf16_matmul(flat, weight, segments=segments)
    elif takes and (alone or flat.shape[0] <= PROMPT_KERNEL_ROWS):
        out = bf16_matmul(flat, weight, alone=alone)
    else:
        step = max(1, UPCAST_BLOCK_BYTES // (4 * weight.shape[1]))
        out = torch.cat([linear(flat, block.to(x.dtype)) for block in weight.split(step)], dim=-1)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear_candidates(model: nn.Module) -> set[str]:
    """Names of the weights of bias-free Linears outside KEEP_FLOAT32 (a bf16 or int8 kernel may take them)."""
    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module.bias is None and not name.endswith(KEEP_FLOAT32)
    }


def bf16_candidates(model: nn.Module) -> set[str]:
    """Names of the weights a float32 model may keep in bf16: linear_candidates and TakesBf16Weight modules'."""
    own = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, TakesBf16Weight)}
    return linear_candidates(model) | own


def hold_in_bf16(model: nn.Module, bf16_weights: set[str]) -> int:
    """Swap each bf16 nn.Linear named in ``bf16_weights`` (not KEEP_FLOAT32) for a Bf16Linear; returns the count."""
    swapped, eligible = 0, bf16_weights & linear_candidates(model)
    for name, module in list(model.named_modules()):
        if f"{name}.weight" not in eligible or module.weight.dtype != torch.bfloat16:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, Bf16Linear(module.weight.data))
        swapped += 1
    return swapped
