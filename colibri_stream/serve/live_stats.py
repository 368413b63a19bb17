"""What /api/stats answers: the expert tiers, recent I/O rates, the requests and the expert heat map.

Everything is measured: tier contents and counters come from the expert store, rates are differences
of the store's counters sampled when /api/stats is asked (the page asks every second), divided by the
measured time between the samples. The JSON (every key always present):

    model, uptime_s
    tiers          [{name: "ram" | "vram", slots, used_slots, slot_bytes, used_bytes, budget_bytes,
                     hits, hit_rate}]           hit_rate: that tier's hits / all expert requests
    experts        {requests, misses, hit_rate, bytes_read, io_wait_s, io_service_s}   since start
    io             {window_s, bytes_read_per_s, reads_per_s, io_wait_fraction, io_service_per_s,
                    hit_rate}   over the last ~WINDOW_S seconds (window_s: the measured span; rates
                    are null until two samples exist); io_wait_fraction = seconds the model thread
                    waited for reads per second of wall time
    counters       {served, cancelled, failed, rejected}
    queue          {slots, busy, queued}
    active         [{prompt_tokens, generated_tokens, max_tokens, session, decode_tok_per_s}]
                   session: null for a request of another API key than the caller's
    decode_tok_per_s   the active requests' decode rates summed
    heat           [[count per routed expert] per MoE layer]: requests routed to each expert since start
    heat_layers    [model layer of each heat row]
    resident       {ram: [[expert ids] per MoE layer], vram: [...], pinned: [...]} in heat-row order;
                   pinned = the learned hot store (--policy pinned), never evicted once resident
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from storage.tiers.stats import StoreStats, TierView

WINDOW_S = 5.0  # rates cover about this much recent time
MAX_SAMPLES = 256  # bounds memory however often clients poll


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic()
    stats: StoreStats


class RateWindow:
    """Counter samples over the last ``window_s`` seconds (plus the newest older one, the base of the
    rates). When nobody asked for a while the base is older and ``window_s`` in the answer says so."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self.samples: deque[Sample] = deque(maxlen=MAX_SAMPLES)
        self.lock = threading.Lock()

    def rates(self, stats: StoreStats) -> dict[str, float | None]:
        with self.lock:
            now = Sample(self.clock(), stats)
            self.samples.append(now)
            while len(self.samples) > 2 and self.samples[1].at <= now.at - self.window_s:
                self.samples.popleft()
            base = self.samples[0]
        return _rates(base, now)


def _rates(base: Sample, now: Sample) -> dict[str, float | None]:
    span = now.at - base.at
    delta = now.stats.minus(base.stats)
    if span <= 0:
        return {"window_s": 0.0, **dict.fromkeys(RATE_KEYS)}
    hits = delta.hits_ram + delta.hits_vram
    return {
        "window_s": round(span, 3),
        "bytes_read_per_s": round(delta.expert_bytes_read / span, 1),
        "reads_per_s": round(delta.reads / span, 3),
        "io_wait_fraction": round(delta.io_wait_s / span, 4),
        "io_service_per_s": round(delta.io_service_s / span, 4),
        "hit_rate": _ratio(hits, delta.requests),
    }


RATE_KEYS = ("bytes_read_per_s", "reads_per_s", "io_wait_fraction", "io_service_per_s", "hit_rate")


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def tier_json(tier: TierView, stats: StoreStats) -> dict[str, Any]:
    hits = stats.hits_vram if tier.name == "vram" else stats.hits_ram
    return {
        "name": tier.name,
        "slots": tier.slots,
        "used_slots": tier.used_slots,
        "slot_bytes": tier.slot_bytes,
        "used_bytes": tier.used_slots * tier.slot_bytes,
        "budget_bytes": tier.budget_bytes,
        "hits": hits,
        "hit_rate": _ratio(hits, stats.requests),
    }


def experts_json(stats: StoreStats) -> dict[str, Any]:
    return {
        "requests": stats.requests,
        "misses": stats.misses,
        "hit_rate": _ratio(stats.hits_ram + stats.hits_vram, stats.requests),
        "bytes_read": stats.expert_bytes_read,
        "io_wait_s": round(stats.io_wait_s, 6),
        "io_service_s": round(stats.io_service_s, 6),
    }


def per_layer(keys: Iterable[tuple[int, int]], layers: tuple[int, ...]) -> list[list[int]]:
    """(layer, expert) keys -> one sorted list of expert ids per heat row."""
    rows: dict[int, list[int]] = {layer: [] for layer in layers}
    for layer, expert in keys:
        if layer in rows:
            rows[layer].append(expert)
    return [sorted(rows[layer]) for layer in layers]


def residency_json(tiers: list[TierView], layers: tuple[int, ...]) -> dict[str, list[list[int]]]:
    by_name = {tier.name: tier for tier in tiers}
    ram, vram = by_name.get("ram"), by_name.get("vram")
    pinned = frozenset().union(*(tier.pinned for tier in tiers))
    return {
        "ram": per_layer(ram.resident if ram else (), layers),
        "vram": per_layer(vram.resident if vram else (), layers),
        "pinned": per_layer(pinned, layers),
    }
