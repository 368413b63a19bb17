"""One tier of expert slots (RAM or VRAM) under a byte budget: a few verbs over a fixed slot pool.

Slots are preallocated once; an expert occupies one slot. ``allocate`` returns None when the tier is
full of experts that may not leave (in use by the current step, still being read, or pinned by the
learned hot store) — "full" is an answer, not an exception. Which evictable expert leaves is the
policy's choice. A prefetch guess whose layer the router has not reached yet is ``awaited``: only a
demand read may take its slot, and only when nothing else may leave.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

from storage.tiers.policy import EvictionPolicy

Key = Hashable


@dataclass
class Entry:
    slot: int
    pins: int = 0  # users in the current step; a pinned entry is never evicted
    loading: Future[None] | None = None  # in-flight read into the slot (None once observed complete)
    prefetched: bool = False  # brought in by a prefetch guess and not yet used
    # a guess whose layer the router has not reached: under a frequency policy a guess has few uses so
    # far and would otherwise be the next victim, before the use it was read for
    awaited: bool = False

    @property
    def reading(self) -> bool:
        """A read into the slot is still in flight."""
        return self.loading is not None and not self.loading.done()

    @property
    def busy(self) -> bool:
        return self.pins > 0 or self.reading


@dataclass
class SlotTier:
    name: str
    n_slots: int
    policy: EvictionPolicy
    hot: frozenset[Key] = frozenset()  # learned hot store: never evicted once resident
    entries: dict[Key, Entry] = field(default_factory=dict)
    evicted_unused_prefetches: int = 0

    def __post_init__(self) -> None:
        self._free = list(range(self.n_slots - 1, -1, -1))

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def lookup(self, key: Key) -> Entry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.policy.accessed(key)
        return entry

    def evictable(self, key: Key) -> bool:
        return self._may_leave(key) and not self.entries[key].awaited

    def _may_leave(self, key: Key) -> bool:
        return key not in self.hot and not self.entries[key].busy

    def allocate(self, key: Key, demand: bool = True) -> Entry | None:
        """A slot for ``key`` (evicting if needed), or None if the tier is full of busy or hot experts. A
        ``demand`` allocation (a step needs the expert) may evict an awaited guess when nothing else may
        leave; a prefetch never does."""
        if key in self.entries:
            raise KeyError(f"{key} already has a slot in the {self.name} tier")
        if not self._free:
            victim = self.policy.victim(self.evictable)
            if victim is None and demand:
                victim = self.policy.victim(self._may_leave)
            if victim is None:
                return None
            self.remove(victim)
        entry = Entry(self._free.pop())
        self.entries[key] = entry
        self.policy.inserted(key)
        return entry

    def remove(self, key: Key) -> None:
        entry = self.entries.pop(key)
        if entry.prefetched:
            self.evicted_unused_prefetches += 1
        self.policy.removed(key)
        self._free.append(entry.slot)

    def unpin(self, keys: Iterable[Key]) -> None:
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def loading(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.reading]
