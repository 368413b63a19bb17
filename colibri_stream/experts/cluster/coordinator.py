"""The coordinator's side: a remote expert store (RemoteExpertStore) whose routed experts live in worker processes.

The coordinator keeps the dense part, the KV state and the routers. Per MoE layer it sends each worker
holding one of the routed experts one request (the rows, their expert ids and gate weights, plus the
next layer's prefetch guess for that worker's experts), computes the shared expert while the workers
read and compute, and adds their float64 partial sums: the same exact terms a single process adds
(engine/moe.py RoutedSum), so the tokens are the same whatever the number of workers.

A worker that dies or does not answer within ``timeout_s`` is a WorkerError naming it and the layer;
the coordinator does not carry on without it: after a timed-out receive gloo closes every connection of
the group (measured: "Application timeout caused pair closure"), so no other worker could be reached.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.local import LocalWorkers
from colibri_stream.experts.cluster.wire import Hello, Op, WorkerError
from colibri_stream.experts.store import RemoteExpertStore
from engine.q8 import activations_are_int8
from engine.rows import computing_alone
from storage.container import Container
from storage.stats import RoutingCounts, StoreStats, TierView
from storage.trace import TraceWriter

R = TypeVar("R")


@dataclass
class NetworkStats:
    """What crossed the network, measured at the coordinator."""

    bytes_sent: int = 0
    bytes_received: int = 0
    layer_requests: int = 0  # MoE layer steps that asked at least one worker
    round_trip_s: float = 0.0  # summed over those: first request sent -> last reply received
    wait_s: float = 0.0  # the forward pass blocked on replies (after the shared expert)
    tokens: int = 0  # positions through the first MoE layer: tokens whose activations were sent

    def as_dict(self) -> dict[str, Any]:
        moved = self.bytes_sent + self.bytes_received
        requests = self.layer_requests
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "bytes_per_token": round(moved / self.tokens) if self.tokens else None,
            "layer_requests": requests,
            "round_trip_ms_mean": round(1e3 * self.round_trip_s / requests, 4) if requests else None,
            "wait_s": round(self.wait_s, 6),
        }


@dataclass
class WorkerView:
    hello: Hello
    stats: StoreStats
    ram_slots: int = 0
    experts_held: int = 0

    def as_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "rank": self.hello.rank,
            "host": self.hello.host,
            "pid": self.hello.pid,
            "experts_held": self.experts_held,
            "ram_slots": self.ram_slots,
            "disk_bytes_per_s": self.hello.disk_bytes_per_s or None,
            "requests": s.requests,
            "hits": s.hits_ram + s.hits_vram,
            "misses": s.misses,
            "expert_bytes_read": s.expert_bytes_read,
            "io_wait_s": round(s.io_wait_s, 6),
            "prefetch_issued": s.prefetch_issued,
        }


class DistributedExperts(RemoteExpertStore):
    """The routed sums of joined workers (``connect`` forms the group and hands out the shares)."""

    prefetch_layers = 1  # a guess travels with the next request: one layer ahead

    def __init__(
        self,
        container: Container,
        hellos: Sequence[Hello],
        owners: torch.Tensor,
        timeout_s: float,
        prefetch: bool = True,
        local: LocalWorkers | None = None,
        trace: TraceWriter | None = None,
    ):
        self.layers = list(container.moe_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.owners = owners  # [MoE layers, experts] -> rank
        self.record_bytes = container.layout.record_bytes
        self.timeout_s = timeout_s
        self.prefetch_enabled = prefetch
        self.local = local
        self.trace = trace
        self.workers = {h.rank: WorkerView(h, StoreStats()) for h in hellos}
        self.routed = RoutingCounts(self.layers, container.n_experts)
        self.network = NetworkStats()
        self._ahead: dict[int, tuple[int, list[int]]] = {}  # rank -> a prefetch guess not sent yet
        self._lock = threading.Lock()  # one thread at a time sends (a server's dashboard asks for stats)
        self._failed: WorkerError | None = None

    # ------------------------------------------------------------------------------ the MoE layer
    def start_routed_sum(
        self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        """Send the layer's requests; the returned function waits for the replies -> float64 [N, dim]."""
        routed = ids.unique().tolist()
        self.routed.record(layer, routed)
        if self.trace is not None:
            self.trace.write(layer, routed)
        if layer == self.layers[0]:
            self.network.tokens += x.shape[0]
        x_cpu, started = x.cpu(), time.perf_counter()
        replies, sends = self._request(layer, x_cpu, weights, ids)
        if replies:
            self.network.layer_requests += 1

        def wait() -> torch.Tensor:
            waited = time.perf_counter()
            total = torch.zeros(x_cpu.shape, dtype=torch.float64)
            for rank, work, reply in replies:  # exact float64 partial sums: the order does not matter
                self._wait(work, rank, f"layer {layer}")
                total += reply
                self.network.bytes_received += reply.nbytes
            self._wait_all(sends, f"layer {layer}")
            done = time.perf_counter()
            self.network.wait_s += done - waited
            if replies:
                self.network.round_trip_s += done - started
            return total.to(x.device)

        return wait

    def _request(
        self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[list[tuple[int, dist.Work, torch.Tensor]], list[tuple[int, dist.Work]]]:
        """A SUM request to every worker holding one of ``ids`` (with its part of the prefetch guess), a
        lone PREFETCH to one that holds none but has a guess waiting -> (pending replies, sends)."""
        owners = self.owners[self.row[layer]][ids.cpu()]  # [N, topk] ranks
        flags = (wire.FLAG_ROWS_ALONE if computing_alone() else 0) | (
            wire.FLAG_INT8_ACTIVATIONS if activations_are_int8() else 0
        )
        replies, sends = [], []
        with self._lock:
            self._check()
            for rank in self.workers:
                if bool((owners == rank).any()):
                    reply = torch.empty(x.shape, dtype=torch.float64)
                    sends += self._send_sum(rank, layer, x, weights, ids, flags)
                    replies.append((rank, self._receive(rank, reply, wire.TAG_SUM, f"layer {layer}"), reply))
                elif rank in self._ahead:
                    sends += self._send_prefetch(rank)
        return replies, sends

    def _send_sum(
        self, rank: int, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, flags: int
    ) -> list[tuple[int, dist.Work]]:
        ahead_layer, ahead = self._ahead.pop(rank, (-1, []))
        dtype = wire.DTYPES.index(x.dtype)
        head = wire.header(Op.SUM, layer, x.shape[0], ids.shape[1], x.shape[1], dtype, flags, ahead_layer, len(ahead))
        guess = torch.tensor(ahead, dtype=torch.int64)
        payload = wire.pack(guess, ids.cpu().to(torch.int64), weights.cpu().float(), x)
        return self._send(rank, f"layer {layer}", head, payload)

    def _send_prefetch(self, rank: int) -> list[tuple[int, dist.Work]]:
        layer, ahead = self._ahead.pop(rank)
        head, guess = wire.header(Op.PREFETCH, layer, len(ahead)), torch.tensor(ahead, dtype=torch.int64)
        return self._send(rank, f"prefetch for layer {layer}", head, guess)

    def _send(self, rank: int, what: str, *tensors: torch.Tensor) -> list[tuple[int, dist.Work]]:
        self.network.bytes_sent += sum(t.nbytes for t in tensors)
        # the default argument binds each tensor (mypy cannot infer such a lambda's type)
        return [(rank, self._issue(rank, what, lambda t=t: dist.isend(t, rank))) for t in tensors]  # type: ignore[misc]

    def _receive(self, rank: int, reply: torch.Tensor, tag: int, what: str) -> dist.Work:
        return self._issue(rank, what, lambda: dist.irecv(reply, rank, tag=tag))

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Hold each worker's part of the guess until the next request goes out (it travels with it)."""
        if not self.prefetch_enabled or layer not in self.row:
            return
        by_rank: dict[int, list[int]] = {}
        for expert, rank in zip(expert_ids, self.owners[self.row[layer]][list(expert_ids)].tolist(), strict=True):
            by_rank.setdefault(rank, []).append(expert)
        self._ahead.update((rank, (layer, mine)) for rank, mine in by_rank.items())

    def wants_prefetch(self, layer: int) -> bool:
        return self.prefetch_enabled

    def memory_of(self, layer: int, expert_ids: Sequence[int]) -> list[torch.Tensor]:
        """None of them: the experts are in the workers' memory, not this process's."""
        return []

    # ------------------------------------------------------------------------ stats and control
    def snapshot(self) -> StoreStats:
        """Every worker's counters now (one round trip each), summed."""
        with self._lock:
            self._check()
            pending, sends = [], []
            for rank in self.workers:
                sends += self._send(rank, "stats", wire.header(Op.STATS))
                reply = torch.empty(len(wire.STATS_FIELDS), dtype=torch.float64)
                pending.append((rank, self._receive(rank, reply, wire.TAG_STATS, "stats"), reply))
        self._wait_all(sends, "stats")
        total = StoreStats()
        for rank, work, reply in pending:
            self._wait(work, rank, "stats")
            view = self.workers[rank]
            view.stats, view.ram_slots, view.experts_held = wire.read_stats(reply)
            total.add(**vars(view.stats))
        return total

    def tiers(self) -> list[TierView]:
        """The workers' RAM slots as one tier (residency lives in the workers; not fetched here)."""
        slots = sum(view.ram_slots for view in self.workers.values())
        return [TierView("ram", slots, self.record_bytes, slots * self.record_bytes, frozenset())]

    def report(self) -> dict[str, Any]:
        totals = self.snapshot()
        return {
            **totals.as_dict(),
            "store": "workers",
            "direct_io": None,
            "workers": [view.as_dict() for view in self.workers.values()],
            "network": self.network.as_dict(),
        }

    def end_turn(self) -> None:
        """Flush the trace; the workers persist their usage histories. After a worker failed (already
        raised by the forward pass that met it) there is no one to tell: a no-op, so the turn still ends."""
        if self.trace is not None:
            self.trace.flush()
        if self._failed is not None:
            return
        with self._lock:
            sends = self._to_all("end of turn", Op.END_TURN)
        self._wait_all(sends, "end of turn")

    def close(self) -> None:
        """Tell the workers to stop (after a failure none is told: they see the group end), end local
        ones, leave the group (a later ``connect`` in this process can form a new one)."""
        if self.trace is not None:
            self.trace.close()
        if self._failed is None:
            try:
                self._wait_all(self._to_all("stop", Op.SHUTDOWN), "stop")
            except WorkerError:
                pass  # it is gone already: nothing to stop
        if self.local is not None:
            self.local.stop(kill=self._failed is not None)
        dist.destroy_process_group()

    def _to_all(self, what: str, op: Op) -> list[tuple[int, dist.Work]]:
        return [sent for rank in self.workers for sent in self._send(rank, what, wire.header(op))]

    # ---------------------------------------------------------------------------------- faults
    def _wait(self, work: dist.Work, rank: int, what: str) -> None:
        self._failing(rank, lambda name: wire.wait(work, self.timeout_s, f"{name}, {what}"))

    def _issue(self, rank: int, what: str, start: Callable[[], dist.Work | None]) -> dist.Work:
        return self._failing(rank, lambda name: wire.issue(start, f"{name}, {what}"))

    def _failing(self, rank: int, step: Callable[[str], R]) -> R:
        """step(the worker's name); its WorkerError is kept: every later call raises it at once."""
        try:
            return step(self.workers[rank].hello.name())
        except WorkerError as exc:
            self._failed = self._failed or exc
            raise self._failed from None

    def _wait_all(self, sends: list[tuple[int, dist.Work]], what: str) -> None:
        for rank, work in sends:
            self._wait(work, rank, what)

    def _check(self) -> None:
        if self._failed is not None:
            raise self._failed
