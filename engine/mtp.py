"""Multi-token prediction: the MTP module DeepSeek-V3/R1 and GLM-5 ship after their last block, as a drafter.

DeepSeek-V3 report §2.2: at position i the module joins the main model's hidden state h_i (before the
final norm) with the embedding of token i+1,

    x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])    [S, 2 dim] -> [S, dim]
    x = block(x)                                          a decoder block (MLA + MoE) with its own cache
    logits = head(norm(x))                                predicts t_{i+2}; embed and head are the main model's

so after the main model has produced token n (from h_{n-1}), the module drafts token n+1; applied again
to its own output and that draft, token n+2, and so on. A draft only proposes: the main model verifies
every drafted token (``Transformer.forward_rows`` over the sequence's new positions, each computed as its
own decode step), so drafts change how many tokens a step yields, never which.

``DraftCache`` (engine/cache.py) is the module's attention state of one sequence. It holds positions from
``offset`` on: the module sees the pairs (h_i, t_{i+1}) of the positions decoded since drafting began (a
gap, when drafting paused, starts it afresh), not the prompt's, whose hidden states a prefill does not
keep.
Positions past the last real pair are the draft chain's own and are forgotten at the next draft.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.args import ModelArgs
from engine.cache import DraftCache, LayerCache
from engine.experts import Experts
from engine.layers import RMSNorm
from engine.rope import rope_tables
from engine.rows import Linear


class MTP(nn.Module):
    """One MTP module: its two input norms, the joining projection, its block (layer id ``layer_id`` for
    the expert source) and its output norm."""

    def __init__(self, args: ModelArgs, layer_id: int, block: nn.Module):
        """``block``: an engine/model.py Block of layer ``layer_id`` (built there: model.py imports this file)."""
        super().__init__()
        self.args = args
        self.layer_id = layer_id
        self.enorm = RMSNorm(args.dim, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.dim, args.rms_norm_eps)
        self.eh_proj = Linear(2 * args.dim, args.dim, bias=False)
        self.block = block
        self.norm = RMSNorm(args.dim, args.rms_norm_eps)

    def new_cache(self, dtype: torch.dtype, device: torch.device) -> DraftCache:
        return DraftCache(LayerCache.empty(self.args, self.layer_id, 1, dtype, device))

    def forward(
        self, hidden: torch.Tensor, embedded: torch.Tensor, position: int, cache: DraftCache, experts: Experts
    ) -> torch.Tensor:
        """hidden, embedded [1, S, dim] (h_i and embed(t_{i+1}) for positions i = position..) -> the
        module's hidden states [1, S, dim] (before ``norm``); the S positions are appended to ``cache``."""
        cache.continue_at(position)
        seqlen = hidden.shape[1]
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        rope = rope_tables(self.args, position, seqlen, x.device)
        out: tuple[torch.Tensor, torch.Tensor | None] = self.block(
            x, position - cache.offset, rope, cache.layer, experts, None, None
        )
        return out[0]


def draft_tokens(
    mtp: MTP,
    embed: nn.Embedding,
    head: Linear,
    hidden: torch.Tensor,
    tokens: list[int],
    position: int,
    cache: DraftCache,
    experts: Experts,
    depth: int,
) -> list[int]:
    """``depth`` greedy drafts after the pairs (hidden [S, dim] = h_i, tokens[s] = t_{i+1}) of positions
    i = position .. position + S - 1: the first predicts the token after tokens[-1], each next one is the
    module applied again to its own last hidden state and draft (one position further on)."""
    ids = torch.tensor([tokens], dtype=torch.long, device=hidden.device)
    x = mtp(hidden[None], embed(ids), position, cache, experts)[:, -1:]  # [1, 1, dim]
    drafts: list[int] = []
    for step in range(depth):
        drafts.append(int(head(mtp.norm(x)).float().argmax()))
        if step + 1 < depth:
            following = torch.tensor([[drafts[-1]]], dtype=torch.long, device=hidden.device)
            x = mtp(x, embed(following), position + len(tokens) + step, cache, experts)
    return drafts
