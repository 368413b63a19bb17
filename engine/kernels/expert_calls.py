"""What the one-call expert kernels (q8_experts.py, nibble_experts.py) share: a layer's experts as one
table of addresses, and a prompt's routed rows cut into calls whose work area stays bounded."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TypeVar

import torch

L = TypeVar("L")


def common_table(plans: Sequence[tuple[L, tuple[int, ...]] | None]) -> tuple[L, array[int]] | None:
    """Plans (layout, six addresses) -> (the shared layout, addresses [n, 6] flat); None unless all share one."""
    first = plans[0] if plans else None
    if first is None or any(plan is None or plan[0] != first[0] for plan in plans):
        return None
    return first[0], array("Q", [p for plan in plans for p in plan[1]])  # type: ignore[index]  # none is None


def parts_within(ids: torch.Tensor, expert_ids: list[int], row_bytes: int, most: int) -> list[list[int]]:
    """Indices into expert_ids in consecutive parts whose routed rows at ``row_bytes`` each fit ``most`` bytes."""
    if ids.shape[0] * ids.shape[1] * row_bytes <= most:
        return [list(range(len(expert_ids)))]
    counts = torch.bincount(ids.flatten().clamp(min=0)).tolist()
    parts: list[list[int]] = []
    part: list[int] = []
    rows = 0
    for i, expert_id in enumerate(expert_ids):
        n = counts[expert_id] if expert_id < len(counts) else 0
        if part and (rows + n) * row_bytes > most:
            parts.append(part)
            part, rows = [], 0
        part.append(i)
        rows += n
    return [*parts, part]
