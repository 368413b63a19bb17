"""Prefill attention over a long cache, in memory that does not grow with heads x cached positions.

Shapes as in engine/mla/attention.py: S new positions (queries at start_pos..), T cached positions, H heads,
c kv_lora_rank, r qk_rope_head_dim, n qk_nope_head_dim, v v_head_dim; Tk the positions of a key block.

Expanding every cached position for every head ([T, H, n + v]) is tens of GiB per layer at full context, so
keys go one block at a time with an online softmax, in one of two exact forms:

- expanded: each block's latents through wkv_b ([Tk, H, n + v]), scores per head against them (a prompt
  window's chunks expand each full block once: engine/mla/expansions.py);
- absorbed: wkv_b's k half folded into the queries ([S, H, n] -> [S, H, c]), one score matmul for all heads
  against the latents, its v half applied once at the end. Cheaper for short chunks (``absorbed_is_cheaper``).

DSA masks the unchosen positions with one [S, T] bool mask, never per head.
"""

from __future__ import annotations

import torch

from engine.kernels.rows import elementwise_on_threads, products_on_threads
from engine.mla.expansions import BlockExpansion

# A key block's scores [S, H, Tk] float32 take at most this (Tk at least MIN_KEY_BLOCK positions).
KEY_BLOCK_BYTES = 8 << 20
MIN_KEY_BLOCK = 32


