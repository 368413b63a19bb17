"""The drafting loop every family's MTP module runs under (engine/mla/mtp.py MTP, engine/v4/mtp.py V4MTP).

A draft only proposes: the main model verifies every drafted token, so drafts change how many tokens a
step yields, never which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from engine.core.cache import DraftCache
from engine.core.sources import Experts


class DraftModule(Protocol):
    """An MTP module as ``draft_with`` drives it: MTP here, engine/v4/mtp.py V4MTP."""

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
    """``depth`` drafts of ``module`` (with the main model's ``embed`` and ``head``) for ``request`` = the pairs
    (hidden [S, ...], tokens, first position) not yet in ``cache`` (``draft_tokens``)."""
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
    """``depth`` greedy drafts after the pairs (hidden [S, ...] = h_i, tokens[s] = t_{i+1}) of positions
    i = position .. position + S - 1: the first predicts the token after tokens[-1], each next one is the
    module applied again to its own last hidden state and draft (one position further on).

    ``step(h [1, S, ...], ids [1, S], first position)``: the module's hidden states of S pairs (appended to
    its cache); ``predict(x [1, 1, ...])``: the logits of one."""
    ids = torch.tensor([tokens], dtype=torch.long, device=hidden.device)
    x = step(hidden[None], ids, position)[:, -1:]
    drafts: list[int] = []
    for n in range(depth):
        drafts.append(int(predict(x).float().argmax()))
        if n + 1 < depth:
            following = torch.tensor([[drafts[-1]]], dtype=torch.long, device=hidden.device)
            x = step(x, following, position + len(tokens) + n)
    return drafts
