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
"""

from __future__ import annotations

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


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "hybrid": HybridPolicy}
# What a user may choose (--policy, [cache] policy): "pinned" is LRU plus the learned hot store.
POLICY_NAMES = ("lru", "hybrid", "pinned")
