"""The drafting loop every family's MTP module runs under (drafts change how many tokens a step yields,
never which: the main model verifies each)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from engine.core.cache import DraftCache
from engine.core.sources import Experts


class DraftModule(Protocol):
    """An MTP module as ``draft_with`` drives it (MTP, V4MTP)."""

    def start_draft(self, position: int, cache: DraftCache[Any]) -> None: ...

    def collapse(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def __call__(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        ids: torch.Tensor,
        position: int,
        cache: DraftCache[Any],
        experts: Experts,
    ) -> torch.Tensor: ...


def draft_with(
    module: DraftModule,
    embed: nn.Module,
    head: nn.Module,
    request: tuple[torch.Tensor, list[int], int],
    cache: DraftCache[Any],
    experts: Experts,
    depth: int,
) -> list[int]:
    """``depth`` drafts for ``request`` = (hidden [S, ...], tokens, first position), pairs not yet in ``cache``."""
    hidden, tokens, position = request
    module.start_draft(position, cache)

    def step(x: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
        return module(x, embed(ids), ids, first, cache, experts)

    def predict(x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = head(module.collapse(x))
        return logits

    return draft_tokens(step, predict, hidden, tokens, position, depth)


def draft_tokens(
    step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    predict: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    tokens: list[int],
    position: int,
    depth: int,
) -> list[int]:
    """``depth`` greedy drafts after the pairs (hidden[s] = h_i, tokens[s] = t_{i+1}), i = position..; each next
    one feeds the module its own last hidden state and draft.

    ``step(h [1, S, ...], ids [1, S], first position)`` -> hidden [1, S, ...], appended to its cache;
    ``predict(x [1, 1, ...])`` -> logits."""
    ids = torch.tensor([tokens], dtype=torch.long, device=hidden.device)
    x = step(hidden[None], ids, position)[:, -1:]
    drafts: list[int] = []
    for n in range(depth):
        drafts.append(int(predict(x).float().argmax()))
        if n + 1 < depth:
            following = torch.tensor([[drafts[-1]]], dtype=torch.long, device=hidden.device)
            x = step(x, following, position + len(tokens) + n)
    return drafts
