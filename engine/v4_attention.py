"""DeepSeek-V4 attention: one shared K=V head over a sliding window plus compressed entries.

Shapes: B batch, S new positions, H heads, D head_dim (query heads and the one K=V head), r rope_dim
(the roped tail of a head), n sliding_window, E compressed entries so far, g o_groups.

    q  = rope(rms(wq_b(q_norm(wq_a x))))            [B, S, H, D]   per-head unweighted rms
    kv = rope(kv_norm(wkv x))                        [B, S, D]      key and value at once
    keys = the last n positions' kv (the query's own included), then, on compressed layers, the entries:
      HCA: every entry whose window has closed by the query's position (all of them, densely)
      CSA: the index_topk closed entries the lightning indexer scores highest for this query
    out = softmax([q.k * D^-1/2, sink_h]) without the sink column, applied to the same keys as values
    out = rope(out, -angle of the query)              undo the values' rotation on the roped tail
    y   = wo_b(per group of H/g heads: wo_a_g(out_g))

Sliding layers rope with the main rope; CSA/HCA layers and their compressors with the compress rope.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.args import ModelArgs
from engine.compressor import Compressor, CompressorState
from engine.hyper import unweighted_rms_norm
from engine.layers import RMSNorm, query_blocks
from engine.rope import rope_at, rotate_tail
from engine.rows import Linear, linear
from engine.v4_cache import V4LayerCache


class V4Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        v4 = args.v4
        self.n_heads, self.head_dim, self.rope_dim = args.n_heads, v4.head_dim, v4.rope_dim
        self.window = v4.sliding_window
        self.groups = v4.o_groups
        self.eps = args.rms_norm_eps
        self.rate = v4.rate(layer_id)
        self.rope = args.compress_rope if self.rate else args.rope
        self.wq_a = Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = Linear(args.q_lora_rank, args.n_heads * v4.head_dim, bias=False)
        self.wkv = Linear(args.dim, v4.head_dim, bias=False)
        self.kv_norm = RMSNorm(v4.head_dim, args.rms_norm_eps)
        self.wo_a = GroupedLinear(args.n_heads * v4.head_dim // v4.o_groups, v4.o_lora_rank, v4.o_groups)
        self.wo_b = Linear(v4.o_groups * v4.o_lora_rank, args.dim, bias=False)
        self.sink = nn.Parameter(torch.empty(args.n_heads))
        self.compressor = (
            Compressor(args.dim, v4.head_dim, self.rate, v4.is_csa(layer_id), self.rope, v4.rope_dim, self.eps)
            if self.rate
            else None
        )
        self.indexer = Indexer(args) if v4.is_csa(layer_id) else None

    def forward(self, x: torch.Tensor, start_pos: int, cache: V4LayerCache) -> torch.Tensor:
        """x [B, S, dim] at positions start_pos.. -> [B, S, dim]; appends the S positions to ``cache``."""
        bsz, seqlen, _ = x.shape
        if cache.length != start_pos:
            raise ValueError(f"cache holds {cache.length} positions but start_pos is {start_pos}")
        positions = torch.arange(start_pos, start_pos + seqlen, device=x.device)
        cos, sin = rope_at(self.rope, self.rope_dim, positions)
        q_latent = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_latent).view(bsz, seqlen, self.n_heads, self.head_dim), self.eps)
        q = rotate_tail(q, cos, sin)
        kv = rotate_tail(self.kv_norm(self.wkv(x)), cos, sin)
        recent, first_recent = cache.append(kv, self.window)  # [B, R, D] from position first_recent on
        entries, visible = None, None
        if self.compressor is not None:
            entries = self.compressor(x, cache.compressor)  # [B, E, D]
            visible = self._visible_entries(x, q_latent, positions, cos, sin, entries, cache.indexer)
        out = self._attend(q, recent, first_recent, positions, entries, visible)
        out = rotate_tail(out, cos, -sin)
        return self.wo_b(self.wo_a(out.flatten(2)))

    def _visible_entries(self, x, q_latent, positions, cos, sin, entries, indexer_state) -> torch.Tensor:
        """[B, S, E] True where a query may attend to an entry: its window closed by the query's
        position, and on CSA layers chosen by the indexer."""
        closed = torch.arange(entries.shape[1], device=x.device)[None, :] < ((positions + 1) // self.rate)[:, None]
        if self.indexer is None:
            return closed[None].expand(x.shape[0], -1, -1)
        return self.indexer(x, q_latent, cos, sin, closed, indexer_state)

    def _attend(self, q, recent, first_recent, positions, entries, visible) -> torch.Tensor:
        """q [B, S, H, D] against the sliding keys and the visible entries -> [B, S, H, D]."""
        score_bytes = q.shape[0] * self.n_heads * (recent.shape[1] + (0 if entries is None else entries.shape[1])) * 4
        blocks = []
        for block in query_blocks(q.shape[1], score_bytes):
            lo = max(int(positions[block.start]) - self.window + 1, first_recent) - first_recent
            hi = int(positions[block.stop - 1]) + 1 - first_recent
            key_pos = torch.arange(first_recent + lo, first_recent + hi, device=q.device)
            query_pos = positions[block, None]
            seen = (key_pos[None, :] <= query_pos) & (key_pos[None, :] > query_pos - self.window)  # [S_b, K]
            keys, mask = recent[:, lo:hi], seen[None].expand(q.shape[0], -1, -1)
            if entries is not None and entries.shape[1]:
                keys = torch.cat([keys, entries], dim=1)
                mask = torch.cat([mask, visible[:, block]], dim=-1)
            blocks.append(self._softmax_with_sink(q[:, block], keys, mask))
        return torch.cat(blocks, dim=1)

    def _softmax_with_sink(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, S, H, D], keys (= values) [B, K, D], mask [B, S, K] -> [B, S, H, D].

        Each head has a learned sink logit that takes softmax mass and contributes no value."""
        scores = torch.einsum("bshd,bkd->bshk", q, keys) * self.head_dim**-0.5
        scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
        sink = self.sink.to(scores.dtype).view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1, dtype=logits.dtype)[..., :-1]
        return torch.einsum("bshk,bkd->bshd", probs.to(keys.dtype), keys)


