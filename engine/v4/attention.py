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

from engine.config.args import ModelArgs
from engine.core.layers import RMSNorm, query_blocks
from engine.core.rope import rope_at, rotate_tail
from engine.kernels.bf16 import TakesBf16Weight, bf16_linear
from engine.kernels.rows import Linear, linear
from engine.v4.cache import V4LayerCache
from engine.v4.compressor import Compressor, CompressorState
from engine.v4.hyper import unweighted_rms_norm

GATHER_MAX_NEW_POSITIONS = 4  # decode-sized steps gather the entries CSA's indexer picked


class V4Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        v4 = args.v4
        assert (
            v4 is not None and args.compress_rope is not None
        )  # a V4 module is built from deepseek_v4 args (engine/families.py)
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
        if self.compressor is None:
            out = self._attend(q, recent, first_recent, positions)
        else:
            entries = self.compressor(x, cache.compressor)  # [B, E, D]
            # [S, E]: an entry is visible to a query once its window has closed by the query's position
            closed = torch.arange(entries.shape[1], device=x.device)[None, :] < ((positions + 1) // self.rate)[:, None]
            if self.indexer is None:  # HCA: every closed entry
                out = self._attend(q, recent, first_recent, positions, entries, closed[None].expand(bsz, -1, -1))
            else:  # CSA: the closed entries the indexer picks, [B, S, k] (-1: none)
                picked = self.indexer(x, q_latent, cos, sin, closed, cache.indexer)
                if seqlen <= GATHER_MAX_NEW_POSITIONS:
                    out = self._attend_picked(q, recent, first_recent, positions, entries, picked)
                else:
                    out = self._attend(
                        q, recent, first_recent, positions, entries, picked_mask(picked, entries.shape[1])
                    )
        out = rotate_tail(out, cos, -sin)
        return self.wo_b(self.wo_a(out.flatten(2)))

    def _window(
        self, recent: torch.Tensor, first_recent: int, positions: torch.Tensor, block: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sliding keys a block of queries may see: (rows [B, K, D], mask [S_b, K])."""
        lo = max(int(positions[block.start]) - self.window + 1, first_recent) - first_recent
        hi = int(positions[block.stop - 1]) + 1 - first_recent
        key_pos = torch.arange(first_recent + lo, first_recent + hi, device=recent.device)
        query_pos = positions[block, None]
        return recent[:, lo:hi], (key_pos[None, :] <= query_pos) & (key_pos[None, :] > query_pos - self.window)

    def _attend(
        self,
        q: torch.Tensor,
        recent: torch.Tensor,
        first_recent: int,
        positions: torch.Tensor,
        entries: torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, S, H, D] against the sliding keys and the entries ``visible`` [B, S, E] marks -> [B, S, H, D]."""
        bsz = q.shape[0]
        score_bytes = bsz * self.n_heads * (recent.shape[1] + (0 if entries is None else entries.shape[1])) * 4
        blocks = []
        for block in query_blocks(q.shape[1], score_bytes):
            keys, seen = self._window(recent, first_recent, positions, block)
            mask = seen[None].expand(bsz, -1, -1)
            if entries is not None and entries.shape[1]:
                keys = torch.cat([keys, entries], dim=1)
                mask = torch.cat([mask, visible[:, block]], dim=-1)  # type: ignore[index]  # given with entries
            scores = torch.einsum("bshd,bkd->bshk", q[:, block], keys).masked_fill(~mask[:, :, None, :], float("-inf"))
            probs = self._with_sink(scores)
            blocks.append(torch.einsum("bshk,bkd->bshd", probs.to(keys.dtype), keys))
        return torch.cat(blocks, dim=1)

    def _attend_picked(
        self,
        q: torch.Tensor,
        recent: torch.Tensor,
        first_recent: int,
        positions: torch.Tensor,
        entries: torch.Tensor,
        picked: torch.Tensor,
    ) -> torch.Tensor:
        """A few queries q [B, S, H, D]: the sliding keys plus the k entries picked per query ([B, S, k], -1:
        none), gathered: O(k) per token where masking all E would be O(E)."""
        keys, seen = self._window(recent, first_recent, positions, slice(0, q.shape[1]))
        index = picked.clamp(min=0)[..., None].expand(-1, -1, -1, entries.shape[-1])
        chosen = entries[:, None].expand(-1, q.shape[1], -1, -1).gather(2, index)  # [B, S, k, D]
        window_scores = torch.einsum("bshd,bkd->bshk", q, keys).masked_fill(~seen[None, :, None, :], float("-inf"))
        picked_scores = torch.einsum("bshd,bskd->bshk", q, chosen).masked_fill(picked[:, :, None, :] < 0, float("-inf"))
        probs = self._with_sink(torch.cat([window_scores, picked_scores], dim=-1)).to(keys.dtype)
        window_probs, picked_probs = probs.split([keys.shape[1], chosen.shape[2]], dim=-1)
        return torch.einsum("bshk,bkd->bshd", window_probs, keys) + torch.einsum(
            "bshk,bskd->bshd", picked_probs, chosen
        )

    def _with_sink(self, scores: torch.Tensor) -> torch.Tensor:
        """Unscaled scores [B, S, H, K] (-inf where masked) -> probabilities [B, S, H, K]: each head has a
        learned sink logit that takes softmax mass and contributes no value."""
        scores = scores * self.head_dim**-0.5
        sink = self.sink.to(scores.dtype).view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        return logits.softmax(dim=-1, dtype=logits.dtype)[..., :-1]


def picked_mask(picked: torch.Tensor, n_entries: int) -> torch.Tensor:
    """picked [B, S, k] (-1: none) -> [B, S, E] True at the picked entries."""
    mask = torch.zeros((*picked.shape[:2], n_entries + 1), dtype=torch.bool, device=picked.device)
    return mask.scatter_(-1, torch.where(picked < 0, n_entries, picked), True)[..., :n_entries]


class GroupedLinear(nn.Module, TakesBf16Weight):
    """wo_a: weight [g * o_lora, H * D / g], o_lora rows per group of heads. Not an nn.Linear, so the loader
    never swaps it for a kernel that would take all groups' inputs at once."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, H * D] -> [B, S, g * o_lora]: group i's slice of x through group i's rows."""
        grouped = x.unflatten(-1, (self.groups, -1))  # [B, S, g, H*D/g]
        if self.weight.dtype != x.dtype:  # bf16-held
            blocks = self.weight.chunk(self.groups)
            return torch.cat([bf16_linear(grouped[..., g, :], blocks[g]) for g in range(self.groups)], dim=-1)
        weight = self.weight.view(self.groups, -1, grouped.shape[-1])  # [g, o_lora, H*D/g]
        return torch.einsum("bsgi,goi->bsgo", grouped, weight).flatten(2)


class Indexer(nn.Module):
    """CSA's lightning indexer: its own (narrower) overlapping compressor, and per query

        score[s, e] = sum_h w[s, h] * ReLU(q[s, h] . k[e]) / sqrt(d),  w = weights_proj(x) / sqrt(H_i)

    over the closed entries; the index_topk best are the entries the query attends to."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        v4 = args.v4
        assert (
            v4 is not None and args.compress_rope is not None
        )  # a V4 module is built from deepseek_v4 args (engine/families.py)
        self.n_heads, self.head_dim, self.topk = v4.index_n_heads, v4.index_head_dim, v4.index_topk
        self.wq_b = Linear(args.q_lora_rank, v4.index_n_heads * v4.index_head_dim, bias=False)
        self.weights_proj = Linear(args.dim, v4.index_n_heads, bias=False)
        self.compressor = Compressor(
            args.dim, v4.index_head_dim, v4.csa_rate, True, args.compress_rope, v4.rope_dim, args.rms_norm_eps
        )

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        closed: torch.Tensor,
        state: CompressorState,
    ) -> torch.Tensor:
        """x [B, S, dim], q_latent [B, S, q_lora], closed [S, E] -> the picked entries [B, S, min(k, E)]
        (-1 where a query has fewer than k closed entries)."""
        bsz, seqlen, _ = x.shape
        keys = self.compressor(x, state)  # [B, E, d]
        if keys.shape[1] == 0:
            return torch.empty((bsz, seqlen, 0), dtype=torch.long, device=x.device)
        q = rotate_tail(self.wq_b(q_latent).view(bsz, seqlen, self.n_heads, self.head_dim), cos, sin)
        # float32 even in bf16 models (checkpoint.dtypes.FLOAT32_PARAMETERS)
        weights = linear(x.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5  # [B, S, H_i]
        score_bytes = bsz * self.n_heads * keys.shape[1] * 4  # one query's head scores
        return torch.cat(
            [
                self._choose(q[:, block], keys, weights[:, block], closed[block])
                for block in query_blocks(seqlen, score_bytes)
            ],
            dim=1,
        )

    def _choose(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, closed: torch.Tensor) -> torch.Tensor:
        """One block of queries q [B, S, H_i, d] against the entries' keys [B, E, d] -> picked [B, S, k]."""
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1)).relu() * self.head_dim**-0.5
        index = (scores * weights.unsqueeze(-1)).sum(dim=2).masked_fill(~closed, float("-inf"))  # [B, S, E]
        top = index.topk(min(self.topk, keys.shape[1]), dim=-1).indices
        return torch.where(closed.expand_as(index).gather(-1, top), top, -1)
