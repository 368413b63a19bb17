"""DeepSeek-V4's multi-token-prediction module (``mtp.I``), as a drafter: engine/mla/mtp.py's for V4's streams.

At position i it joins the main model's hyper-connection streams h_i [n, dim] (before the head's collapse)
with the embedding of token i+1, each normalised, projected and added stream by stream:

    x = e_proj(enorm(embed(t_{i+1})))[None] + h_proj(hnorm(h_i))   [n, dim]
    x = block(x)                       a V4 block (layer n_layers + I) with its own cache
    logits = head(norm(hc_head(x)))    its own collapse of the streams; embed and head: the main model's

as DeepSeek's reference MTPBlock does. Drafts are only proposals (the main model verifies each), so the
module's attention runs at positions counted from where its cache starts (``DraftCache.offset``): rope and
the compressors' windows see those positions shifted, which changes a draft's quality, never a token.
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
    """One MTP module: its input norms and projections, its block (built by engine/v4/model.py, which imports
    this file) of layer ``layer_id`` for the expert source, its stream collapse and output norm."""

    def __init__(self, args: ModelArgs, layer_id: int, block: nn.Module):
        super().__init__()
        v4 = args.v4
        assert v4 is not None  # a V4 module is built from deepseek_v4 args (engine/families.py)
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
        """streams [1, S, n, dim] and embedded [1, S, dim] (h_i and embed(t_{i+1}) of ids [1, S], positions
        i = position..) -> the module's streams [1, S, n, dim]; the S positions are appended to ``cache``."""
        cache.continue_at(position)
        x = self.e_proj(self.enorm(embedded)).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        out: torch.Tensor = self.block(x, ids, position - cache.offset, cache.layer.cache, experts)
        return out

    def start_draft(self, position: int, cache: DraftCache[V4DraftLayer]) -> None:
        """A draft's first pair goes at ``position``: what its state before it held is freed (this draft's
        chain and every later draft are trimmed back no further than it)."""
        cache.continue_at(position)
        cache.layer.release_before(position - cache.offset)

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """[.., n, dim] -> the normalised input of the shared head [.., dim]."""
        return self.norm(self.hc_head(streams))
