"""Offline replay of a routing trace through a cache of fixed capacity: each policy's hit rate, and
Belady's MIN (evict the key whose next use is farthest away), the optimum no online policy can beat.

A trace is the sequence of expert keys requested, in order (one entry per routed expert per step).
Keys requested by the same step are not distinguished here; the live store pins them together.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from pathlib import Path

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


def write_trace(path: str | Path, acquires: Sequence[tuple[int, Sequence[int]]]) -> None:
    """One JSON line per acquire: {"layer": L, "experts": [...]}."""
    with open(path, "w") as f:
        for layer, experts in acquires:
            f.write(json.dumps({"layer": layer, "experts": list(experts)}) + "\n")


def read_trace(path: str | Path) -> list[tuple[int, int]]:
    """The flat key sequence of a trace file."""
    keys = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            record = json.loads(line)
            keys.extend((int(record["layer"]), int(e)) for e in record["experts"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{path}:{number}: not a trace line ({line[:60]!r})") from None
    return keys


def compare_policies(trace: Sequence[Hashable], capacities: Sequence[int], room: int) -> list[dict]:
    """Hit rates of LRU, the hybrid, learned pins (the trace's own most frequent keys, leaving ``room``
    unpinned slots, i.e. pins learned from a history equal to this trace) and Belady, per capacity."""
    frequency = Counter(trace)
    rows = []
    for capacity in capacities:
        hot = frozenset(key for key, _ in frequency.most_common(max(0, capacity - room)))
        hits = {
            "lru": replay(trace, capacity, "lru"),
            "hybrid": replay(trace, capacity, "hybrid"),
            "pinned": replay(trace, capacity, "lru", hot=hot),
            "belady": belady_hits(trace, capacity),
        }
        rows.append({"capacity": capacity, **{k: round(v / len(trace), 4) for k, v in hits.items()}})
    return rows
