"""Manifold-constrained hyper-connections (DeepSeek-V4): n residual streams instead of one.

Shapes: B batch, S positions, n = hc_mult streams, D = dim; the residual is [B, S, n, D]. Before a block
a projection of the normed streams gives ``pre`` [n] (collapse into the block's input), ``post`` [n] (spread
its output back) and ``comb`` [n, n] (Sinkhorn towards doubly stochastic; mixes the old streams):

    streams' = post[k] * block(sum_j pre[j] * streams[j]) + sum_j comb[j, k] * streams[j]

All weights are computed in float32. The head collapses the streams once more (``HyperHead``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, no learned scale."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """fn [(2 + n) * n, n * D], base [(2 + n) * n], scale [3]: the pre, post and comb weights of one block."""

    def __init__(self, dim: int, n_streams: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.n = n_streams
        self.sinkhorn_iters = sinkhorn_iters
        self.eps = eps
        self.norm_eps = norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n_streams) * n_streams, n_streams * dim))
        self.base = nn.Parameter(torch.empty((2 + n_streams) * n_streams))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, S, n, D] -> (post [B, S, n], comb [B, S, n, n] float32, block input [B, S, D])."""
        n = self.n
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn.float()).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = comb_w.unflatten(-1, (n, n)) * comb_scale + comb_b.view(n, n)
        comb = self._sinkhorn(torch.softmax(comb, dim=-1) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed

    def _sinkhorn(self, comb: torch.Tensor) -> torch.Tensor:
        """Alternately normalise columns and rows (columns first and last) towards doubly stochastic."""
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return comb


def spread(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The new streams [B, S, n, D]: the block output out [B, S, D] spread by post, plus comb^T @ streams."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """fn [n, n * D], base [n], scale [1]: the last collapse of the streams before the final norm."""

    def __init__(self, dim: int, n_streams: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps = eps
        self.norm_eps = norm_eps
        self.fn = nn.Parameter(torch.empty(n_streams, n_streams * dim))
        self.base = nn.Parameter(torch.empty(n_streams))
        self.scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [B, S, n, D] -> [B, S, D]"""
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
