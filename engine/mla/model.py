"""Block and Transformer: the whole forward pass, reading top to bottom.

    tokens -> embed -> n_layers x [attn_norm -> MLA(+DSA) -> residual -> ffn_norm -> MLP|MoE -> residual]
           -> norm -> head -> logits

Routed experts are not parameters of this module: every MoE layer asks the expert source passed to
``forward`` (engine/core/sources.py) for the experts its router picked.
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
from engine.kernels.modes import int8_activations
from engine.kernels.read_ahead import module_arrays, read_ahead_available, request_read_ahead
from engine.kernels.rows import Linear, rows_alone, rows_in_segments, torch_on_one_thread
from engine.mla.attention import MLA
from engine.mla.decode import FusedMLA, fused_attention_applies
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
        self._fused: FusedMLA | Literal[False] | None = None  # the attention's C steps: None not built yet, False n/a

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

        ``rope``: (cos, sin) from ``rope_tables``, each [S, qk_rope_head_dim // 2] float32.
        ``cache``: this layer's compressed KV cache; the S new positions are appended to it.
        ``selection``: DSA only, int64 [B, S, K], the cached positions each query attends to, as
        chosen by the last "full" layer's indexer; None without DSA or while the context fits in
        index_topk. Layers with their own indexer replace it, "shared" layers reuse it; the returned
        one is passed on to the next layer.
        ``absorb``: forces the attention path, True absorbed (decode), False expanded (prefill),
        None automatic by S.
        ``guess_ahead``: optional hook called with the post-attention hidden state [B, S, dim] before
        this layer's FFN, to prefetch the experts the next MoE layer will probably route to.
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
        """The FFN half of ``forward`` for several prompt chunks x_i [B, S_i, dim], each the bits it gets
        alone; a MoE layer acquires their experts once (MoE.forward_window)."""
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
        """Inside rows_in_segments(sizes): prompt chunks of several sequences one after another, x [1, N, dim]
        -> (x [1, N, dim], selections), each chunk the bits ``forward`` gives it alone (MLA.forward_segments,
        MoE.forward_segments): the weights are read once for all of them."""
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
        """One new position of each of B independent sequences (x [B, 1, dim]; see MLA.forward_rows): the
        FFN runs over all rows, so a MoE layer acquires the union of the rows' experts once."""
        one_sequence = all(cache is caches[0] for cache in caches)  # decode alone, or a verify step's rows
        fused = self._fused_attention(x[:1], caches[0], None) if one_sequence else None
        if fused is not None:  # each row the C steps of its own decode step, one after another
            attended = [fused(x[b : b + 1], starts[b], ropes[b], caches[b], selections[b]) for b in range(len(caches))]
            x = torch.cat([row for row, _ in attended]) if len(attended) > 1 else attended[0][0]
            return self._ffn(x, experts, guess_ahead), [selection for _, selection in attended]
        attn_out, selections = self.attn.forward_rows(self.attn_norm(x), starts, ropes, caches, selections)
        return self._ffn(x + attn_out, experts, guess_ahead), selections

    def _fused_attention(self, x: torch.Tensor, cache: LayerCache, absorb: bool | None) -> FusedMLA | None:
        """The attention step in two C calls (engine/mla/decode.py) where it applies, built at first use."""
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
    prompt_in_windows = True  # forward_prompt reads a prompt's chunks layer by layer

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
        self.int8_activations = False  # the kernel matmuls quantise their inputs (engine/kernels/q8.py; lossy, opt-in)
        # decode reads the next layer's weights into the CPU caches on the kernels' idle thread (kernels/read_ahead.py);
        # a loss where they do not fit the cache beside the current layer's, so the loader decides per machine
        self.read_ahead = True
        self._weights_listed: dict[int, list[torch.Tensor]] = {}  # layer -> its dense weights, for request_read_ahead()
        self._one_call = OneCall(self._layer_parts, range(args.n_layers))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        self._weights_listed = {}  # .to(), .float(), ...: new tensors
        self._one_call.forget()
        # torch leaves Module._apply unannotated (it returns self)
        return cast(Self, super()._apply(fn, recurse))  # type: ignore[no-untyped-call]

    def _weights_of(self, layer: int) -> list[torch.Tensor]:
        """Layer ``layer``'s dense weights in the order a forward reads them (past the last layer: the
        final norm and the output head), listed once: the loader swaps modules before the first forward."""
        if layer not in self._weights_listed:
            following = self.layers[layer] if layer < len(self.layers) else nn.ModuleList([self.norm, self.head])
            self._weights_listed[layer] = module_arrays(following)
        return self._weights_listed[layer]

    def _start_read_ahead(self, x: torch.Tensor) -> bool:
        """Whether this decode step reads ahead (CPU activations, 2+ kernel threads); if so, layer 0's
        weights are asked for now, each later layer's at the guess before it."""
        if not self.read_ahead or x.device.type != "cpu" or not read_ahead_available():
            return False
        request_read_ahead(self._weights_of(0))
        return True

    def read_ahead_bytes(self, experts_per_token: int, expert_bytes: int) -> int:
        """The most bytes one read-ahead request names: a layer's dense weights (past the last layer, the
        final norm and the head), plus on a MoE layer ``experts_per_token`` guessed experts of
        ``expert_bytes`` each."""

        def request(layer: int) -> int:
            moe = layer < len(self.layers) and isinstance(self.layers[layer].ffn, MoE)
            return sum(t.nbytes for t in self._weights_of(layer)) + (experts_per_token * expert_bytes if moe else 0)

        return max(request(layer) for layer in range(len(self.layers) + 1))

    def _guess_ahead(
        self, layer: int, experts: Experts, read_ahead: bool = False
    ) -> Callable[[torch.Tensor], None] | None:
        """A hook given the current post-attention hidden state before the current layer's FFN: layer
        ``layer``'s router picks the experts to prefetch while that FFN runs, and so do the routers of the
        MoE layers after it the source looks ahead to (``lookahead``): a guess two layers ahead is less often
        right (docs/benchmarks-log.md, "Figures behind the code") but its read has a whole layer more to land,
        and the next layer guesses again. With ``read_ahead`` it also has the kernels' idle
        helper thread read layer ``layer``'s dense weights, then the guessed experts the source holds,
        into the CPU caches (engine/kernels/read_ahead.py); past the last layer, the output head. None when there is
        nothing to do."""
        if layer >= len(self.layers) or not isinstance(self.layers[layer].ffn, MoE):
            return (lambda x: request_read_ahead(self._weights_of(layer))) if read_ahead else None
        coming = range(layer, len(self.layers))
        memory = experts.offers().read_ahead

        def guess_ahead(x: torch.Tensor) -> None:
            wanted = experts.lookahead(coming)  # a source may know a guess would change nothing
            for target in sorted({*wanted, layer} if read_ahead else wanted):  # the caches hold one layer's weights
                if not isinstance(self.layers[target].ffn, MoE):
                    continue
                block = cast(Block, self.layers[target])  # nn.ModuleList types its items as Module
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
        """tokens [B, S] at positions start_pos.. -> float32 logits [B, S, vocab] (S=1 if last_only).

        Appends the S positions to ``cache``. ``absorb`` forces the attention path (None: automatic).
        """
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
        """``forward`` of tokens [B, S] cut in chunks of ``chunk`` positions, one after another, read layer
        by layer: every chunk passes a layer before any chunk passes the next. Each chunk meets the same
        cache, positions and DSA selection as in its own ``forward`` after the chunks before it, so the
        logits and the cache hold the same bits; but a MoE layer acquires the union of the chunks' experts
        once: a prompt under a small budget reads each expert once per layer, not once per chunk."""
        parts = list(tokens.split(chunk, dim=1))
        starts = [start_pos + i * chunk for i in range(len(parts))]
        xs = [self.embed(part) for part in parts]
        ropes = [rope_tables(self.args, s, part.shape[1], xs[0].device) for s, part in zip(starts, parts, strict=True)]
        selections: list[torch.Tensor | None] = [None] * len(parts)  # DSA: each chunk's, layer to layer
        with int8_activations(self.int8_activations), torch_on_one_thread():
            for layer, layer_cache in zip(cast("list[Block]", self.layers), cache.layers, strict=True):
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
        """``Model.forward_prompts`` in one pass: the chunks' rows go through every weight together, each chunk
        with the bits of its own forward (engine/kernels/rows.py rows_in_segments; Block.forward_segments); its last
        position's logits as a one-row forward computes them (rows_alone). One-position chunks (a decode-shaped
        step of its own) and experts held by workers: chunk by chunk."""
        if len(chunks) < 2 or is_remote(experts) or min(c.shape[1] for c in chunks) < 2:
            return super().forward_prompts(chunks, caches, experts)
        sizes = [chunk.shape[1] for chunk in chunks]
        starts = [cache.length for cache in caches]
        x = self.embed(torch.cat(chunks, dim=1))  # [1, N, dim]
        ropes = [rope_tables(self.args, start, size, x.device) for start, size in zip(starts, sizes, strict=True)]
        selections: list[torch.Tensor | None] = [None] * len(chunks)
        with int8_activations(self.int8_activations), torch_on_one_thread():
            with rows_in_segments(sizes):
                for i, layer in enumerate(cast("list[Block]", self.layers)):
                    layer_caches = [cache.layers[i] for cache in caches]
                    x, selections = layer.forward_segments(x, sizes, starts, ropes, layer_caches, experts, selections)
            last = torch.tensor(sizes).cumsum(0) - 1
            with rows_alone():  # [chunks, 1, dim]: each as the one-row head of its own forward
                logits = self.head(self.norm(x[0, last, None])).float()
        return list(logits[:, None])

    @torch.inference_mode()
    def forward_rows(self, tokens: list[int], caches: list[KVCache], experts: Experts) -> torch.Tensor:
        """Decode one token for each of B independent sequences in one pass -> float32 logits [B, vocab].

        tokens[b] goes at the end of caches[b] (each its own length, positions and DSA state). Every
        weight is read once for all rows and each MoE layer acquires the union of their experts, while
        each row is computed exactly as ``forward`` computes it alone (engine/kernels/rows.py): a request's
        tokens do not depend on what it is batched with.
        """
        return self.forward_rows_hidden(tokens, caches, experts)[0]

    @torch.inference_mode()
    def forward_rows_hidden(
        self, tokens: list[int], caches: list[KVCache], experts: Experts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_rows`` -> (logits [B, vocab], hidden states [B, dim] before the final norm: what an MTP
        module drafts from). Consecutive rows may share a cache (the same object): each such row goes at
        the position after the previous one's, and is computed as that sequence's own next decode step
        would compute it: a verify step of drafted tokens gives each the bits plain decoding gives it. With
        int8 activations and every expert resident the whole step is one C call (engine/mla/fused_decode.py), the
        same bits."""
        x = self.embed(torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None])  # [B, 1, dim]
        starts = row_positions(caches)
        ropes = [rope_tables(self.args, start, 1, x.device) for start in starts]
        selections: list[torch.Tensor | None] = [None] * len(tokens)
        with rows_alone(), int8_activations(self.int8_activations), torch_on_one_thread():
            layers = [cache.layers for cache in caches]
            fused = self._one_call.applies(x, layers, experts)
            if fused is not None:  # the whole step in one C call
                x = fused.step(x[:, 0], starts, ropes, layers)
                return self.head(self.norm(x)).float(), x
            read_ahead = self._start_read_ahead(x)
            for i, layer in enumerate(cast("list[Block]", self.layers)):  # a ModuleList of Blocks
                layer_caches = [cache.layers[i] for cache in caches]
                guess_ahead = self._guess_ahead(i + 1, experts, read_ahead)
                x, selections = layer.forward_rows(x, starts, ropes, layer_caches, experts, selections, guess_ahead)
            return self.head(self.norm(x)).float()[:, -1], x[:, -1]

    def _layer_parts(self, x: torch.Tensor, caches: Sequence[LayerCache]) -> list[LayerParts] | None:
        return _block_parts(self.layers, x, caches)  # the layers now: the loader swaps modules before a forward

    def drafter(self) -> Self | None:
        """Itself, with its MTP modules loaded."""
        return self if len(self.mtp) > 0 else None

    def hold_kv_b_int8(self, codes: Mapping[str, tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        for name, (q, scales, group_size) in codes.items():
            cast(MLA, self.get_submodule(name)).hold_kv_b_int8(q, scales, group_size)  # names of MLA modules

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
        """``depth`` drafted tokens from the first MTP module (engine/mla/mtp.py draft_with), re-applied past
        the first: hidden [S, dim] and tokens are the pairs (h_i, t_{i+1}) of positions position.. not yet
        in ``cache``."""
        with int8_activations(self.int8_activations), torch_on_one_thread():
            mtp = cast(MTP, self.mtp[0])
            return draft_with(mtp, self.embed, self.head, (hidden, tokens, position), cache, experts, depth)


def _block_parts(blocks: Iterable[nn.Module], x: torch.Tensor, caches: Sequence[LayerCache]) -> list[LayerParts] | None:
    """The blocks (engine/mla/model.py Block) described for the one-call decode step (engine/mla/fused_decode.py), or
    None where an attention is not in forms its C steps read."""
    parts = []
    for block, cache in zip(cast("Iterable[Block]", blocks), caches, strict=True):
        attention = block._fused_attention(x[:1], cache, None)
        if attention is None:
            return None
        parts.append(LayerParts(attention, block.ffn_norm, block.ffn))
    return parts
