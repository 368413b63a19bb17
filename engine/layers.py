"""Small building blocks: RMSNorm, the SwiGLU MLP (dense layers and shared experts), query blocks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine import decode_ops
from engine.q8 import q8_mlp
from engine.rows import Linear, per_row


def embedding(vocab_size: int, dim: int) -> nn.Embedding:
    """The token embedding table, not initialised: its values always come from a checkpoint (or a test's
    own fill). nn.Embedding's normal_ init, on the meta device the loaders first build the model on,
    imports torch._dynamo, seconds of every model load for values thrown away (docs/benchmarks.md,
    "Figures behind the code")."""
    return nn.Embedding(vocab_size, dim, _weight=torch.empty(vocab_size, dim))


class RMSNorm(nn.Module):
    """Normalises in float32, then scales in the input dtype (as the reference does).

    All-float32 inputs go through torch's own rms_norm: one call instead of ~8 eager ops per token
    and layer, and the same bits (it runs the same pow/mean/add/rsqrt/mul sequence in C++). Other
    dtypes keep the reference's order: torch's would multiply the weight in the input dtype, not
    promote it as ``weight * x`` does. With int8 activations a C loop (engine/decode_ops.py): torch's
    composite of eager ops was slow there, between kernels that evict the caches (docs/benchmarks.md,
    "Figures behind the code").
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if decode_ops.small_ops_take(x):
                return decode_ops.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    if TYPE_CHECKING:  # torch types every Module call as Any: this one's is forward's
        __call__ = forward


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with a limit (DeepSeek-V4's swiglu_limit) gate is clamped from above and up
    to [-limit, limit] first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return per_row(_silu_times, gate, up)


def _silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class MLP(nn.Module):
    """w2(swiglu(w1 x, w3 x)): gate w1 and up w3 [inter_dim, dim], down w2 [dim, inter_dim]."""

    def __init__(self, dim: int, inter_dim: int, limit: float | None = None):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inter_dim, bias=False)
        self.w2 = Linear(inter_dim, dim, bias=False)
        self.w3 = Linear(dim, inter_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if decode_ops.small_ops_take(x):  # one C call where the weights are int8 records or bf16
            out = q8_mlp(self.w1, self.w2, self.w3, x, self.limit)
            if out is not None:
                return out
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))

    if TYPE_CHECKING:  # torch types every Module call as Any: this one's is forward's
        __call__ = forward


# A long prefill's [S, H, T] score tensors grow with S*T (2000 tokens x 16 heads: 256 MB each, several
# alive at once); cutting S into blocks keeps that memory flat. Softmax, masking and top-k are per
# query, so the blocks are independent and the result is the same.
SCORE_BLOCK_BYTES = 64 << 20


def query_blocks(seqlen: int, bytes_per_query: int) -> Iterator[slice]:
    """Slices of the S new positions whose score tensors take at most SCORE_BLOCK_BYTES each."""
    step = max(1, SCORE_BLOCK_BYTES // max(bytes_per_query, 1))
    for start in range(0, seqlen, step):
        yield slice(start, min(start + step, seqlen))
