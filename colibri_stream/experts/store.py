"""The ExpertStore: what the library asks of whoever holds the routed experts.

The engine needs only an expert source (engine/core/sources.py): a local one (acquire / release /
prefetch / lookahead) or a remote one (its routed_sum). A run also measures and persists (``StoreReports``):
``snapshot`` (the counters now, StoreStats), ``report`` (them as the stats schema's expert keys),
``routed`` (requests per (layer, expert) since start, RoutingCounts), ``tiers`` (what each tier holds
now, for the dashboard), ``end_turn`` (persist the usage history, flush the trace) and ``close``. Local
stores: storage's TieredExpertStore (experts streamed from a container) and ``ResidentStore`` below
(every expert in memory: each request is a RAM hit, nothing is read); the remote one:
experts/cluster's DistributedExperts (experts in worker processes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from engine.core.sources import Expert, ExpertSource, HeldExperts, RemoteExperts, ResidentExperts
from storage.tiers.stats import RoutingCounts, StoreStats, TierView
from storage.tiers.trace import TraceWriter


class StoreReports(Protocol):
    routed: RoutingCounts

    def snapshot(self) -> StoreStats: ...

    def tiers(self) -> list[TierView]: ...

    def report(self) -> dict[str, Any]: ...

    def end_turn(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class LocalExpertStore(ExpertSource, StoreReports, Protocol):
    """A local expert source that reports (TieredExpertStore satisfies it structurally, ResidentStore)."""


@runtime_checkable
class RemoteExpertStore(RemoteExperts, StoreReports, Protocol):
    """A remote expert source that reports (DistributedExperts)."""


ExpertStore = LocalExpertStore | RemoteExpertStore


class ResidentStore(ResidentExperts):
    """Resident experts that count their requests (all RAM hits) and write the routing trace."""

    def __init__(self, experts: Mapping[int, Mapping[int, Expert]], trace: TraceWriter | None = None):
        super().__init__(experts)
        self.stats = StoreStats()
        self.trace = trace
        layers = sorted(experts)
        n_experts = len(experts[layers[0]]) if layers else 0
        self.routed = RoutingCounts(layers, n_experts)
        self._keys = frozenset((layer, e) for layer in layers for e in experts[layer])
        self._expert_bytes = _tensor_bytes(experts[layers[0]][0]) if layers else 0

    def acquire(self, layer: int, expert_ids: Sequence[int]) -> HeldExperts:
        chosen = super().acquire(layer, expert_ids)
        self._count(layer, expert_ids)
        return chosen

    def count_resident(self, used: Mapping[int, Sequence[int]]) -> None:
        """A step's experts used without acquire (engine/mla/fused_decode.py), counted as ``acquire`` counts them."""
        for layer, expert_ids in used.items():
            self._count(layer, expert_ids)

    def _count(self, layer: int, expert_ids: Sequence[int]) -> None:
        self.stats.add(requests=len(expert_ids), hits_ram=len(expert_ids))
        self.routed.record(layer, expert_ids)
        if self.trace is not None:
            self.trace.write(layer, expert_ids)

    def snapshot(self) -> StoreStats:
        return replace(self.stats)

    def tiers(self) -> list[TierView]:
        """One RAM tier holding every expert: as many slots as experts, all used, none pinned."""
        n, size = len(self._keys), self._expert_bytes
        return [TierView("ram", n, size, n * size, self._keys)]

    def report(self) -> dict[str, Any]:
        return {**self.snapshot().as_dict(), "store": "resident", "direct_io": False, "page_cache_bypass": "none"}

    def end_turn(self) -> None:
        if self.trace is not None:
            self.trace.flush()

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


def _tensor_bytes(expert: Expert) -> int:
    """The bytes of an expert's weight arrays."""
    return sum(tensor.nbytes for tensor in expert.tensors())
