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
    """The token embedding table, not initialised: its values always come from a checkpoint (or a test's
    own fill). nn.Embedding's normal_ init, on the meta device the loaders first build the model on,
    imports torch._dynamo, seconds of every model load for values thrown away (docs/benchmarks-log.md,
    "Figures behind the code")."""
    return nn.Embedding(vocab_size, dim, _weight=torch.empty(vocab_size, dim))


class RMSNorm(nn.Module):
    """Normalises in float32, then scales in the input dtype (as the reference does).

    All-float32 inputs go through torch's own rms_norm: one call instead of ~8 eager ops per token
    and layer, and the same bits (it runs the same pow/mean/add/rsqrt/mul sequence in C++). Other
    dtypes keep the reference's order: torch's would multiply the weight in the input dtype, not
    promote it as ``weight * x`` does. With int8 activations a C loop (engine/kernels/decode_ops.py): torch's
    composite of eager ops was slow there, between kernels that evict the caches (docs/benchmarks-log.md,
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
# One row of 8192 scores: a stable sort 0.40-0.42 ms, topk then a sort of the chosen 0.06-0.16 ms (k 8 to
# 2048); 32768: 2.5 ms against 0.13-0.62. At 4096 and below the sort is as fast or faster (its ~0.06 ms
# against topk's few calls), so a short row alone (a decode step's router, its indexer below 8192 positions)
# sorts. Many rows in one call (a prompt's routers, its indexer's query blocks) share those few calls: 512
# routers' rows of 256 experts, k 8: 5.1 ms sorted, 1.5 with topk first; 64 indexer rows of 2000, k 128: 7.0
# against 2.1; 64 rows of 4096, k 2048: 16.0 against 15.9. So the count is of scores in the call.
TOPK_FIRST_FROM = 8192


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of the last dim, largest first; among equal scores the lower index
    wins (and comes first).

    Agrees with ``torch.topk`` (as a set) whenever there is no tie at the boundary, and unlike it is
    deterministic across devices and input lengths when there is. The DSA indexer picks 2048 of every
    cached position per token and layer: from TOPK_FIRST_FROM scores in the call ``torch.topk`` finds the
    set and only those k are sorted, unless a tie straddles the k-th score or a NaN is among them, when the
    whole call is sorted as below. Either way the same indices in the same order.
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


SCORE_BLOCK_BYTES = 64 << 20


def query_blocks(seqlen: int, bytes_per_query: int) -> Iterator[slice]:
    """Slices of the S new positions whose score tensors take at most SCORE_BLOCK_BYTES each."""
    step = max(1, SCORE_BLOCK_BYTES // max(bytes_per_query, 1))
    for start in range(0, seqlen, step):
        yield slice(start, min(start + step, seqlen))
