"""Small building blocks: RMSNorm, the SwiGLU MLP (dense layers and shared experts), query blocks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import decode_ops
from engine.kernels.activation import swiglu
from engine.kernels.q8 import q8_mlp
from engine.kernels.rows import Linear


def embedding(vocab_size: int, dim: int) -> nn.Embedding:
    """The token embedding table, not initialised: nn.Embedding's init on the meta device imports
    torch._dynamo, seconds per load for values a checkpoint overwrites (docs/benchmarks-log.md)."""
    return nn.Embedding(vocab_size, dim, _weight=torch.empty(vocab_size, dim))


class RMSNorm(nn.Module):
    """Normalises in float32, then scales in the input dtype (as the reference does).

    All-float32 inputs take torch's rms_norm: one call, the same bits. Other dtypes keep the reference's
    order, since torch's would multiply the weight in the input dtype rather than promote it.
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


class MLP(nn.Module):
    """w2(swiglu(w1 x, w3 x)): gate w1 and up w3 [inter_dim, dim], down w2 [dim, inter_dim]."""

    def __init__(self, dim: int, inter_dim: int, limit: float | None = None):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inter_dim, bias=False)
        self.w2 = Linear(inter_dim, dim, bias=False)
        self.w3 = Linear(dim, inter_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if decode_ops.small_ops_take(x):
            out = q8_mlp(self.w1, self.w2, self.w3, x, self.limit)
            if out is not None:
                return out
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))

    if TYPE_CHECKING:  # torch types every Module call as Any: this one's is forward's
        __call__ = forward


# From this many scores in one call, topk then a sort of the chosen beats one stable sort; below it the
# sort's single call wins (docs/kernels.md, "Figures behind engine comments").
TOPK_FIRST_FROM = 8192


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of the last dim, largest first; among equal scores the lower index
    wins (and comes first).

    Agrees with ``torch.topk`` (as a set) when no tie straddles the boundary, and unlike it is deterministic
    across devices and lengths when one does. Both branches give the same indices in the same order.
    """
    if scores.numel() >= TOPK_FIRST_FROM and scores.shape[-1] > 2 * k:
        values, chosen = torch.topk(scores, k, dim=-1)  # the k largest; among ties, any of them
        boundary = values[..., -1:]
        straddles = (scores == boundary).sum(-1) != (values == boundary).sum(-1)  # a tie left out
        if not (straddles.any() or values.isnan().any()):
            by_index = chosen.sort(dim=-1).values  # the set in index order: the stable sort's tie order
            ranked = scores.gather(-1, by_index).sort(dim=-1, descending=True, stable=True).indices
            return by_index.gather(-1, ranked)
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


# A long prefill's [S, H, T] scores grow with S * T; blocks of queries keep that memory flat, and since
# softmax, masking and top-k are per query the result is the same.
SCORE_BLOCK_BYTES = 64 << 20


def query_blocks(seqlen: int, bytes_per_query: int) -> Iterator[slice]:
    """Slices of the S new positions whose score tensors take at most SCORE_BLOCK_BYTES each."""
    step = max(1, SCORE_BLOCK_BYTES // max(bytes_per_query, 1))
    for start in range(0, seqlen, step):
        yield slice(start, min(start + step, seqlen))
