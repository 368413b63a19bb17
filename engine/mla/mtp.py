"""Multi-token prediction (DeepSeek-V3 report §2.2): the MTP module after the last block, as a drafter.

    x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])    [S, 2 dim] -> [S, dim]; h_i before the final norm
    x = block(x)                                          MLA + MoE, with its own cache
    logits = head(norm(x))                                predicts t_{i+2}; embed and head are the main model's

The ``DraftCache`` holds positions decoded since drafting began (a prefill keeps no hidden states);
positions past the last real pair are the draft chain's, forgotten at the next draft.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, Self, cast

import torch
from torch import nn

from engine.config.args import ModelArgs
from engine.core.cache import DraftCache, LayerCache
from engine.core.layers import RMSNorm
from engine.core.rope import rope_tables
from engine.core.sources import Experts
from engine.kernels.rows import Linear, rows_alone


class FusedRows(Protocol):
    """Decode steps of the block's rows in one C call (fused_decode.FusedDecode)."""

    def step(
        self, x: torch.Tensor, starts: list[int], ropes: list[tuple[torch.Tensor, torch.Tensor]],
        caches: Sequence[Sequence[LayerCache]],
    ) -> torch.Tensor: ...  # fmt: skip


class BlockStep(Protocol):
    """Where the block's decode steps may run as one C call (fused_decode.OneCall; the model builds it, so this
    module stays below the fused step)."""

    def forget(self) -> None: ...

    def applies(
        self, x: torch.Tensor, caches: Sequence[Sequence[LayerCache]], experts: Experts
    ) -> FusedRows | None: ...


class MTP(nn.Module):
    """One MTP module; ``layer_id`` names its block's experts to the expert source."""

    def __init__(self, args: ModelArgs, layer_id: int, block: nn.Module):
        """``block``: a model.py Block (built there: model.py imports this file)."""
        super().__init__()
        self.args = args
        self.layer_id = layer_id
        self.enorm = RMSNorm(args.dim, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.dim, args.rms_norm_eps)
        self.eh_proj = Linear(2 * args.dim, args.dim, bias=False)
        self.block = block
        self.norm = RMSNorm(args.dim, args.rms_norm_eps)
        self.one_call: BlockStep | None = None  # set by model.py

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        if self.one_call is not None:
            self.one_call.forget()  # .to(), .float(), ...: new tensors
        # torch leaves Module._apply unannotated (it returns self)
        return cast(Self, super()._apply(fn, recurse))  # type: ignore[no-untyped-call]

    def new_cache(self, dtype: torch.dtype, device: torch.device) -> DraftCache[LayerCache]:
        return DraftCache(lambda: LayerCache.empty(self.args, self.layer_id, 1, dtype, device))

    def start_draft(self, position: int, cache: DraftCache[LayerCache]) -> None:
        """A draft's first pair goes at ``position`` (what was held from it on is forgotten)."""
        cache.continue_at(position)

    def collapse(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., dim] -> the normalised input of the shared head."""
        return self.norm(hidden)

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        ids: torch.Tensor,
        position: int,
        cache: DraftCache[LayerCache],
        experts: Experts,
    ) -> torch.Tensor:
        """hidden, embedded [1, S, dim] (h_i, embed(t_{i+1}), i = position..) -> [1, S, dim] before ``norm``,
        appended to ``cache``. ``ids`` [1, S]: unused here (V4's block routes by them)."""
        cache.continue_at(position)
        seqlen = hidden.shape[1]
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        rows = [[cache.layer]] * seqlen
        with rows_alone():  # the C step's solo bits
            fused = None if self.one_call is None else self.one_call.applies(x, rows, experts)
        if fused is not None:
            starts = [position - cache.offset + j for j in range(seqlen)]
            ropes = [rope_tables(self.args, position + j, 1, x.device) for j in range(seqlen)]
            return fused.step(x[0], starts, ropes, rows)[None]
        rope = rope_tables(self.args, position, seqlen, x.device)
        out: tuple[torch.Tensor, torch.Tensor | None] = self.block(
            x, position - cache.offset, rope, cache.layer, experts, None, None
        )
        return out[0]