def key_block(seqlen: int, heads: int) -> int:
    """Cached positions per key block: scores [S, H, Tk] float32 within KEY_BLOCK_BYTES."""
    return max(MIN_KEY_BLOCK, KEY_BLOCK_BYTES // (seqlen * heads * 4))


def absorbed_is_cheaper(seqlen: int, heads: int, rank: int, nope_dim: int, rope_dim: int, v_dim: int) -> bool:
    """Multiply-adds per (query, cached position): absorbed H (2c + r) against expanded H (n + v) c / S +
    H (n + r + v)."""
    expanded = (nope_dim + v_dim) * rank / seqlen + nope_dim + rope_dim + v_dim
    return 2 * rank + rope_dim < expanded


class OnlineSoftmax:
    """softmax(scores) @ values accumulated one key block at a time in float32 over rows (H x S). Per block:
    ``weigh`` the scores, multiply the weights by the block's values, ``accumulate`` that."""

    def __init__(self, rows: tuple[int, ...], v_dim: int, device: torch.device):
        self.best = torch.full(rows, float("-inf"), device=device)
        self.mass = torch.zeros(rows, device=device)
        self.out = torch.zeros(*rows, v_dim, device=device)
        self.rescale = self.mass  # the last block's factor on what came before it

    def weigh(self, scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """scores [*rows, Tk] float32 (masked: -inf), consumed in place -> exp(score - running max) in
        ``dtype``, the weights of the block's values."""
        new_best = torch.maximum(self.best, scores.amax(dim=-1))
        # a row that has seen no position yet keeps -inf: shift it by 0, so exp gives 0 rather than nan
        shift = new_best.masked_fill(new_best == float("-inf"), 0.0)
        with elementwise_on_threads(scores):  # exact, and exp on aligned parts: the bits of one thread
            weights = scores.sub_(shift[..., None]).exp_()
        self.rescale = (self.best - shift).exp_()  # exp(-inf) = 0 before a row's first visible position
        self.mass.mul_(self.rescale).add_(weights.sum(dim=-1))
        self.best = new_best
        return weights.to(dtype)

    def accumulate(self, mixed: torch.Tensor) -> None:
        """mixed [*rows, v]: the weights ``weigh`` returned times the block's values."""
        self.out.mul_(self.rescale[..., None]).add_(mixed)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        return self.out.div_(self.mass[..., None]).to(dtype)


def mask_bias(
    start_pos: int, seqlen: int, keys: slice, chosen: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """[S, Tk] float32: 0 where query start_pos + s may see cached position t of ``keys`` (causal, and
    with DSA among its ``chosen`` [S, T]), -inf elsewhere."""
    queries = torch.arange(start_pos, start_pos + seqlen, device=device)[:, None]
    seen = torch.arange(keys.start, keys.stop, device=device)[None, :] <= queries
    if chosen is not None:
        seen &= chosen[:, keys]
    return torch.zeros(seen.shape, device=device).masked_fill_(~seen, float("-inf"))


def chosen_mask(selection: torch.Tensor, total: int) -> torch.Tensor:
    """One sequence's selection [S, K] positions -> [S, T] bool, True at the chosen ones."""
    mask = torch.zeros(selection.shape[0], total, dtype=torch.bool, device=selection.device)
    return mask.scatter_(-1, selection, True)


def key_blocks(total: int, step: int) -> list[slice]:
    return [slice(first, min(first + step, total)) for first in range(0, total, step)]


def expanded_blocks(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latents: torch.Tensor,
    rope_keys: torch.Tensor,
    start_pos: int,
    selection: torch.Tensor | None,
    expand: BlockExpansion,
    scale: float,
) -> torch.Tensor:
    """One sequence: q_nope [S, H, n], q_rope [S, H, r] against latents [T, c], rope_keys [T, r] ->
    [S, H, v], each key block's latents expanded through wkv_b (``expand``)."""
    seqlen, heads, nope_dim = q_nope.shape
    rope_dim, dtype = q_rope.shape[-1], q_nope.dtype
    query = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1).contiguous()  # [H, S, n + r]
    chosen = None if selection is None else chosen_mask(selection, latents.shape[0])
    softmax: OnlineSoftmax | None = None
    step = key_block(seqlen, heads)
    for keys in key_blocks(latents.shape[0], step):
        bias = mask_bias(start_pos, seqlen, keys, chosen, q_nope.device)
        if chosen is not None and bool(bias.isneginf().all()):
            continue  # no query chose a position of this block: nothing to expand
        block = keys.stop - keys.start
        kv = expand(latents, keys, block == step).view(block, heads, -1)  # [Tk, H, n + v]
        key = torch.cat([kv[..., :nope_dim], rope_keys[keys, None].expand(block, heads, rope_dim)], dim=-1)
        value = kv[..., nope_dim:].transpose(0, 1)  # [H, Tk, v], a view
        work = heads * seqlen * block * (nope_dim + rope_dim)
        with products_on_threads(work):
            scores = torch.baddbmm(bias.to(dtype), query, key.permute(1, 2, 0), alpha=scale)  # [H, S, Tk]
        if softmax is None:
            softmax = OnlineSoftmax((heads, seqlen), value.shape[-1], q_nope.device)
        weights = softmax.weigh(scores.float(), dtype)
        with products_on_threads(work):
            mixed = torch.bmm(weights, value)
        softmax.accumulate(mixed.float())
    if softmax is None:
        raise ValueError("no query sees any cached position")
    return softmax.result(dtype).transpose(0, 1)  # [S, H, v]


def absorbed_blocks(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latents: torch.Tensor,
    rope_keys: torch.Tensor,
    start_pos: int,
    selection: torch.Tensor | None,
    kv_b: tuple[torch.Tensor, torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """The same attention with wkv_b ``kv_b`` = (k part [H, n, c], v part [H, v, c]) folded into the
    queries and applied after the weighted sum of latents: per key block one matmul for all heads."""
    seqlen, heads, _ = q_nope.shape
    rank, dtype = latents.shape[-1], q_nope.dtype
    w_k, w_v = kv_b
    with products_on_threads(heads * seqlen * q_nope.shape[-1] * rank):
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_k)  # [H, S, c]
    query = torch.cat([q_latent, q_rope.transpose(0, 1)], dim=-1).mul_(scale).view(heads * seqlen, -1)
    chosen = None if selection is None else chosen_mask(selection, latents.shape[0])
    softmax = OnlineSoftmax((heads, seqlen), rank, q_nope.device)
    for keys in key_blocks(latents.shape[0], key_block(seqlen, heads)):
        bias = mask_bias(start_pos, seqlen, keys, chosen, q_nope.device)
        if chosen is not None and bool(bias.isneginf().all()):
            continue
        block_latents = latents[keys]
        key = torch.cat([block_latents, rope_keys[keys]], dim=-1)  # [Tk, c + r], shared by the heads
        work = heads * seqlen * key.shape[0] * key.shape[1]
        with products_on_threads(work):
            scores = torch.mm(query, key.t()).view(heads, seqlen, -1).add_(bias.to(dtype))  # [H, S, Tk]
        weights = softmax.weigh(scores.float(), dtype).view(heads * seqlen, -1)
        with products_on_threads(work):
            mixed = torch.mm(weights, block_latents)
        softmax.accumulate(mixed.view(heads, seqlen, rank).float())
    with products_on_threads(heads * seqlen * rank * w_v.shape[1]):
        return torch.bmm(softmax.result(dtype), w_v.transpose(1, 2)).transpose(0, 1)  # [H, S, c] -> [S, H, v]


# selected_blocks: a query block's temporaries (``selected_block``) within this
SELECTED_BLOCK_BYTES = 8 << 20


def selected_block(heads: int, topk: int, rank: int, rope_dim: int, item: int) -> int:
    """Queries per block of ``selected_blocks``: per query its gathered latents and rope keys [K, c + r] and
    its absorbed query and weighted latents [H, c] (``item`` bytes each), its float32 scores and softmax and
    their cast [H, K], within SELECTED_BLOCK_BYTES."""
    per_query = topk * (rank + rope_dim) * item + 2 * heads * rank * item + heads * topk * (2 * 4 + item)
    return max(1, SELECTED_BLOCK_BYTES // per_query)


def selected_blocks(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latents: torch.Tensor,
    rope_keys: torch.Tensor,
    start_pos: int,
    selection: torch.Tensor,
    kv_b: tuple[torch.Tensor, torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """One sequence under a DSA selection [S, K] (K < T): each query against its K chosen positions only,
    absorbed as one decode query's attention is: its latents and rope keys gathered, a query's positions
    after its own (the indexer's fillers) masked. The same attention as the masked forms above at K / T of
    their products and exps. Memory: the output [S, H, v] and one query block's temporaries, never [S, T]
    nor [T, ...] copies."""
    seqlen, heads, nope_dim = q_nope.shape
    rank, rope_dim, dtype = latents.shape[-1], rope_keys.shape[-1], q_nope.dtype
    topk = selection.shape[-1]
    w_k, w_v = kv_b
    out = q_nope.new_empty(seqlen, heads, w_v.shape[1])
    step = selected_block(heads, topk, rank, rope_dim, latents.element_size())
    for first in range(0, seqlen, step):
        rows = slice(first, min(first + step, seqlen))
        chosen = selection[rows]  # [Sq, K]
        block = chosen.shape[0]
        flat = chosen.reshape(-1)
        chosen_latents = latents.index_select(0, flat).view(block, topk, rank)
        chosen_rope = rope_keys.index_select(0, flat).view(block, topk, rope_dim)
        work = block * heads * topk * (rank + rope_dim)
        with products_on_threads(work + block * heads * nope_dim * rank):
            q_latent = torch.bmm(q_nope[rows].transpose(0, 1), w_k).transpose(0, 1)  # [Sq, H, c]
            scores = torch.bmm(q_rope[rows], chosen_rope.transpose(1, 2))  # [Sq, H, K]
            scores = scores.baddbmm_(q_latent, chosen_latents.transpose(1, 2))
        position = torch.arange(start_pos + rows.start, start_pos + rows.stop, device=q_nope.device)
        future = (chosen > position[:, None])[:, None, :]  # [Sq, 1, K]
        scores = scores.mul_(scale).masked_fill_(future, float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(dtype)  # exp: on one thread
        with products_on_threads(work + block * heads * rank * w_v.shape[1]):
            mixed = torch.bmm(probs, chosen_latents).transpose(0, 1)  # [H, Sq, c]
            out[rows] = torch.bmm(mixed, w_v.transpose(1, 2)).transpose(0, 1)  # [Sq, H, v]
    return out
