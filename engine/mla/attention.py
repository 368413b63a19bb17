"""Multi-head Latent Attention (MLA) over the compressed cache, optionally DSA-sparse.

Shapes: B batch, S new positions, T = start_pos + S cached positions, H heads, c kv_lora_rank,
r qk_rope_head_dim, n qk_nope_head_dim, v v_head_dim, K positions selected by the DSA indexer.

Two mathematically equal ways to attend:
- expanded (prefill): wkv_b expands every cached latent into k_nope [T, H, n] and v [T, H, v].
- absorbed (decode): wkv_b's k half folded into the query ([H, n] -> [H, c]), scores against the cached
  latents, the v half applied after the weighted sum. With DSA the K chosen latents are gathered, not masked.

Past one key block of cache, several new positions go through engine/mla/prefill.py, so memory is bounded
by S x H x the key block, never by H x T.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine.config.args import ModelArgs
from engine.core.cache import LayerCache
from engine.core.layers import RMSNorm, query_blocks
from engine.core.rope import apply_rope, softmax_scale
from engine.kernels import decode_ops
from engine.kernels.quant import scale_values
from engine.kernels.read_ahead import ReadsOtherFormInDecode
from engine.kernels.rows import Linear, one_segment, products_on_threads
from engine.mla.expansions import block_expansion
from engine.mla.indexer import Indexer
from engine.mla.prefill import absorbed_blocks, absorbed_is_cheaper, expanded_blocks, key_block, selected_blocks

ABSORB_MAX_NEW_POSITIONS = 4  # auto mode: absorbed attention for decode-sized steps

# _project's result: q latent or None, q, latent, rope key
_Projected = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]


class MLA(nn.Module, ReadsOtherFormInDecode):
    kv_b_codes: torch.Tensor  # buffers of hold_kv_b_int8, declared for the type checker
    kv_b_scales: torch.Tensor

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.n_heads = args.n_heads
        self.kv_lora_rank = args.kv_lora_rank
        self.nope_dim = args.qk_nope_head_dim
        self.rope_dim = args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.rope_interleave = args.rope_interleave
        self.softmax_scale = softmax_scale(args)
        q_out = args.n_heads * args.qk_head_dim
        self.q_lora_rank = args.q_lora_rank
        if self.q_lora_rank:
            self.wq_a = Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=1e-6)  # the q/kv latent norms use 1e-6, not rms_norm_eps
            self.wq_b = Linear(args.q_lora_rank, q_out, bias=False)
        else:
            self.wq = Linear(args.dim, q_out, bias=False)
        self.wkv_a = Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, eps=1e-6)
        self.wkv_b = Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.indexer = Indexer(args) if args.has_indexer(layer_id) else None
        self.kv_b_group = 0  # > 0: wkv_b's int8 records are held too (hold_kv_b_int8)

    def hold_kv_b_int8(self, q: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
        """Keep wkv_b's int8 records (codes [H * (n + v), c], scales [H * (n + v), ceil(c / group)]) beside
        its float weight, for one query's absorbed attention (a quarter of the bytes); prefill reads the float."""
        self.register_buffer("kv_b_codes", q.contiguous(), persistent=False)
        self.register_buffer("kv_b_scales", scale_values(scales).contiguous(), persistent=False)
        self.kv_b_group = group_size

    def decode_unread(self) -> list[torch.Tensor]:
        """Weights one query's attention does not read: the float wkv_b while its int8 records are held."""
        return [self.wkv_b.weight] if self.kv_b_group > 0 else []

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        selection: torch.Tensor | None = None,
        absorb: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, S, dim] -> (out [B, S, dim], DSA selection [B, S, K] or None).

        ``selection`` is the previous full layer's choice, reused on DSA "shared" layers.
        ``absorb`` forces an attention path; None picks absorbed for S <= ABSORB_MAX_NEW_POSITIONS.
        """
        out, selection = self._attend(x, self._project(x), start_pos, rope, cache, selection, absorb)
        return self.wo(out.flatten(2)), selection

    def forward_rows(
        self,
        x: torch.Tensor,
        starts: list[int],
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        caches: list[LayerCache],
        selections: list[torch.Tensor | None],
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One new position of each of B independent sequences: x [B, 1, dim] -> (out [B, 1, dim], selections).

        Row b is at position starts[b] of caches[b]; projections run over all rows at once.
        """
        projected = self._project(x)
        if x.shape[0] == 1:  # decode alone: no per-row slices, no cat
            out, selection = self._attend(x, projected, starts[0], ropes[0], caches[0], selections[0], None)
            return self.wo(out.flatten(2)), [selection]
        out, chosen = self._attend_each(x, projected, 0, [1] * x.shape[0], starts, ropes, caches, selections)
        return self.wo(out.flatten(2)), chosen

    def forward_segments(
        self,
        x: torch.Tensor,
        sizes: list[int],
        starts: list[int],
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        caches: list[LayerCache],
        selections: list[torch.Tensor | None],
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Prompt chunks of several sequences inside rows_in_segments(sizes): x [1, N, dim] -> (out [1, N, dim],
        selections); chunk i is sizes[i] positions from starts[i] of caches[i], with the bits ``forward`` gives
        it alone."""
        projected = self._project(x)
        with one_segment():
            out, chosen = self._attend_each(x, projected, 1, sizes, starts, ropes, caches, selections)
        return self.wo(out.flatten(2)), chosen

    def _attend_each(
        self,
        x: torch.Tensor,
        projected: _Projected,
        dim: int,
        sizes: list[int],
        starts: list[int],
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        caches: list[LayerCache],
        selections: list[torch.Tensor | None],
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """``_attend`` per sequence on sizes[i] consecutive entries of ``dim`` -> (outputs cat along ``dim``,
        selections)."""
        outs, chosen, first = [], [], 0
        for size, start, rope, cache, selection in zip(sizes, starts, ropes, caches, selections, strict=True):
            part = cast(_Projected, tuple(None if t is None else t.narrow(dim, first, size) for t in projected))
            out, selection = self._attend(x.narrow(dim, first, size), part, start, rope, cache, selection, None)
            outs.append(out)
            chosen.append(selection)
            first += size
        return torch.cat(outs, dim=dim), chosen

    def _project(self, x: torch.Tensor) -> _Projected:
        """x [B, S, dim] -> (q latent [B, S, q_lora] or None, q [B, S, H, n + r], latent [B, S, c],
        rope key [B, S, r] not yet roped)."""
        bsz, seqlen, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x)) if self.q_lora_rank else None
        q = (self.wq_b(q_latent) if q_latent is not None else self.wq(x)).view(bsz, seqlen, self.n_heads, -1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return q_latent, q, self.kv_norm(latent), k_rope

    def _attend(
        self,
        x: torch.Tensor,
        projected: _Projected,
        start_pos: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        selection: torch.Tensor | None,
        absorb: bool | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One sequence's projections at positions start_pos.. against its cache -> ([B, S, H, v], selection)."""
        q_latent, q, latent, k_rope = projected
        seqlen = x.shape[1]
        if cache.length != start_pos:
            raise ValueError(f"cache holds {cache.length} positions but start_pos is {start_pos}")
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        # the rope key rotated as one more head: one rotation instead of two, the same floats
        roped = apply_rope(torch.cat([q_rope, k_rope[:, :, None]], dim=2), *rope, interleaved=self.rope_interleave)
        q_rope, k_rope = roped[:, :, : self.n_heads], roped[:, :, self.n_heads]
        latents, rope_keys = cache.append(latent, k_rope)  # [B, T, c], [B, T, r]
        if self.indexer is not None:
            selection = self.indexer(x, q_latent, start_pos, rope, cache)
        if seqlen > 1 and latents.shape[1] > key_block(seqlen, self.n_heads):
            if absorb is None and selection is not None and selection.shape[-1] < latents.shape[1]:
                return self._selected(q_nope, q_rope, latents, rope_keys, start_pos, selection), selection
            if absorb is None:
                dims = (self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim)
                absorb = absorbed_is_cheaper(seqlen, self.n_heads, *dims)
            return self._blocked(q_nope, q_rope, latents, rope_keys, start_pos, selection, absorb), selection
        if absorb is None:
            absorb = seqlen <= ABSORB_MAX_NEW_POSITIONS
        attend = self._absorbed if absorb else self._expanded
        return attend(q_nope, q_rope, latents, rope_keys, start_pos, selection), selection

    def _blocked(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latents: torch.Tensor,
        rope_keys: torch.Tensor,
        start_pos: int,
        selection: torch.Tensor | None,
        absorb: bool,
    ) -> torch.Tensor:
        """S > 1 new positions against a cache of several key blocks -> [B, S, H, v], per sequence."""
        outs = []
        for b in range(q_nope.shape[0]):
            row = (
                q_nope[b],
                q_rope[b],
                latents[b],
                rope_keys[b],
                start_pos,
                None if selection is None else selection[b],
            )
            if absorb:
                outs.append(absorbed_blocks(*row, self._kv_b(), self.softmax_scale))
            else:
                outs.append(expanded_blocks(*row, block_expansion(self.wkv_b, b), self.softmax_scale))
        return torch.stack(outs)

    def _selected(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latents: torch.Tensor,
        rope_keys: torch.Tensor,
        start_pos: int,
        selection: torch.Tensor,
    ) -> torch.Tensor:
        """S > 1 new positions, each against its K DSA-chosen cached positions only -> [B, S, H, v]."""
        rows = zip(q_nope, q_rope, latents, rope_keys, selection, strict=True)
        kv_b = self._kv_b()
        return torch.stack([selected_blocks(*row[:4], start_pos, row[4], kv_b, self.softmax_scale) for row in rows])

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """wkv_b split per head: k part [H, n, c] and v part [H, v, c]."""
        w = self.wkv_b.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _expanded(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latents: torch.Tensor,
        rope_keys: torch.Tensor,
        start_pos: int,
        selection: torch.Tensor | None,
    ) -> torch.Tensor:
        bsz, total = latents.shape[0], latents.shape[1]
        kv = self.wkv_b(latents).view(bsz, total, self.n_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [B, T, H, n], [B, T, H, v]
        score_bytes = bsz * self.n_heads * total * 4  # one query's float32 scores
        return torch.cat(
            [
                self._expanded_block(
                    q_nope[:, block],
                    q_rope[:, block],
                    k_nope,
                    v,
                    rope_keys,
                    start_pos + block.start,
                    None if selection is None else selection[:, block],
                )
                for block in query_blocks(q_nope.shape[1], score_bytes)
            ],
            dim=1,
        )

    def _expanded_block(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        k_nope: torch.Tensor,
        v: torch.Tensor,
        rope_keys: torch.Tensor,
        start_pos: int,
        selection: torch.Tensor | None,
    ) -> torch.Tensor:
        """Queries start_pos.. of one block against all T expanded keys -> [B, S_block, H, v]."""
        bsz, seqlen, total = q_nope.shape[0], q_nope.shape[1], k_nope.shape[1]
        work = bsz * seqlen * self.n_heads * total * (self.nope_dim + self.rope_dim)
        with products_on_threads(work):
            nope = torch.einsum("bshn,bthn->bsht", q_nope, k_nope)
            scores = nope + torch.einsum("bshr,btr->bsht", q_rope, rope_keys)
        visible = _causal(start_pos, seqlen, total, q_nope.device)[None]  # [1, S, T]
        if selection is not None:
            chosen = torch.zeros(bsz, seqlen, total, dtype=torch.bool, device=q_nope.device)
            visible = visible & chosen.scatter_(-1, selection, True)
        scores = scores.mul(self.softmax_scale).masked_fill(~visible[:, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q_nope.dtype)  # exp: on one thread
        with products_on_threads(work):
            return torch.einsum("bsht,bthv->bshv", probs, v)

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latents: torch.Tensor,
        rope_keys: torch.Tensor,
        start_pos: int,
        selection: torch.Tensor | None,
    ) -> torch.Tensor:
        bsz, seqlen, total = q_nope.shape[0], q_nope.shape[1], latents.shape[1]
        if bsz == seqlen == 1:  # decode, alone or in rows
            return self._absorbed_one(q_nope, q_rope, latents, rope_keys, selection)
        w_k, w_v = self._kv_b()
        with products_on_threads(bsz * seqlen * self.n_heads * self.nope_dim * self.kv_lora_rank):
            q_latent = torch.einsum("bshn,hnc->bshc", q_nope, w_k)
        positions = torch.arange(total, device=q_nope.device).expand(bsz, seqlen, total)
        if selection is not None:
            positions = selection
            latents = _gather_positions(latents, selection)  # [B, S, K, c]
            rope_keys = _gather_positions(rope_keys, selection)  # [B, S, K, r]
        else:
            latents, rope_keys = latents[:, None], rope_keys[:, None]  # broadcast over S
        work = bsz * seqlen * self.n_heads * positions.shape[-1] * (self.kv_lora_rank + self.rope_dim)
        with products_on_threads(work):
            scores = torch.einsum("bshc,bstc->bsht", q_latent, latents.expand(-1, seqlen, -1, -1)) + torch.einsum(
                "bshr,bstr->bsht", q_rope, rope_keys.expand(-1, seqlen, -1, -1)
            )
        query_pos = torch.arange(start_pos, start_pos + seqlen, device=q_nope.device)[None, :, None]
        visible = positions <= query_pos  # [B, S, K or T]
        scores = scores.mul(self.softmax_scale).masked_fill(~visible[:, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q_nope.dtype)  # exp: on one thread
        with products_on_threads(work):
            mixed = torch.einsum("bsht,bstc->bshc", probs, latents.expand(-1, seqlen, -1, -1))
            return torch.einsum("bshc,hvc->bshv", mixed, w_v)

    def _absorbed_one(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latents: torch.Tensor,
        rope_keys: torch.Tensor,
        selection: torch.Tensor | None,
    ) -> torch.Tensor:
        """_absorbed for one query (q_nope [1, 1, H, n], q_rope [1, 1, H, r]) -> [1, 1, H, v].

        No causal mask: the query is the newest position, so every cached (or selected) position is visible.
        """
        heads, rank = self.n_heads, self.kv_lora_rank
        if decode_ops.small_ops_take(q_nope, one_row=True) and self.wkv_b.weight.dtype == torch.float32:
            positions = None if selection is None else selection.reshape(-1)
            held = self.kv_b_group > 0
            out = decode_ops.attend_one(
                q_nope[0, 0], q_rope[0, 0], latents[0], rope_keys[0], positions,
                self.kv_b_codes if held else self.wkv_b.weight, self.kv_b_scales if held else None,
                self.kv_b_group, self.softmax_scale,
            )  # fmt: skip
            return out.view(1, 1, heads, self.v_dim)
        if selection is not None:  # [1, K, c], [1, K, r]
            latents = _gather_positions(latents, selection)[:, 0]
            rope_keys = _gather_positions(rope_keys, selection)[:, 0]
        w_k, w_v = self._kv_b()
        q_latent = torch.bmm(q_nope[0, 0].unsqueeze(1), w_k)  # [H, 1, c]
        scores = torch.bmm(q_latent.view(1, heads, rank), latents.transpose(1, 2)) + torch.bmm(
            q_rope.reshape(1, heads, self.rope_dim), rope_keys.transpose(1, 2)
        )  # [1, H, T or K]
        probs = scores.mul(self.softmax_scale).softmax(dim=-1, dtype=torch.float32).to(q_nope.dtype)
        mixed = torch.bmm(probs, latents)  # [1, H, c]
        return torch.bmm(mixed.view(heads, 1, rank), w_v.transpose(1, 2)).view(1, 1, heads, self.v_dim)


def _causal(start_pos: int, seqlen: int, total: int, device: torch.device) -> torch.Tensor:
    """[S, T] True where query start_pos + s may see key t."""
    return (
        torch.arange(total, device=device)[None, :]
        <= torch.arange(start_pos, start_pos + seqlen, device=device)[:, None]
    )


def _gather_positions(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [B, T, d], positions [B, S, K] -> [B, S, K, d]"""
    bsz, seqlen, k = positions.shape
    flat = positions.reshape(bsz, seqlen * k, 1).expand(-1, -1, x.shape[-1])
    return x.gather(1, flat).view(bsz, seqlen, k, x.shape[-1])
