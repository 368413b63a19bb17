"""Eviction policies: which resident expert gives up its slot.

A policy only orders keys; the tier decides what may be evicted (never an expert in use, in flight,
or pinned by the learned hot store) and asks the policy for a victim among those. Keys are
(layer, expert) pairs. Every policy sees the same three events: ``inserted``, ``accessed``,
``removed``.

- ``LRUPolicy``: least recently used goes first (the baseline; Colibrì and mixtral-offloading use it).
- ``HybridPolicy``: frequency with recency decay. Each access adds 1 to an expert's score, and all
  scores halve every ``half_life`` accesses, so an expert used often a while ago can lose to one used
  a few times just now; ties go to the least recently used. It resists the scans LRU suffers from
  (a prefill touching every expert once pushes out the hot set).
- ``FrequentPolicy``: the RAM tier's default (``frequent``) and the VRAM tier's. Fewest uses goes
  first, ties to the most recently used, and the counts outlive eviction. See its docstring.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol

Key = Hashable


class EvictionPolicy(Protocol):
    def inserted(self, key: Key) -> None: ...

    def accessed(self, key: Key) -> None: ...

    def removed(self, key: Key) -> None: ...

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        """The key to evict among those ``evictable`` accepts, or None if there is none."""
        ...


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def inserted(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def accessed(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        return next((key for key in self._order if evictable(key)), None)


class HybridPolicy:
    def __init__(self, half_life: int = 256) -> None:
        self.half_life = half_life
        self._score: dict[Key, float] = {}
        self._last: dict[Key, int] = {}
        self._clock = 0

    def _tick(self) -> None:
        self._clock += 1
        if self._clock % self.half_life == 0:
            for key in self._score:
                self._score[key] /= 2

    def inserted(self, key: Key) -> None:
        self._score.setdefault(key, 0.0)
        self.accessed(key)

    def accessed(self, key: Key) -> None:
        if key not in self._score:
            return
        self._tick()
        self._score[key] += 1.0
        self._last[key] = self._clock

    def removed(self, key: Key) -> None:
        # The score is forgotten with the slot: re-admission starts cold, as in LFU with aging.
        self._score.pop(key, None)
        self._last.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        candidates: Iterable[Key] = (key for key in self._score if evictable(key))
        return min(candidates, key=lambda k: (self._score[k], self._last[k]), default=None)


class FrequentPolicy:
    """The most-used experts stay; the others take turns in the least-used slots.

    Made for the VRAM tier, which stages every expert it computes: where a token's experts outnumber the
    slots, LRU evicts each one before its next use (a cycle longer than the tier: no hit, ever). The RAM
    tier meets the same cycle at every budget below the experts: a layer's experts come back once per
    token, after every other layer's, so recency says little and how often an expert is routed says
    more (replayed traces: ``RAM_HALF_LIFE_TOKENS``). Here the
    victim is the key with the fewest uses, ties going to the most recently used, so the keys already in
    stay and a stream of newcomers churns through the same few slots. Counts outlive eviction (an expert
    that keeps coming back earns a slot) and halve every ``half_life`` uses, so the set follows a router
    that shifts. A lazy heap keeps ``victim`` O(log n): a real VRAM tier holds about a thousand experts.
    """

    def __init__(self, half_life: int = 4096) -> None:
        self.half_life = half_life
        self._uses: dict[Key, float] = {}  # every key seen, in the tier or not
        self._stamp: dict[Key, int] = {}  # keys in the tier: the clock at their last use
        self._heap: list[tuple[float, int, Key]] = []  # (uses, -stamp, key); stale once the stamp moved
        self._clock = 0

    def _use(self, key: Key) -> None:
        self._clock += 1
        if self._clock % self.half_life == 0:
            self._halve()
        self._uses[key] = self._uses.get(key, 0.0) + 1.0
        self._stamp[key] = self._clock
        heapq.heappush(self._heap, (self._uses[key], -self._clock, key))

    def _halve(self) -> None:
        for key in self._uses:
            self._uses[key] /= 2
        self._heap = [(self._uses[key], -stamp, key) for key, stamp in self._stamp.items()]
        heapq.heapify(self._heap)

    def inserted(self, key: Key) -> None:
        self._use(key)

    def accessed(self, key: Key) -> None:
        if key in self._stamp:
            self._use(key)

    def removed(self, key: Key) -> None:
        self._stamp.pop(key, None)  # its heap entries go stale; its count stays

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        busy = []  # current entries that may not leave now: back on the heap afterwards
        try:
            while self._heap:
                _, neg_stamp, key = self._heap[0]
                if self._stamp.get(key) != -neg_stamp:
                    heapq.heappop(self._heap)  # evicted, or used again since this entry
                elif evictable(key):
                    return key
                else:
                    busy.append(heapq.heappop(self._heap))
            return None
        finally:
            for entry in busy:
                heapq.heappush(self._heap, entry)


# What a user may choose (--policy, [cache] policy), the default first: "pinned" is LRU plus the learned
# hot store.
POLICY_NAMES = ("frequent", "lru", "hybrid", "pinned")
DEFAULT_POLICY = POLICY_NAMES[0]

# The RAM tier's ``frequent`` counts halve every this many tokens' worth of routed uses (MoE layers x
# top-k): long enough to tell a hot expert from a cold one, short enough to follow a conversation that
# moves on. Decode traces of 300 tokens replayed (storage/tiers/simulate.py), half-lives of 16 / 32 / 64 / 256
# tokens: the bench's stress model (random router) at 25% of its experts hit 36.4 / 38.4 / 39.5 / 39.7%
# (LRU 28.2%); the trained demo model at 12 of its 96 records 67.7 / 67.7 / 67.3 / 66.5% (LRU 49.0%), at 24
# 91.2 / 91.3 / 91.1 / 90.7% (LRU 86.7%).
RAM_HALF_LIFE_TOKENS = 32


def ram_policy(name: str, uses_per_token: int, half_life_tokens: int = RAM_HALF_LIFE_TOKENS) -> EvictionPolicy:
    """The RAM tier's eviction policy for a user's choice (``POLICY_NAMES``); ``pinned`` is LRU over the
    slots its pins leave. ``uses_per_token``: routed experts a token asks for (MoE layers x top-k)."""
    if name == "frequent":
        return FrequentPolicy(half_life_tokens * max(1, uses_per_token))
    if name == "hybrid":
        return HybridPolicy()
    return LRUPolicy()
