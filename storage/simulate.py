"""Offline replay of a routing trace through a cache of fixed capacity: each policy's hit rate, and
Belady's MIN (evict the key whose next use is farthest away), the optimum no online policy can beat.

A trace is the sequence of expert keys requested, in order (one entry per routed expert per step).
Keys requested by the same step are not distinguished here; the live store pins them together.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Hashable, Sequence

from storage.policy import POLICIES
from storage.tier import SlotTier


def replay(trace: Sequence[Hashable], capacity: int, policy: str = "lru", hot: frozenset = frozenset()) -> int:
    """Hits of ``policy`` (lru | hybrid) over ``trace`` with ``capacity`` slots; ``hot`` keys never leave."""
    tier = SlotTier("sim", capacity, POLICIES[policy](), hot=hot)
    hits = 0
    for key in trace:
        if tier.lookup(key) is not None:
            hits += 1
        elif tier.allocate(key) is None:
            raise ValueError(f"capacity {capacity} is all hot keys; nothing can be cached")
    return hits


def belady_hits(trace: Sequence[Hashable], capacity: int) -> int:
    """Hits of the offline optimum (MIN)."""
    uses: dict[Hashable, list[int]] = defaultdict(list)
    for i, key in enumerate(trace):
        uses[key].append(i)

    def next_use(key: Hashable, now: int) -> float:
        positions = uses[key]
        j = bisect.bisect_right(positions, now)
        return positions[j] if j < len(positions) else float("inf")

    cached: set[Hashable] = set()
    hits = 0
    for now, key in enumerate(trace):
        if key in cached:
            hits += 1
            continue
        if len(cached) >= capacity:
            cached.remove(max(cached, key=lambda k: next_use(k, now)))
        cached.add(key)
    return hits
