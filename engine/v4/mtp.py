"""DeepSeek-V4's multi-token-prediction module (``mtp.I``) as a drafter: engine/mla/mtp.py's, on V4's streams.

    x = e_proj(enorm(embed(t_{i+1})))[None] + h_proj(hnorm(h_i))   [n, dim]; h_i: streams before collapse
    x = block(x)                       a V4 block (layer n_layers + I) with its own cache
    logits = head(norm(hc_head(x)))    its own collapse; embed and head: the main model's

Its positions count from ``DraftCache.offset``, shifting rope and compressor windows: that changes a
draft's quality, never a token (the main model verifies each).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config.args import ModelArgs
from engine.core.cache import DraftCache
from engine.core.layers import RMSNorm
from engine.core.sources import Experts
from engine.kernels.rows import Linear
from engine.v4.cache import V4DraftLayer
from engine.v4.hyper import HyperHead


class V4MTP(nn.Module):
    """One MTP module; ``block`` is built by engine/v4/model.py (which imports this file)."""

    def __init__(self, args: ModelArgs, layer_id: int, block: nn.Module):
        super().__init__()
        v4 = args.v4
        assert v4 is not None
        self.args = args
        self.layer_id = layer_id
        self.enorm = RMSNorm(args.dim, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.dim, args.rms_norm_eps)
        self.e_proj = Linear(args.dim, args.dim, bias=False)
        self.h_proj = Linear(args.dim, args.dim, bias=False)
        self.block = block
        self.hc_head = HyperHead(args.dim, v4.hc_mult, v4.hc_eps, args.rms_norm_eps)
        self.norm = RMSNorm(args.dim, args.rms_norm_eps)

    def new_cache(self, dtype: torch.dtype, device: torch.device) -> DraftCache[V4DraftLayer]:
        v4 = self.args.v4
        assert v4 is not None
        return DraftCache(lambda: V4DraftLayer.empty(v4, self.layer_id, dtype, device))

    def forward(
        self,
        streams: torch.Tensor,
        embedded: torch.Tensor,
        ids: torch.Tensor,
        position: int,
        cache: DraftCache[V4DraftLayer],
        experts: Experts,
    ) -> torch.Tensor:
        """streams [1, S, n, dim], embedded [1, S, dim] (h_i, embed(t_{i+1}) of ids [1, S], i = position..) ->
        streams [1, S, n, dim], appended to ``cache``."""
        cache.continue_at(position)
        x = self.e_proj(self.enorm(embedded)).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        out: torch.Tensor = self.block(x, ids, position - cache.offset, cache.layer.cache, experts)
        return out

    def start_draft(self, position: int, cache: DraftCache[V4DraftLayer]) -> None:
        """A draft's first pair goes at ``position``; state before it is freed (no later trim goes back past it)."""
        cache.continue_at(position)
        cache.layer.release_before(position - cache.offset)

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """[.., n, dim] -> the normalised input of the shared head [.., dim]."""
        return self.norm(self.hc_head(streams))
