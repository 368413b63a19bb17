"""DSA lightning indexer: picks, per query, the index_topk past positions MLA attends to.

score[s, t] = sum_h w[s, h] * ReLU(q[s, h] . k[t] / sqrt(d)),  w = weights_proj(x) / sqrt(H)
with k = RoPE(LayerNorm(wk x)) cached per layer and q = RoPE(wq_b(q latent)); only the first
qk_rope_head_dim dims of a head are roped. Scoring runs in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config.args import ModelArgs
from engine.core.cache import LayerCache
from engine.core.layers import query_blocks, stable_topk_indices
from engine.core.rope import apply_rope
from engine.kernels import decode_ops
from engine.kernels.rows import Linear, linear, products_on_threads
from engine.mla.index_blocks import blocked_choice

# A prompt chunk against more keys than this is scored in blocked GEMMs (engine/mla/index_blocks.py); within
# it, and for every decode row, the per-query kernel (or the einsum form) as before, bit for bit.
BLOCKED_FROM_KEYS = 2048


class Indexer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.rope_dim = args.qk_rope_head_dim
        self.topk = args.index_topk
        self.interleaved = args.indexer_rope_interleave
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(args.dim, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(args.dim, self.n_heads, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated = apply_rope(x[..., : self.rope_dim], cos, sin, self.interleaved)
        return torch.cat([rotated, x[..., self.rope_dim :]], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        start_pos: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
    ) -> torch.Tensor | None:
        """x [B, S, dim], q_latent [B, S, q_lora] -> selected positions [B, S, K], or None (keep all).

        The layer's latent/rope key for these positions must already be in ``cache``. Rows that see fewer
        than K positions get non-causal fillers, which the attention's causal mask removes.
        """
        return self.select(x, q_latent, self.keys(x, *rope), start_pos, rope, cache)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, dim] at the angles cos/sin [S, rope / 2] -> indexer keys [B, S, D]. Each position alone:
        the one-call decode step passes several sequences' rows as one sequence."""
        k = self.wk(x)
        if decode_ops.index_finish_takes(k) and self._norm_is_float32():
            return decode_ops.index_finish(k, 1, self.k_norm, self.rope_dim, self.interleaved, cos, sin)[..., 0, :]
        return self._rope(self.k_norm(k), cos, sin)

    def _norm_is_float32(self) -> bool:
        return self.k_norm.weight.dtype == self.k_norm.bias.dtype == torch.float32

    def select(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        k: torch.Tensor,
        start_pos: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
    ) -> torch.Tensor | None:
        """``forward`` past the keys: k [B, S, D] (``keys``) appended to ``cache``, then the selection."""
        keys = cache.append_index_key(k.float())  # [B, T, D]
        if not self.chooses(keys.shape[1]):
            return None
        return self.choose(*self.queries(x, q_latent, rope), keys, start_pos)

    def chooses(self, seen: int) -> bool:
        """Whether a query that sees ``seen`` keys chooses among them (within index_topk all stay)."""
        return seen > self.topk

    def queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, dim], q_latent [B, S, q_lora] -> (query heads [B, S, H, D], weights [B, S, H]) float32.
        Each position alone, as ``keys``."""
        bsz, seqlen, _ = x.shape
        projected = self.wq_b(q_latent)
        if decode_ops.index_finish_takes(projected):
            q = decode_ops.index_finish(projected, self.n_heads, None, self.rope_dim, self.interleaved, *rope)
        else:
            q = self._rope(projected.view(bsz, seqlen, self.n_heads, self.head_dim), *rope)
        # float32 even in bf16 models, as the reference
        weights = linear(x.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5
        return q.float(), weights

    def choose(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start_pos: int) -> torch.Tensor:
        """q [B, S, H, D], weights [B, S, H] of positions start_pos.. against keys [B, T, D] -> chosen [B, S, K]."""
        bsz, seqlen, total = q.shape[0], q.shape[1], keys.shape[1]
        if seqlen > 1 and total > BLOCKED_FROM_KEYS:
            scale = self.head_dim**-0.5
            return torch.stack(
                [blocked_choice(q[b], weights[b], keys[b], start_pos, scale, self.topk) for b in range(bsz)]
            )
        score_bytes = bsz * self.n_heads * total * 4  # one query's float32 head scores
        return torch.cat(
            [
                self._select(q[:, block], keys, weights[:, block], start_pos + block.start)
                for block in query_blocks(seqlen, score_bytes)
            ],
            dim=1,
        )

    def _select(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, start_pos: int) -> torch.Tensor:
        """One block of queries q [B, S, H, D] (positions start_pos..) vs keys [B, T, D] -> [B, S, K]."""
        if decode_ops.index_select_takes(q, keys):
            return decode_ops.index_select(q, keys, weights, start_pos, self.head_dim**-0.5, self.topk)
        seqlen, total = q.shape[1], keys.shape[1]
        # no transcendental here, so the top-k may run threaded too
        with products_on_threads(q.shape[0] * seqlen * self.n_heads * total * self.head_dim):
            scores = torch.einsum("bshd,btd->bsht", q, keys).mul_(self.head_dim**-0.5).relu_()
            index_scores = torch.einsum("bsh,bsht->bst", weights, scores)
            if start_pos + 1 < total:  # a decode row sees exactly its past: nothing to mask
                query_pos = torch.arange(start_pos, start_pos + seqlen, device=q.device)[:, None]
                future = torch.arange(total, device=q.device)[None, :] > query_pos  # [S, T]
                index_scores = index_scores.masked_fill(future, float("-inf"))
            return stable_topk_indices(index_scores, self.topk)
