"""The coordinator's view of each worker: its link, what it said when it joined, its counters, and its
life: serving -> lost (a failover) -> rejoined (started again with the same flags) -> lost ...

A worker's counters restart from zero when it rejoins (a new process); what its earlier incarnations
counted is kept in ``base`` so every total the coordinator reports only grows (the runtime's per-turn
stats are differences of two snapshots).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.transport import Link
from colibri_stream.experts.cluster.wire import Hello, Op, WorkerError
from storage.tiers.stats import StoreStats

SERVING, LOST, REJOINED = "serving", "lost", "rejoined"


class ShareRefused(WorkerError):
    """A worker that answered its SETUP but cannot take its share (its budget, its history file)."""


@dataclass
class Member:
    hello: Hello
    link: Link | None
    stats: StoreStats = field(default_factory=StoreStats)  # this incarnation's, as last fetched
    base: StoreStats = field(default_factory=StoreStats)  # earlier incarnations' counters
    ram_slots: int = 0
    experts_held: int = 0
    state: str = SERVING
    failovers: int = 0  # times it was lost
    lost_s: float = 0.0  # seconds it was lost, summed (the current loss too, in ``seconds_lost``)
    lost_since: float | None = None  # monotonic time of the current loss
    last_loss: str = ""  # why it was lost last

    @property
    def serving(self) -> bool:
        return self.link is not None

    def lose(self, error: WorkerError) -> Link | None:
        """Mark it lost (once per loss); -> its link, to close, or None when it was lost already."""
        link, self.link = self.link, None
        if link is None:
            return None
        self.state, self.failovers, self.last_loss = LOST, self.failovers + 1, str(error)
        self.lost_since = time.monotonic()
        return link

    def rejoin(self, hello: Hello, link: Link) -> float:
        """The worker is back (a new process, same rank) -> seconds it was lost."""
        gone = self.seconds_lost_now()
        self.lost_s += gone
        self.lost_since = None
        self.base = self.total()
        self.stats = StoreStats()
        self.hello, self.link, self.state = hello, link, REJOINED
        return gone

    def seconds_lost_now(self) -> float:
        return 0.0 if self.lost_since is None else time.monotonic() - self.lost_since

    def total(self) -> StoreStats:
        out = replace(self.base)
        out.add(**vars(self.stats))
        return out

    def as_dict(self) -> dict[str, Any]:
        s = self.total()
        return {
            "rank": self.hello.rank,
            "host": self.hello.host,
            "pid": self.hello.pid,
            "state": self.state,
            "failovers": self.failovers,
            "seconds_lost": round(self.lost_s + self.seconds_lost_now(), 3),
            "last_loss": self.last_loss or None,
            "experts_held": self.experts_held,
            "ram_slots": self.ram_slots,
            "disk_bytes_per_s": self.hello.disk_bytes_per_s or None,
            "requests": s.requests,
            "requests_this_process": self.stats.requests,  # since it (re)joined
            "hits": s.hits_ram + s.hits_vram,
            "misses": s.misses,
            "expert_bytes_read": s.expert_bytes_read,
            "io_wait_s": round(s.io_wait_s, 6),
            "prefetch_issued": s.prefetch_issued,
        }


def set_up(link: Link, hello: Hello, held: bytes, timeout_s: float) -> None:
    """Hand a worker the experts it holds (uint8 [MoE layers, experts]) and wait for READY."""
    send_setup(link, hello, held, timeout_s)
    wait_ready(link, hello, timeout_s)


def send_setup(link: Link, hello: Hello, held: bytes, timeout_s: float) -> None:
    link.send(Op.SETUP, [held], (hello.rank,), timeout_s)


def wait_ready(link: Link, hello: Hello, timeout_s: float) -> None:
    """READY from a worker that was sent SETUP; one that cannot take its share (its budget, its history
    file) is a WorkerError saying why."""
    head, payload = link.receive(timeout_s, "setting up", wire.MAX_TEXT_BYTES)
    if head.op != Op.READY:
        raise ShareRefused(f"{hello.name()}, setting up: answered {head.op.name}, not READY")
    if payload:
        raise ShareRefused(f"{hello.name()} cannot take its share: {payload.decode(errors='replace')}")


def refuse(link: Link, why: str) -> None:
    """Tell a worker it is not wanted (it exits 1 saying ``why``) and close its link."""
    try:
        link.send(Op.REFUSE, [why.encode()], (), 5.0)
    except WorkerError:
        pass  # gone already: nothing to tell
    link.close()
