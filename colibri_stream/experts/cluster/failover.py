"""The coordinator's own store: the experts of lost workers, served from the coordinator's container.

Opened at the first loss (a run where no worker is lost never pays for it), with the lost worker's RAM
budget (no more than the coordinator's store budget, no less than one token's experts), no VRAM tier
and no preload: it serves a share only until its worker rejoins. It computes with the engine's own
routed_sum on the coordinator's CPU, on the same rows, gate weights and contexts the worker was sent,
so its part of the sum is the same float64 terms the worker would have returned: the tokens do not
change when a worker is lost, only the time they take.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from colibri_stream.experts.codec import expert_from_record
from engine.core.moe import routed_sum
from engine.kernels.rows import torch_on_one_thread
from storage.container.reader import Container
from storage.tiers.config import StoreConfig
from storage.tiers.stats import StoreStats
from storage.tiers.tiered import TieredExpertStore, minimum_slots


class Fallback:
    """A TieredExpertStore over the coordinator's container, opened on first use."""

    def __init__(self, container: Container, config: StoreConfig, limit: float | None):
        self.container = container
        self.config = config
        self.limit = limit  # the family's swiglu clamp, as a worker applies it
        self.store: TieredExpertStore | None = None
        self._lock = threading.Lock()

    def open(self, ram_bytes: int) -> TieredExpertStore:
        """The store (opened now with ``ram_bytes`` of RAM if it is not open yet)."""
        with self._lock:
            if self.store is None:
                record = self.container.layout.record_bytes
                ram = max(minimum_slots(self.container) * record, min(ram_bytes, self.config.ram_bytes))
                config = replace(self.config, ram_bytes=ram, vram_bytes=0, preload=False, history_path=None)
                layout = self.container.layout
                self.store = TieredExpertStore(self.container, config, lambda r: expert_from_record(layout, r))
            return self.store

    def routed_sum(
        self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: list[int], ram_bytes: int
    ) -> torch.Tensor:
        """float64 [N, dim]: the part of ``layer``'s routed sum over ``experts`` (x on the CPU)."""
        store = self.open(ram_bytes)
        wanted = set(experts)
        with torch_on_one_thread():
            total, _ = routed_sum(x, weights, ids, store, layer, self.limit, owned=wanted.__contains__)
        return total

    def prefetch(self, layer: int, expert_ids: list[int]) -> None:
        if self.store is not None and expert_ids:
            self.store.prefetch(layer, expert_ids)

    def snapshot(self) -> StoreStats:
        return self.store.snapshot() if self.store is not None else StoreStats()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
