"""DSA lightning indexer: picks, per query, the index_topk past positions MLA attends to.

score[s, t] = sum_h w[s, h] * ReLU(q[s, h] . k[t] / sqrt(d)),  w = weights_proj(x) / sqrt(H)
with k = RoPE(LayerNorm(wk x)) cached per layer and q = RoPE(wq_b(q latent)). Only the first
qk_rope_head_dim dims of each indexer head are roped. Scoring runs in float32: on the CPU the scores
and their top-k are one C call (engine/kernels/decode_ops.py index_select), elsewhere torch's ops.
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

        The layer's latent/rope key for these positions must already be in ``cache``. Selection is
        skipped while the whole context fits in index_topk; rows that see fewer than K positions get
        non-causal fillers, which the attention's causal mask removes.
        """
        return self.select(x, q_latent, self.keys(x, *rope), start_pos, rope, cache)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, dim] at the angles cos/sin [S, rope / 2] -> their indexer keys [B, S, D]. Each position
        alone (a batch-invariant projection, a norm and a rotation per position): the one-call decode step
        computes a step's rows, of several sequences, as one sequence of S positions."""
        k = self.wk(x)
        if decode_ops.index_finish_takes(k) and self._norm_is_float32():  # decode rows: one call
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
        """Whether a query that sees ``seen`` keys chooses among them: within index_topk every position
        stays, and its queries are not needed."""
        return seen > self.topk

    def queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, dim], q_latent [B, S, q_lora] at the angles of ``rope`` -> (the query heads [B, S, H, D],
        their weights [B, S, H]), float32. Each position alone, as ``keys``: inside rows_alone() a row's
        bits are its own whatever rows come with it (the one-call decode step passes a step's rows as one
        sequence)."""
        bsz, seqlen, _ = x.shape
        projected = self.wq_b(q_latent)
        if decode_ops.index_finish_takes(projected):  # decode rows: one call
            q = decode_ops.index_finish(projected, self.n_heads, None, self.rope_dim, self.interleaved, *rope)
        else:
            q = self._rope(projected.view(bsz, seqlen, self.n_heads, self.head_dim), *rope)
        # weights_proj stays float32 even in bf16 models (the reference keeps it in fp32).
        weights = linear(x.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5
        return q.float(), weights

    def choose(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start_pos: int) -> torch.Tensor:
        """The queries q [B, S, H, D] and weights [B, S, H] (``queries``) of positions start_pos.. against the
        keys [B, T, D] they see -> the chosen positions [B, S, K]."""
        bsz, seqlen, total = q.shape[0], q.shape[1], keys.shape[1]
        score_bytes = bsz * self.n_heads * total * 4  # one query's float32 head scores
        return torch.cat(
            [
                self._select(q[:, block], keys, weights[:, block], start_pos + block.start)
                for block in query_blocks(seqlen, score_bytes)
            ],
            dim=1,
        )

    def _select(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, start_pos: int) -> torch.Tensor:
        """One block of queries q [B, S, H, D] (positions start_pos..) vs keys [B, T, D] -> [B, S, K]; on the
        CPU in one C call (engine/kernels/decode_ops.py index_select)."""
        if decode_ops.index_select_takes(q, keys):
            return decode_ops.index_select(q, keys, weights, start_pos, self.head_dim**-0.5, self.topk)
        seqlen, total = q.shape[1], keys.shape[1]
        # the scores over a long context on the kernel threads, the top-k too (no transcendental function)
        with products_on_threads(q.shape[0] * seqlen * self.n_heads * total * self.head_dim):
            scores = torch.einsum("bshd,btd->bsht", q, keys).mul_(self.head_dim**-0.5).relu_()
            index_scores = torch.einsum("bsh,bsht->bst", weights, scores)
            if start_pos + 1 < total:  # a key after the first query's position: mask each query's future
                # (a decode row sees exactly the keys up to its own position: nothing to mask, 3 ops saved)
                query_pos = torch.arange(start_pos, start_pos + seqlen, device=q.device)[:, None]
                future = torch.arange(total, device=q.device)[None, :] > query_pos  # [S, T]
                index_scores = index_scores.masked_fill(future, float("-inf"))
            return stable_topk_indices(index_scores, self.topk)
