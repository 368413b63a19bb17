"""Counters the tiered store measures (never estimates) while it serves experts."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class DeviceStats:
    """One device (part directory) of a spread container: what its reads did since the store opened,
    measured. Kept apart from StoreStats, whose fields are all scalars (the worker wire sends them as a
    tensor)."""

    device: str  # the part directory
    reads: int = 0
    bytes: int = 0
    busy_s: float = 0.0  # wall time with at least one read of this device in flight
    service_s: float = 0.0  # summed duration of its reads (across its I/O threads)
    fallbacks: int = 0  # copies here that failed their checksum or read; served from another copy

    def minus(self, earlier: DeviceStats) -> DeviceStats:
        return DeviceStats(
            self.device,
            self.reads - earlier.reads,
            self.bytes - earlier.bytes,
            self.busy_s - earlier.busy_s,
            self.service_s - earlier.service_s,
            self.fallbacks - earlier.fallbacks,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "reads": self.reads,
            "bytes_read": self.bytes,
            "busy_s": round(self.busy_s, 6),
            "mb_per_s": round(self.bytes / self.busy_s / 1e6, 1) if self.busy_s > 0 else None,
            "fallbacks": self.fallbacks,
        }


@dataclass
class StoreStats:
    requests: int = 0  # expert requests (one per routed expert per acquire)
    hits_ram: int = 0
    hits_vram: int = 0
    misses: int = 0  # requests that had to be read from disk
    reads: int = 0  # completed disk reads (misses + prefetches)
    expert_bytes_read: int = 0
    io_wait_s: float = 0.0  # compute thread blocked waiting for reads
    io_service_s: float = 0.0  # summed duration of the reads themselves (across I/O threads)
    prefetch_issued: int = 0
    prefetch_useful: int = 0  # prefetched experts later acquired
    prefetch_wasted: int = 0  # prefetched experts evicted before any use
    prefetch_cancelled: int = 0  # guesses dropped before their read started (a newer guess or the router said no)
    recall_hits: int = 0  # acquired experts that a prefetch guess had predicted
    recall_total: int = 0  # acquired experts in layers with a prediction

    def add(self, **deltas: float) -> None:
        for name, delta in deltas.items():  # reflection: counters named by the caller
            setattr(self, name, getattr(self, name) + delta)

    def minus(self, earlier: StoreStats) -> StoreStats:
        """The counts accumulated since ``earlier`` (a snapshot of this object), e.g. decode only. Taken every
        decode step while drafting (runtime/speculation.py): field by field, not through ``asdict``'s deep
        copies (2 us against 30 us a call; the demo's whole step is ~0.6 ms)."""
        # reflection: every counter alike, by the dataclass's own field list
        return StoreStats(*(getattr(self, name) - getattr(earlier, name) for name in _COUNTERS))

    @property
    def prefetch_recall(self) -> float | None:
        return self.recall_hits / self.recall_total if self.recall_total else None

    def as_dict(self) -> dict[str, Any]:
        raw = asdict(self)
        return {
            "expert_requests": raw["requests"],
            "hits": {"ram": raw["hits_ram"], "vram": raw["hits_vram"]},
            "misses": raw["misses"],
            "reads": raw["reads"],
            "expert_bytes_read": raw["expert_bytes_read"],
            "io_wait_s": round(raw["io_wait_s"], 6),
            "io_service_s": round(raw["io_service_s"], 6),
            "prefetch": {
                "issued": raw["prefetch_issued"],
                "useful": raw["prefetch_useful"],
                "wasted": raw["prefetch_wasted"],
                "cancelled": raw["prefetch_cancelled"],
            },
            "prefetch_recall": None if self.prefetch_recall is None else round(self.prefetch_recall, 4),
        }


_COUNTERS = tuple(counter.name for counter in fields(StoreStats))


class RoutingCounts:
    """Requests per (MoE layer, routed expert) since the store opened — what the dashboard's heat map
    draws. Unlike the usage history it starts at zero and is never persisted."""

    def __init__(self, layers: Sequence[int], n_experts: int):
        self.layers = tuple(layers)  # the model layer of each row
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        # Written by the model thread, read by the server: a read sees each count old or new, never torn.
        self._counts = [[0] * n_experts for _ in self.layers]

    def record(self, layer: int, expert_ids: Iterable[int]) -> None:
        row = self._counts[self._row[layer]]
        for expert in expert_ids:
            row[expert] += 1

    def table(self) -> list[list[int]]:
        """One list per MoE layer (in ``layers`` order), one count per routed expert."""
        return [list(row) for row in self._counts]


Key = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class TierView:
    """What one tier holds right now: its slots, the experts in them, the learned hot store's pins."""

    name: str  # "ram" | "vram"
    slots: int
    slot_bytes: int
    budget_bytes: int  # what the user granted (slots * slot_bytes <= budget_bytes)
    resident: frozenset[Key]  # experts occupying a slot (a read in flight included)
    pinned: frozenset[Key] = frozenset()  # never evicted once resident (``--policy pinned``)

    @property
    def used_slots(self) -> int:
        return len(self.resident)
