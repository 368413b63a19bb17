"""Block and Transformer: the MLA family's whole forward pass.

    tokens -> embed -> n_layers x [attn_norm -> MLA(+DSA) -> residual -> ffn_norm -> MLP|MoE -> residual]
           -> norm -> head -> logits

Routed experts are not parameters: each MoE layer asks the expert source passed to ``forward``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Literal, Self, cast

import torch
from torch import nn

from engine.config.args import ModelArgs
from engine.core.cache import DraftCache, KVCache, LayerCache
from engine.core.drafting import draft_with
from engine.core.interfaces import Model, row_positions
from engine.core.layers import MLP, RMSNorm, embedding
from engine.core.moe import GUESS_MAX_NEW_POSITIONS, MoE
from engine.core.rope import rope_tables
from engine.core.sources import Experts, ExpertSource, is_remote
from engine.kernels.modes import int8_activations, prompt_rows
from engine.kernels.read_ahead import module_arrays, read_ahead_available, request_read_ahead
from engine.kernels.rows import Linear, rows_alone, rows_in_segments, torch_on_one_thread
from engine.mla.attention import MLA
from engine.mla.decode import FusedMLA, fused_attention_applies
from engine.mla.expansions import expansions_kept
from engine.mla.fused_decode import LayerParts, OneCall
from engine.mla.mtp import MTP


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(args.dim, args.rms_norm_eps)
        self.attn = MLA(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, args.rms_norm_eps)
        self.ffn = MoE(args, layer_id) if args.is_moe(layer_id) else MLP(args.dim, args.inter_dim)
        self._fused: FusedMLA | Literal[False] | None = None  # None: not built yet, False: n/a

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        experts: Experts,
        selection: torch.Tensor | None,
        absorb: bool | None,
        guess_ahead: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, S, dim] at positions start_pos.. -> (x [B, S, dim], DSA selection [B, S, K] or None).

        ``rope``: (cos, sin), each [S, qk_rope_head_dim // 2] float32. ``selection``: DSA only, int64
        [B, S, K], the positions each query attends to from the last "full" layer's indexer (None while the
        context fits index_topk); indexer layers replace it, "shared" layers reuse it. ``absorb``: True
        absorbed, False expanded, None by S. ``guess_ahead``: called with the post-attention state before
        the FFN, to prefetch the next MoE layer's experts.
        """
        x, selection = self.attend(x, start_pos, rope, cache, selection, absorb)
        return self._ffn(x, experts, guess_ahead), selection

    def attend(
        self,
        x: torch.Tensor,
        start_pos: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        selection: torch.Tensor | None,
        absorb: bool | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention half of ``forward``: x [B, S, dim] -> (x + attention [B, S, dim], selection)."""
        fused = self._fused_attention(x, cache, absorb)
        if fused is not None:
            return fused(x, start_pos, rope, cache, selection)
        attn_out, selection = self.attn(self.attn_norm(x), start_pos, rope, cache, selection, absorb)
        return x + attn_out, selection

    def ffn_window(self, xs: list[torch.Tensor], experts: Experts) -> list[torch.Tensor]:
        """The FFN half for prompt chunks x_i [B, S_i, dim], each bit-equal alone, experts acquired once."""
        if not isinstance(self.ffn, MoE):
            return [self._ffn(x, experts, None) for x in xs]
        outs = self.ffn.forward_window([self.ffn_norm(x) for x in xs], experts)
        return [x + out for x, out in zip(xs, outs, strict=True)]

    def forward_segments(
        self,
        x: torch.Tensor,
        sizes: list[int],
        starts: list[int],
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        caches: list[LayerCache],
        experts: ExpertSource,
        selections: list[torch.Tensor | None],
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Inside rows_in_segments(sizes): several sequences' chunks x [1, N, dim] -> (x [1, N, dim], selections),
        each chunk bit-equal to ``forward`` alone, the weights read once for all."""
        attn_out, selections = self.attn.forward_segments(self.attn_norm(x), sizes, starts, ropes, caches, selections)
        x = x + attn_out
        h = self.ffn_norm(x)
        out = self.ffn.forward_segments(h[0], experts)[None] if isinstance(self.ffn, MoE) else self.ffn(h)
        return x + out, selections

    def forward_rows(
        self,
        x: torch.Tensor,
        starts: list[int],
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        caches: list[LayerCache],
        experts: Experts,
        selections: list[torch.Tensor | None],
        guess_ahead: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One new position of each of B sequences, x [B, 1, dim]; the FFN acquires the rows' experts once."""
        one_sequence = all(cache is caches[0] for cache in caches)  # decode alone, or a verify step's rows
        fused = self._fused_attention(x[:1], caches[0], None) if one_sequence else None
        if fused is not None:  # each row its own decode step's C steps
            attended = [fused(x[b : b + 1], starts[b], ropes[b], caches[b], selections[b]) for b in range(len(caches))]
            x = torch.cat([row for row, _ in attended]) if len(attended) > 1 else attended[0][0]
            return self._ffn(x, experts, guess_ahead), [selection for _, selection in attended]
        attn_out, selections = self.attn.forward_rows(self.attn_norm(x), starts, ropes, caches, selections)
        return self._ffn(x + attn_out, experts, guess_ahead), selections

    def _fused_attention(self, x: torch.Tensor, cache: LayerCache, absorb: bool | None) -> FusedMLA | None:
        """The attention step in two C calls where it applies, built at first use."""
        if not fused_attention_applies(x, cache, absorb):
            return None
        if self._fused is None:
            self._fused = FusedMLA.build(self.attn_norm, self.attn) or False
        return self._fused if self._fused and self._fused.computes_as_modules() else None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        self._fused = None  # .to(), .float(), ...: new tensors
        # torch leaves Module._apply unannotated (it returns self)
        return cast(Self, super()._apply(fn, recurse))  # type: ignore[no-untyped-call]

    def _ffn(
        self, x: torch.Tensor, experts: Experts, guess_ahead: Callable[[torch.Tensor], None] | None
    ) -> torch.Tensor:
        if guess_ahead is not None:
            guess_ahead(x)
        h = self.ffn_norm(x)
        return x + (self.ffn(h, experts) if isinstance(self.ffn, MoE) else self.ffn(h))


class Transformer(Model[KVCache]):
    prompt_in_windows = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.rms_norm_eps)
        self.head = Linear(args.dim, args.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTP(args, layer, Block(args, layer)) for layer in args.mtp_layers)
        for mtp in cast("list[MTP]", self.mtp):  # a ModuleList of MTPs
            mtp.one_call = OneCall(partial(_block_parts, [mtp.block]), [mtp.layer_id])
        self.int8_activations = False
        self.prompt_tiles = False
        # a loss where the next layer's weights do not fit the cache beside the current's: the loader decides
        self.read_ahead = True
        self._weights_listed: dict[int, list[torch.Tensor]] = {}  # layer -> dense weights
        self._one_call = OneCall(self._layer_parts, range(args.n_layers))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        self._weights_listed = {}  # .to(), .float(), ...: new tensors
        self._one_call.forget()
        # torch leaves Module._apply unannotated (it returns self)
        return cast(Self, super()._apply(fn, recurse))  # type: ignore[no-untyped-call]

    def _weights_of(self, layer: int) -> list[torch.Tensor]:
        """Layer ``layer``'s dense weights in read order (past the last: norm and head), listed once (the loader
        swaps modules before the first forward)."""
        if layer not in self._weights_listed:
            following = self.layers[layer] if layer < len(self.layers) else nn.ModuleList([self.norm, self.head])
            self._weights_listed[layer] = module_arrays(following)
        return self._weights_listed[layer]

    def _start_read_ahead(self, x: torch.Tensor) -> bool:
        """Whether this decode step reads ahead; if so, layer 0's weights are requested now."""
        if not self.read_ahead or x.device.type != "cpu" or not read_ahead_available():
            return False
        request_read_ahead(self._weights_of(0))
        return True

    def read_ahead_bytes(self, experts_per_token: int, expert_bytes: int) -> int:
        """The largest request: a layer's dense weights plus, on a MoE layer, ``experts_per_token`` experts."""

        def request(layer: int) -> int:
            moe = layer < len(self.layers) and isinstance(self.layers[layer].ffn, MoE)
            return sum(t.nbytes for t in self._weights_of(layer)) + (experts_per_token * expert_bytes if moe else 0)

        return max(request(layer) for layer in range(len(self.layers) + 1))

    def _guess_ahead(
        self, layer: int, experts: Experts, read_ahead: bool = False
    ) -> Callable[[torch.Tensor], None] | None:
        """A hook on the post-attention state before the current FFN: layer ``layer``'s router (and those the
        source looks ahead to) guess experts to prefetch while that FFN runs. Further ahead is less often right
        (docs/benchmarks-log.md, "Figures behind the code") but has a layer more to land. With ``read_ahead``
        it also requests layer ``layer``'s weights and held guessed experts. None: nothing to do."""
        if layer >= len(self.layers) or not isinstance(self.layers[layer].ffn, MoE):
            return (lambda x: request_read_ahead(self._weights_of(layer))) if read_ahead else None
        coming = range(layer, len(self.layers))
        memory = experts.offers().read_ahead

        def guess_ahead(x: torch.Tensor) -> None:
            wanted = experts.lookahead(coming)
            for target in sorted({*wanted, layer} if read_ahead else wanted):  # the caches hold one layer's weights
                if not isinstance(self.layers[target].ffn, MoE):
                    continue
                block = cast(Block, self.layers[target])
                guess = cast(MoE, block.ffn).predict(block.ffn_norm(x))
                if target in wanted:
                    experts.prefetch(target, guess)
                if read_ahead and target == layer:
                    held = memory.memory_of(layer, guess) if memory is not None else ()
                    request_read_ahead([*self._weights_of(layer), *held])

        return guess_ahead

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch: int = 1) -> KVCache:
        return KVCache.empty(self.args, batch, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: int,
        cache: KVCache,
        experts: Experts,
        absorb: bool | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Model.forward."""
        x = self.embed(tokens)
        rope = rope_tables(self.args, start_pos, tokens.shape[1], x.device)
        selection = None  # DSA: the last full layer's choice, reused by "shared" layers
        guess = tokens.shape[1] <= GUESS_MAX_NEW_POSITIONS
        with int8_activations(self.int8_activations), torch_on_one_thread():
            read_ahead = guess and self._start_read_ahead(x)
            for i, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers, strict=True)):
                guess_ahead = self._guess_ahead(i + 1, experts, read_ahead) if guess else None
                x, selection = layer(x, start_pos, rope, layer_cache, experts, selection, absorb, guess_ahead)
            if last_only:
                x = x[:, -1:]
            return self.head(self.norm(x)).float()

    @torch.inference_mode()
    def forward_prompt(
        self,
        tokens: torch.Tensor,
        start_pos: int,
        cache: KVCache,
        experts: Experts,
        chunk: int,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Model.forward_prompt layer by layer: every chunk passes a layer before any passes the next (same bits),
        so a MoE layer acquires the chunks' experts once, not once per chunk."""
        parts = list(tokens.split(chunk, dim=1))
        starts = [start_pos + i * chunk for i in range(len(parts))]
        xs = [self.embed(part) for part in parts]
        ropes = [rope_tables(self.args, s, part.shape[1], xs[0].device) for s, part in zip(starts, parts, strict=True)]
        selections: list[torch.Tensor | None] = [None] * len(parts)
        with int8_activations(self.int8_activations), prompt_rows(self.prompt_tiles), torch_on_one_thread():
            for layer, layer_cache in zip(cast("list[Block]", self.layers), cache.layers, strict=True):
                with expansions_kept():  # the cache only grows here: each full key block expanded once
                    for i, (x, start, rope) in enumerate(zip(xs, starts, ropes, strict=True)):
                        xs[i], selections[i] = layer.attend(x, start, rope, layer_cache, selections[i], None)
                xs = layer.ffn_window(xs, experts)
            if last_only:
                return self.head(self.norm(xs[-1][:, -1:])).float()
            return torch.cat([self.head(self.norm(x)).float() for x in xs], dim=1)

    @torch.inference_mode()
    def forward_prompts(
        self, chunks: list[torch.Tensor], caches: list[KVCache], experts: Experts
    ) -> list[torch.Tensor]:
        """Model.forward_prompts in one pass over every weight, each chunk bit-equal to its own forward.
        One-position chunks and remote experts: chunk by chunk."""
        if len(chunks) < 2 or is_remote(experts) or min(c.shape[1] for c in chunks) < 2:
            return super().forward_prompts(chunks, caches, experts)
        sizes = [chunk.shape[1] for chunk in chunks]
        starts = [cache.length for cache in caches]
        x = self.embed(torch.cat(chunks, dim=1))  # [1, N, dim]
        ropes = [rope_tables(self.args, start, size, x.device) for start, size in zip(starts, sizes, strict=True)]
        selections: list[torch.Tensor | None] = [None] * len(chunks)
        with int8_activations(self.int8_activations), prompt_rows(self.prompt_tiles), torch_on_one_thread():
            with rows_in_segments(sizes):
                for i, layer in enumerate(cast("list[Block]", self.layers)):
                    layer_caches = [cache.layers[i] for cache in caches]
                    x, selections = layer.forward_segments(x, sizes, starts, ropes, layer_caches, experts, selections)
            last = torch.tensor(sizes).cumsum(0) - 1
            with rows_alone():  # [chunks, 1, dim]
                logits = self.head(self.norm(x[0, last, None])).float()
        return list(logits[:, None])

    @torch.inference_mode()
    def forward_rows(self, tokens: list[int], caches: list[KVCache], experts: Experts) -> torch.Tensor:
        """Model.forward_rows: every weight read once for all rows, each row bit-equal to ``forward`` alone."""
        return self.forward_rows_hidden(tokens, caches, experts)[0]

    @torch.inference_mode()
    def forward_rows_hidden(
        self, tokens: list[int], caches: list[KVCache], experts: Experts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter.forward_rows_hidden; with every expert resident, one C call (fused_decode), same bits."""
        x = self.embed(torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None])  # [B, 1, dim]
        starts = row_positions(caches)
        ropes = [rope_tables(self.args, start, 1, x.device) for start in starts]
        selections: list[torch.Tensor | None] = [None] * len(tokens)
        with rows_alone(), int8_activations(self.int8_activations), torch_on_one_thread():
            layers = [cache.layers for cache in caches]
            fused = self._one_call.applies(x, layers, experts)
            if fused is not None:
                x = fused.step(x[:, 0], starts, ropes, layers)
                return self.head(self.norm(x)).float(), x
            read_ahead = self._start_read_ahead(x)
            for i, layer in enumerate(cast("list[Block]", self.layers)):
                layer_caches = [cache.layers[i] for cache in caches]
                guess_ahead = self._guess_ahead(i + 1, experts, read_ahead)
                x, selections = layer.forward_rows(x, starts, ropes, layer_caches, experts, selections, guess_ahead)
            return self.head(self.norm(x)).float()[:, -1], x[:, -1]

    def _layer_parts(self, x: torch.Tensor, caches: Sequence[LayerCache]) -> list[LayerParts] | None:
        return _block_parts(self.layers, x, caches)  # now: the loader swaps modules

    def drafter(self) -> Self | None:
        """Itself, with its MTP modules loaded."""
        return self if len(self.mtp) > 0 else None

    def hold_kv_b_int8(self, codes: Mapping[str, tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        for name, (q, scales, group_size) in codes.items():
            cast(MLA, self.get_submodule(name)).hold_kv_b_int8(q, scales, group_size)

    def new_draft_cache(self) -> DraftCache[LayerCache]:
        return cast(MTP, self.mtp[0]).new_cache(self.dtype, self.device)

    @torch.inference_mode()
    def draft(
        self,
        hidden: torch.Tensor,
        tokens: list[int],
        position: int,
        cache: DraftCache[LayerCache],
        experts: Experts,
        depth: int,
    ) -> list[int]:
        """Drafter.draft with the first MTP module."""
        with int8_activations(self.int8_activations), torch_on_one_thread():
            mtp = cast(MTP, self.mtp[0])
            return draft_with(mtp, self.embed, self.head, (hidden, tokens, position), cache, experts, depth)


def _block_parts(blocks: Iterable[nn.Module], x: torch.Tensor, caches: Sequence[LayerCache]) -> list[LayerParts] | None:
    """The blocks described for the one-call decode step, or None where an attention is not in C forms."""
    parts = []
    for block, cache in zip(cast("Iterable[Block]", blocks), caches, strict=True):
        attention = block._fused_attention(x[:1], cache, None)
        if attention is None:
            return None
        parts.append(LayerParts(attention, block.ffn_norm, block.ffn))
    return parts