class GroupedLinear(nn.Module):
    """wo_a: weight [g * o_lora, H * D / g], a block of o_lora rows per group of heads. Not an nn.Linear,
    so the loader never swaps it for a bf16 or int8 kernel that would take all groups' inputs at once:
    it is held in the compute dtype."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, H * D] -> [B, S, g * o_lora]: group i's slice of x through group i's rows."""
        grouped = x.unflatten(-1, (self.groups, -1))  # [B, S, g, H*D/g]
        weight = self.weight.view(self.groups, -1, grouped.shape[-1])  # [g, o_lora, H*D/g]
        return torch.einsum("bsgi,goi->bsgo", grouped, weight).flatten(2)


class Indexer(nn.Module):
    """CSA's lightning indexer: its own (narrower) overlapping compressor, and per query

        score[s, e] = sum_h w[s, h] * ReLU(q[s, h] . k[e]) / sqrt(d),  w = weights_proj(x) / sqrt(H_i)

    over the closed entries; the index_topk best are the entries the query attends to."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        v4 = args.v4
        self.n_heads, self.head_dim, self.topk = v4.index_n_heads, v4.index_head_dim, v4.index_topk
        self.wq_b = Linear(args.q_lora_rank, v4.index_n_heads * v4.index_head_dim, bias=False)
        self.weights_proj = Linear(args.dim, v4.index_n_heads, bias=False)
        self.compressor = Compressor(
            args.dim, v4.index_head_dim, v4.csa_rate, True, args.compress_rope, v4.rope_dim, args.rms_norm_eps
        )

    def forward(self, x, q_latent, cos, sin, closed: torch.Tensor, state: CompressorState) -> torch.Tensor:
        """x [B, S, dim], q_latent [B, S, q_lora], closed [S, E] -> chosen [B, S, E] (bool)."""
        bsz, seqlen, _ = x.shape
        keys = self.compressor(x, state)  # [B, E, d]
        if keys.shape[1] == 0:
            return closed[None].expand(bsz, -1, -1)
        q = rotate_tail(self.wq_b(q_latent).view(bsz, seqlen, self.n_heads, self.head_dim), cos, sin)
        # weights_proj stays float32 in bf16 models (colibri_stream.dtypes.FLOAT32_PARAMETERS)
        weights = linear(x.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5  # [B, S, H_i]
        score_bytes = bsz * self.n_heads * keys.shape[1] * 4  # one query's float32 head scores
        return torch.cat(
            [
                self._choose(q[:, block], keys, weights[:, block], closed[block])
                for block in query_blocks(seqlen, score_bytes)
            ],
            dim=1,
        )

    def _choose(self, q, keys, weights, closed) -> torch.Tensor:
        """One block of queries q [B, S, H_i, d] against the entries' keys [B, E, d] -> chosen [B, S, E]."""
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1)).relu() * self.head_dim**-0.5
        index = (scores * weights.unsqueeze(-1)).sum(dim=2).masked_fill(~closed, float("-inf"))  # [B, S, E]
        top = index.topk(min(self.topk, keys.shape[1]), dim=-1).indices
        chosen = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, top, True)
        return chosen & closed
