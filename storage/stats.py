"""Counters the tiered store measures (never estimates) while it serves experts."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


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
    recall_hits: int = 0  # acquired experts that the lookahead had predicted
    recall_total: int = 0  # acquired experts in layers with a prediction

    def add(self, **deltas: float) -> None:
        for name, delta in deltas.items():
            setattr(self, name, getattr(self, name) + delta)

    def minus(self, earlier: StoreStats) -> StoreStats:
        """The counts accumulated since ``earlier`` (a snapshot of this object), e.g. decode only."""
        return replace(self, **{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    @property
    def prefetch_recall(self) -> float | None:
        return self.recall_hits / self.recall_total if self.recall_total else None

    def as_dict(self) -> dict[str, Any]:
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
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
            },
            "prefetch_recall": None if self.prefetch_recall is None else round(self.prefetch_recall, 4),
        }
