"""DeepSeek-V4's forward pass (a Model, and with its MTP modules loaded a Drafter).

    tokens -> embed -> copy into n = hc_mult streams [B, S, n, dim]
           -> n_layers x [hc_attn: collapse -> attn_norm -> V4Attention -> spread back over the streams
                          hc_ffn:  collapse -> ffn_norm  -> MoE (hash-routed or scored) -> spread]
           -> hc_head collapse -> norm -> head -> logits

Routed experts come from the expert source passed to ``forward``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Self, cast

import torch
from torch import nn

from engine.config.args import ModelArgs
from engine.core.cache import DraftCache
from engine.core.drafting import draft_with
from engine.core.interfaces import Model, row_positions
from engine.core.layers import RMSNorm, embedding
from engine.core.moe import GUESS_MAX_NEW_POSITIONS, MoE
from engine.core.sources import Experts
from engine.kernels.modes import int8_activations
from engine.kernels.rows import Linear, per_row, rows_alone, torch_on_one_thread
from engine.v4.attention import V4Attention
from engine.v4.cache import V4Cache, V4DraftLayer, V4LayerCache
from engine.v4.hyper import HyperConnection, HyperHead, spread
from engine.v4.mtp import V4MTP


class V4Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        v4 = args.v4
        assert v4 is not None
        self.layer_id = layer_id
        self.hc_attn = HyperConnection(args.dim, v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps, args.rms_norm_eps)
        self.attn_norm = RMSNorm(args.dim, args.rms_norm_eps)
        self.attn = V4Attention(args, layer_id)
        self.hc_ffn = HyperConnection(args.dim, v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.rms_norm_eps)
        self.ffn = MoE(args, layer_id)

    def forward(
        self,
        streams: torch.Tensor,
        tokens: torch.Tensor,
        start_pos: int,
        cache: V4LayerCache,
        experts: Experts,
        guess_ahead: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """streams [B, S, n, dim] of tokens [B, S] at start_pos.. -> [B, S, n, dim]; ``guess_ahead`` gets the
        streams before the FFN, to prefetch the next layer's experts."""
        post, comb, x = self.hc_attn(streams)
        streams = spread(streams, self.attn(self.attn_norm(x), start_pos, cache), post, comb)
        if guess_ahead is not None:
            guess_ahead(streams)
        post, comb, x = self.hc_ffn(streams)
        return spread(streams, self.ffn(self.ffn_norm(x), experts, tokens), post, comb)

    def forward_rows(
        self,
        streams: torch.Tensor,
        tokens: torch.Tensor,
        starts: list[int],
        caches: list[V4LayerCache],
        experts: Experts,
        guess_ahead: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """streams [B, 1, n, dim], one position of each of B sequences, inside rows_alone(): hyper-connections and
        attention per row, the FFN over all rows (experts acquired once)."""
        post, comb, x = per_row(self.hc_attn, streams)
        out = torch.cat(
            [
                self.attn(self.attn_norm(x[b : b + 1]), start, cache)
                for b, (start, cache) in enumerate(zip(starts, caches, strict=True))
            ]
        )
        streams = per_row(spread, streams, out, post, comb)
        if guess_ahead is not None:
            guess_ahead(streams)
        post, comb, x = per_row(self.hc_ffn, streams)
        return per_row(spread, streams, self.ffn(self.ffn_norm(x), experts, tokens), post, comb)

    def router_input(self, streams: torch.Tensor) -> torch.Tensor:
        """What this layer's router would see from ``streams`` now: [B, S, dim]."""
        return self.ffn_norm(self.hc_ffn(streams)[2])


class V4Transformer(Model[V4Cache]):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.v4 is None:
            raise ValueError(f"V4Transformer needs a deepseek_v4 config, not {args.model_type}")
        self.args = args
        self.n_streams = args.v4.hc_mult
        self.embed = embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(V4Block(args, i) for i in range(args.n_layers))
        self.hc_head = HyperHead(args.dim, args.v4.hc_mult, args.v4.hc_eps, args.rms_norm_eps)
        self.norm = RMSNorm(args.dim, args.rms_norm_eps)
        self.head = Linear(args.dim, args.vocab_size, bias=False)
        self.mtp = nn.ModuleList(V4MTP(args, layer, V4Block(args, layer)) for layer in args.mtp_layers)
        self.int8_activations = False
        self.prompt_tiles = False
        self.read_ahead = False

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch: int = 1) -> V4Cache:
        return V4Cache.empty(self.args, batch, self.dtype, self.device)

    def read_ahead_bytes(self, experts_per_token: int, expert_bytes: int) -> int | None:
        """None: no read-ahead."""
        return None

    def _guess_ahead(self, layer: int, tokens: torch.Tensor, experts: Experts) -> Callable[[torch.Tensor], None] | None:
        """A hook prefetching layer ``layer``'s experts while the current FFN runs (exact on hash-routed layers)."""
        if layer >= len(self.layers):
            return None
        block = cast(V4Block, self.layers[layer])

        def guess_ahead(streams: torch.Tensor) -> None:
            if experts.lookahead((layer,)):
                guess_input = None if block.ffn.hashed else block.router_input(streams)
                experts.prefetch(layer, block.ffn.predict(guess_input, tokens))

        return guess_ahead

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: int,
        cache: V4Cache,
        experts: Experts,
        absorb: bool | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Model.forward; ``absorb`` is ignored: V4's one K=V head has no absorbed form."""
        x = self.embed(tokens)
        streams = x.unsqueeze(2).expand(-1, -1, self.n_streams, -1).contiguous()  # [B, S, n, dim]
        guess = tokens.shape[1] <= GUESS_MAX_NEW_POSITIONS
        with int8_activations(self.int8_activations), torch_on_one_thread():
            for i, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers, strict=True)):
                guess_ahead = self._guess_ahead(i + 1, tokens, experts) if guess else None
                streams = layer(streams, tokens, start_pos, layer_cache, experts, guess_ahead)
            cache.release()  # rows neither attention nor a log still needs
            if last_only:
                streams = streams[:, -1:]
            return self.head(self.norm(self.hc_head(streams))).float()

    @torch.inference_mode()
    def forward_rows(self, tokens: list[int], caches: list[V4Cache], experts: Experts) -> torch.Tensor:
        """Model.forward_rows."""
        return self.forward_rows_hidden(tokens, caches, experts)[0]

    @torch.inference_mode()
    def forward_rows_hidden(
        self, tokens: list[int], caches: list[V4Cache], experts: Experts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter.forward_rows_hidden; a cache shared by rows keeps what a trim back to its first row needs."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]  # [B, 1]
        streams = self.embed(ids).unsqueeze(2).expand(-1, -1, self.n_streams, -1).contiguous()
        starts = row_positions(caches)
        with rows_alone(), int8_activations(self.int8_activations), torch_on_one_thread():
            for i, layer in enumerate(cast("list[V4Block]", self.layers)):
                layer_caches = [cache.layers[i] for cache in caches]
                guess_ahead = self._guess_ahead(i + 1, ids, experts)
                streams = layer.forward_rows(streams, ids, starts, layer_caches, experts, guess_ahead)
            firsts: dict[int, tuple[V4Cache, int]] = {}
            for cache, start in zip(caches, starts, strict=True):
                firsts.setdefault(id(cache), (cache, start))
            for cache, first in firsts.values():
                cache.release(keep_from=first)
            collapsed = per_row(self.hc_head, streams)
            return self.head(self.norm(collapsed)).float()[:, -1], streams[:, -1]

    def drafter(self) -> Self | None:
        """Itself, with its MTP modules loaded."""
        return self if len(self.mtp) > 0 else None

    def new_draft_cache(self) -> DraftCache[V4DraftLayer]:
        return cast(V4MTP, self.mtp[0]).new_cache(self.dtype, self.device)

    @torch.inference_mode()
    def draft(
        self,
        hidden: torch.Tensor,
        tokens: list[int],
        position: int,
        cache: DraftCache[V4DraftLayer],
        experts: Experts,
        depth: int,
    ) -> list[int]:
        """Drafter.draft with the first MTP module; hidden [S, n, dim]."""
        with int8_activations(self.int8_activations), torch_on_one_thread():
            mtp = cast(V4MTP, self.mtp[0])
            return draft_with(mtp, self.embed, self.head, (hidden, tokens, position), cache, experts, depth)
