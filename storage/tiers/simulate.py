"""Offline replay of a routing trace through a cache of fixed capacity: each policy's hit rate, and
Belady's MIN (evict the key whose next use is farthest away), the optimum no online policy can beat.

A trace is the sequence of expert keys requested, in order (one entry per routed expert per step).
Keys requested by the same step are not distinguished here; the live store pins them together.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

from storage.tiers.policy import ram_policy
from storage.tiers.tier import SlotTier
from storage.tiers.trace import read_acquires as stream_acquires


def replay(
    trace: Sequence[Hashable],
    capacity: int,
    policy: str,
    hot: frozenset[Hashable] = frozenset(),
    count_from: int = 0,
    uses_per_token: int = 1,
) -> int:
    """Hits of ``policy`` (frequent | lru | hybrid) over ``trace`` with ``capacity`` slots; ``hot`` keys
    never leave. Requests before ``count_from`` warm the cache without being counted (e.g. the prompt's).
    ``uses_per_token`` (MoE layers x top-k) sets ``frequent``'s half-life as the live store's."""
    tier = SlotTier("sim", capacity, ram_policy(policy, uses_per_token), hot=hot)
    hits = 0
    for now, key in enumerate(trace):
        if tier.lookup(key) is not None:
            hits += now >= count_from
        elif tier.allocate(key) is None:
            raise ValueError(f"capacity {capacity} is all hot keys; nothing can be cached")
    return hits


def belady_hits(trace: Sequence[Hashable], capacity: int, count_from: int = 0) -> int:
    """Hits of the offline optimum (MIN): on a miss with the cache full, evict the cached key whose
    next use is farthest away. A max-heap of next uses with stale entries skipped: O(n log n).
    Hits before ``count_from`` are not counted (as in ``replay``)."""
    if capacity <= 0:
        return 0
    never = float("inf")
    next_use: list[float] = [never] * len(trace)
    seen_at: dict[Hashable, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        next_use[i] = seen_at.get(trace[i], never)
        seen_at[trace[i]] = i
    cached: dict[Hashable, float] = {}  # key -> its next use
    heap: list[tuple[float, int, Hashable]] = []  # (-next use, tie-break, key); may hold stale entries
    hits = 0
    for now, key in enumerate(trace):
        if key in cached:
            hits += now >= count_from
        elif len(cached) >= capacity:
            while True:
                negated, _, victim = heapq.heappop(heap)
                if cached.get(victim) == -negated:
                    break
            del cached[victim]
        cached[key] = next_use[now]
        heapq.heappush(heap, (-next_use[now], now, key))
    return hits


def read_acquires(path: str | Path) -> list[tuple[int, list[int]]]:
    """The (layer, experts) acquires of a trace file, in order (a bad line: FormatError naming it)."""
    return list(stream_acquires(path))


def read_trace(path: str | Path) -> list[tuple[int, int]]:
    """The flat key sequence of a trace file."""
    return [(layer, expert) for layer, experts in read_acquires(path) for expert in experts]


def compare_policies(
    trace: Sequence[Hashable],
    capacities: Sequence[int],
    room: int,
    count_from: int = 0,
    learned_from: Sequence[Hashable] | None = None,
    uses_per_token: int = 1,
) -> list[dict[str, Any]]:
    """Hit rates of the frequency policy, LRU, the hybrid, learned pins and Belady, per capacity, over the
    requests from ``count_from`` on. Pins are the most frequent keys of ``learned_from`` (another run's
    trace, as the live store learns from earlier runs; default: this trace itself, an optimistic
    history), leaving ``room`` unpinned slots. ``uses_per_token``: as ``replay``'s."""
    frequency = Counter(trace if learned_from is None else learned_from)
    rows = []
    for capacity in capacities:
        hot = frozenset(key for key, _ in frequency.most_common(max(0, capacity - room)))
        hits = {
            "frequent": replay(trace, capacity, "frequent", count_from=count_from, uses_per_token=uses_per_token),
            "lru": replay(trace, capacity, "lru", count_from=count_from),
            "hybrid": replay(trace, capacity, "hybrid", count_from=count_from),
            "pinned": replay(trace, capacity, "lru", hot=hot, count_from=count_from),
            "belady": belady_hits(trace, capacity, count_from),
        }
        counted = max(1, len(trace) - count_from)
        rows.append({"capacity": capacity, **{k: round(v / counted, 4) for k, v in hits.items()}})
    return rows
