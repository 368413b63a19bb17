"""The ExpertStore protocol: what the library asks of whoever holds the routed experts.

The engine needs only an ExpertProvider (acquire / release / prefetch). A run also measures and
persists: ``snapshot`` (the counters now, StoreStats), ``report`` (them as the stats schema's
expert keys), ``end_turn`` (persist the usage history, flush the trace) and ``close``. Two
implementations: storage's TieredExpertStore (experts streamed from a container) and
``ResidentStore`` below (every expert in memory: each request is a RAM hit, nothing is read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from engine.experts import Expert, ExpertProvider, ResidentExperts
from storage.stats import StoreStats
from storage.trace import TraceWriter


@runtime_checkable
class ExpertStore(ExpertProvider, Protocol):
    def snapshot(self) -> StoreStats: ...

    def report(self) -> dict[str, Any]: ...

    def end_turn(self) -> None: ...

    def close(self) -> None: ...


class ResidentStore(ResidentExperts):
    """Resident experts that count their requests (all RAM hits) and write the routing trace."""

    def __init__(self, experts: Mapping[int, Mapping[int, Expert]], trace: TraceWriter | None = None):
        super().__init__(experts)
        self.stats = StoreStats()
        self.trace = trace

    def acquire(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, Expert]:
        chosen = super().acquire(layer, expert_ids)
        self.stats.add(requests=len(expert_ids), hits_ram=len(expert_ids))
        if self.trace is not None:
            self.trace.write(layer, expert_ids)
        return chosen

    def snapshot(self) -> StoreStats:
        return replace(self.stats)

    def report(self) -> dict[str, Any]:
        return {**self.snapshot().as_dict(), "store": "resident", "direct_io": False}

    def end_turn(self) -> None:
        if self.trace is not None:
            self.trace.flush()

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
