"""The coordinator's side: a remote expert store (RemoteExpertStore) whose routed experts live in worker
processes, and that keeps going when one of them is lost.

The coordinator keeps the dense part, the KV state and the routers. Per MoE layer it sends each worker
that computes one of the routed experts one request (the rows, their expert ids and gate weights, the
experts it is to compute, plus the next layer's prefetch guess for that worker), computes the shared
expert while the workers read and compute, and adds their float64 partial sums: the same exact terms a
single process adds (engine/core/moe.py RoutedSum), so the tokens are the same whatever the number of workers.

A worker that closes its link, stalls past ``timeout_s`` or reports an error is lost, alone (one socket
per worker, transport.py): its part of the request in flight is computed again by the coordinator from
its own container (failover.py) from the very rows, weights and ids that were sent, and for the rest of
the time it is gone its experts go to a surviving replica holder or to the coordinator (replicas.py).
The tokens stay those of an uninterrupted run. A worker started again with the same flags rejoins: its
handshake runs beside the forward pass (rendezvous.py), and it takes its share back at the start of the
next step. A local worker that was lost is killed (a stopped one would otherwise linger).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from colibri_stream.checkpoint.fingerprint import container_fingerprint
from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.failover import Fallback
from colibri_stream.experts.cluster.local import LocalWorkers
from colibri_stream.experts.cluster.members import LOST, Member, refuse, set_up
from colibri_stream.experts.cluster.rendezvous import Listener
from colibri_stream.experts.cluster.replicas import COORDINATOR, Holders, assign
from colibri_stream.experts.cluster.transport import Link, Reply
from colibri_stream.experts.cluster.wire import Hello, Op, WorkerError
from engine.core.sources import Offered
from engine.kernels.modes import activations_are_int8, rows_are_prompt
from engine.kernels.rows import computing_alone
from storage.container.reader import Container
from storage.tiers.history import UsageHistory
from storage.tiers.stats import RoutingCounts, StoreStats, TierView
from storage.tiers.trace import TraceWriter

logger = logging.getLogger(__name__)


@dataclass
class NetworkStats:
    """What crossed the network, measured at the coordinator."""

    bytes_sent: int = 0
    bytes_received: int = 0
    layer_requests: int = 0  # MoE layer steps that asked at least one worker
    round_trip_s: float = 0.0  # summed over those: first request sent -> last reply received
    wait_s: float = 0.0  # the forward pass blocked on replies and on the coordinator's own share
    tokens: int = 0  # positions through the first MoE layer: tokens whose activations were sent
    recomputed: int = 0  # requests in flight when their worker was lost, computed again here
    served_here: int = 0  # layer requests whose experts (some of them) the coordinator computed itself

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
            "recomputed": self.recomputed,
            "served_here": self.served_here,
        }


@dataclass(frozen=True)
class Sent:
    """One SUM request out: who, which experts, the reply to wait for."""

    rank: int
    experts: list[int]
    reply: Reply


class DistributedExperts:
    """The routed sums of joined workers (``group.connect`` forms the cluster and hands out the shares)."""

    def __init__(
        self,
        container: Container,
        members: Sequence[Member],
        holders: Holders,
        timeout_s: float,
        fallback: Fallback,
        listener: Listener,
        prefetch: bool = True,
        local: LocalWorkers | None = None,
        trace: TraceWriter | None = None,
        history: tuple[UsageHistory, str] | None = None,
        rejoin_timeout_s: float = 600.0,
    ):
        self.container = container
        self.layers = list(container.moe_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.holders = holders
        self._owners = holders.owners.tolist()  # [MoE layers][experts] -> rank: read per request
        self._replicas = holders.replicas.tolist()
        self.record_bytes = container.layout.record_bytes
        self.timeout_s = timeout_s
        self.rejoin_timeout_s = rejoin_timeout_s
        self.fallback = fallback
        self.listener = listener
        self.prefetch_enabled = prefetch
        self.local = local
        self.trace = trace
        self.history = history  # (the coordinator's usage history, its file): ranks experts for --replicas
        self.members = {m.hello.rank: m for m in members}
        self.routed = RoutingCounts(self.layers, container.n_experts)
        self.network = NetworkStats()
        self._crc = wire.fingerprint_crc(container_fingerprint(container))
        self._ahead: dict[int, tuple[int, list[int]]] = {}  # rank -> a prefetch guess not sent yet
        self._lock = threading.RLock()  # membership and the guesses: the forward pass, a dashboard, the listener
        self._arrivals: list[tuple[Hello, Link]] = []  # rejoined workers set up, waiting for the next step
        listener.on_join = self._rejoin_handshake

    # ------------------------------------------------------------------------------ the MoE layer
    def routed_sum(self) -> DistributedExperts:
        """This source sums its experts where they are (``start_routed_sum``)."""
        return self

    def start_routed_sum(
        self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        """Send the layer's requests; the returned function waits for the replies -> float64 [N, dim]."""
        if layer == self.layers[0]:
            self._admit_rejoined()  # between steps: a worker that came back takes its share now
            self.network.tokens += x.shape[0]
        routed = ids.unique().tolist()
        self.routed.record(layer, routed)
        if self.history is not None:
            self.history[0].record(layer, routed)
        if self.trace is not None:
            self.trace.write(layer, routed)
        x_cpu, weights_cpu, ids_cpu, started = x.cpu(), weights.cpu().float(), ids.cpu(), time.perf_counter()
        here, sent = self._request(layer, x_cpu, weights_cpu, ids_cpu, routed)
        if sent:
            self.network.layer_requests += 1

        def wait() -> torch.Tensor:
            waited = time.perf_counter()
            total = torch.zeros(x_cpu.shape, dtype=torch.float64)
            if here:  # the coordinator's own part while the workers compute theirs
                total += self._here(layer, x_cpu, weights_cpu, ids_cpu, here)
            for request in sent:  # exact float64 partial sums: the order does not matter
                total += self._reply(layer, x_cpu, weights_cpu, ids_cpu, request)
            done = time.perf_counter()
            self.network.wait_s += done - waited
            if sent:
                self.network.round_trip_s += done - started
            return total.to(x.device)

        return wait

    def _request(
        self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, routed: list[int]
    ) -> tuple[list[int], list[Sent]]:
        """A SUM request to every serving worker that computes some of ``routed`` (with its part of the
        prefetch guess), a lone PREFETCH to one that computes none but has a guess waiting -> (the experts
        the coordinator computes itself, the requests sent)."""
        row = self.row[layer]
        flags = (
            (wire.FLAG_ROWS_ALONE if computing_alone() else 0)
            | (wire.FLAG_INT8_ACTIVATIONS if activations_are_int8() else 0)
            | (wire.FLAG_PROMPT_ROWS if rows_are_prompt() else 0)
        )
        sent: list[Sent] = []
        with self._lock:
            serving = [rank for rank, m in self.members.items() if m.serving]
            plan = assign(routed, self._owners[row], self._replicas[row], serving)
            here = plan.pop(COORDINATOR, [])
            for rank in serving:
                mine = plan.get(rank)
                try:
                    if mine:
                        sent.append(self._send_sum(rank, layer, x, weights, ids, flags, mine))
                    elif rank in self._ahead:
                        self._send_prefetch(rank)
                except WorkerError as exc:
                    self._lose(rank, exc)
                    here += mine or []
        return here, sent

    def _send_sum(
        self, rank: int, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, flags: int,
        mine: list[int],
    ) -> Sent:  # fmt: skip
        ahead_layer, ahead = self._ahead.pop(rank, (-1, []))
        guess, assigned = torch.tensor(ahead, dtype=torch.int64), torch.tensor(mine, dtype=torch.int64)
        dtype = wire.DTYPES.index(x.dtype)
        values = (layer, x.shape[0], ids.shape[1], x.shape[1], dtype, flags, ahead_layer, len(ahead), len(mine))
        parts = [wire.tensor_bytes(t) for t in (guess, assigned, ids.to(torch.int64), weights, x)]
        reply = Reply(Op.SUM, torch.empty(x.shape, dtype=torch.float64), f"layer {layer}")
        self._send(rank, Op.SUM, parts, values, reply)
        return Sent(rank, mine, reply)

    def _send_prefetch(self, rank: int) -> None:
        layer, ahead = self._ahead.pop(rank)
        self._send(rank, Op.PREFETCH, [wire.tensor_bytes(torch.tensor(ahead, dtype=torch.int64))], (layer, len(ahead)))

    def _send(
        self, rank: int, op: Op, parts: list[memoryview], values: Sequence[int] = (), reply: Reply | None = None
    ) -> None:
        link = self.members[rank].link
        if link is None:
            raise self._lost_error(rank)
        before = link.bytes_sent
        link.send(op, parts, values, self.timeout_s, reply)
        self.network.bytes_sent += link.bytes_sent - before

    def _reply(
        self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, request: Sent
    ) -> torch.Tensor:
        """A worker's partial sum; when it is lost instead, the same part computed here."""
        link = self.members[request.rank].link
        try:
            if link is None:
                raise self._lost_error(request.rank)
            out = link.wait(request.reply, self.timeout_s)
            self.network.bytes_received += out.nbytes + wire.FRAME_BYTES
            return out
        except WorkerError as exc:
            self._lose(request.rank, exc)
            self.network.recomputed += 1
            return self._here(layer, x, weights, ids, request.experts, count=False)

    def _here(
        self,
        layer: int,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        experts: list[int],
        count: bool = True,
    ) -> torch.Tensor:
        if count:
            self.network.served_here += 1
        return self.fallback.routed_sum(layer, x, weights, ids, experts, self._fallback_ram())

    def _fallback_ram(self) -> int:
        """The RAM of the first worker lost: its budget is what its share had."""
        lost = [m.hello.ram_bytes for m in self.members.values() if m.failovers]
        return max(lost) if lost else self.record_bytes

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Hold each worker's part of the guess until the next request goes out (it travels with it); a
        replicated expert's guess goes to both holders (hot: mostly a hit there), a lost one's to the
        coordinator's own store."""
        if not self.prefetch_enabled or layer not in self.row:
            return
        row = self.row[layer]
        by_rank: dict[int, list[int]] = {}
        with self._lock:
            for expert in expert_ids:
                holders = [r for r in (self._owners[row][expert], self._replicas[row][expert]) if r > 0]
                serving = [r for r in holders if self.members[r].serving] or [COORDINATOR]
                for rank in serving:
                    by_rank.setdefault(rank, []).append(expert)
            self.fallback.prefetch(layer, by_rank.pop(COORDINATOR, []))
            self._ahead.update((rank, (layer, mine)) for rank, mine in by_rank.items())

    def lookahead(self, layers: Sequence[int]) -> Sequence[int]:
        """The next layer: a guess travels with the next request."""
        return layers[:1] if self.prefetch_enabled else ()

    def offers(self) -> Offered:
        """No speed path: the experts are in the workers' memory, not this process's."""
        return Offered()

    # ------------------------------------------------------------------------- loss and rejoin
    def _lose(self, rank: int, error: WorkerError) -> None:
        """Worker ``rank`` is lost (the first report of it counts): close its link, end it if it is ours."""
        with self._lock:
            member = self.members[rank]
            link = member.lose(error)
            if link is None:
                return
            self._ahead.pop(rank, None)
        link.close()
        logger.warning("%s; its experts are served by %s until it rejoins", error, self._stand_in(rank))
        if self.local is not None:
            self.local.end(rank)

    def _stand_in(self, rank: int) -> str:
        replicated = bool((self.holders.held_by(rank).bool() & (self.holders.replicas >= 0)).any())
        return "its replica holders and the coordinator" if replicated else "the coordinator"

    def _lost_error(self, rank: int) -> WorkerError:
        return WorkerError(f"{self.members[rank].hello.name()} is lost")

    def _rejoin_handshake(self, hello: Hello, link: Link) -> None:
        """A worker connecting after the start (the listener's thread): one of this model, with the rank
        of a lost worker, gets that worker's experts; it is taken in at the start of the next step."""
        member = self.members.get(hello.rank)
        if hello.fingerprint_crc != self._crc or hello.n_experts != self.container.n_experts:
            refuse(link, f"it serves another model or container than {self.container.path}")
        elif member is None:
            refuse(link, f"rank {hello.rank} is not one of this coordinator's workers {sorted(self.members)}")
        elif member.serving:
            refuse(link, f"worker {hello.rank} is serving (pid {member.hello.pid})")
        else:
            try:
                set_up(link, hello, self._held_bytes(hello.rank), self.rejoin_timeout_s)
            except WorkerError as exc:
                logger.warning("%s: not taken back", exc)
                link.close()
                return
            with self._lock:
                self._arrivals.append((hello, link))
            logger.warning("%s is back and set up; it takes its share at the next step", hello.name())

    def _held_bytes(self, rank: int) -> bytes:
        return wire.tensor_bytes(self.holders.held_by(rank)).tobytes()

    def _admit_rejoined(self) -> None:
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
            for hello, link in arrivals:
                member = self.members[hello.rank]
                if member.serving:  # two came back for one rank: the first one set up wins
                    refuse(link, f"worker {hello.rank} rejoined already")
                    continue
                gone = member.rejoin(hello, link)
                logger.warning("%s rejoined after %.1f s without it; it serves its share again", hello.name(), gone)

    # ------------------------------------------------------------------------ stats and control
    def snapshot(self) -> StoreStats:
        """Every serving worker's counters now (one round trip each) and the last ones of lost workers,
        plus the coordinator's own store's, summed."""
        pending = []
        with self._lock:
            for rank, member in self.members.items():
                if not member.serving:
                    continue
                reply = Reply(Op.STATS, torch.empty(len(wire.STATS_FIELDS), dtype=torch.float64), "stats")
                try:
                    self._send(rank, Op.STATS, [], (), reply)
                    pending.append((rank, reply))
                except WorkerError as exc:
                    self._lose(rank, exc)
        for rank, reply in pending:
            member = self.members[rank]
            try:
                if member.link is None:
                    raise self._lost_error(rank)
                values = member.link.wait(reply, self.timeout_s)
                member.stats, member.ram_slots, member.experts_held = wire.read_stats(values)
            except WorkerError as exc:
                self._lose(rank, exc)
        total = self.fallback.snapshot()
        for member in self.members.values():
            total.add(**vars(member.total()))
        return total

    def tiers(self) -> list[TierView]:
        """The workers' RAM slots as one tier (residency lives in the workers; not fetched here)."""
        slots = sum(m.ram_slots for m in self.members.values() if m.serving)
        return [TierView("ram", slots, self.record_bytes, slots * self.record_bytes, frozenset())]

    def report(self) -> dict[str, Any]:
        totals = self.snapshot()
        here = self.fallback.snapshot()
        return {
            **totals.as_dict(),
            "store": "workers",
            "direct_io": None,
            "page_cache_bypass": None,
            "workers": [m.as_dict() for m in self.members.values()],
            "failovers": sum(m.failovers for m in self.members.values()),
            "replicas": self.holders.replica_count(),
            "coordinator_share": {"requests": here.requests, "misses": here.misses, "bytes": here.expert_bytes_read},
            "network": self.network.as_dict(),
        }

    def end_turn(self) -> None:
        """Flush the trace, save the coordinator's usage history; the serving workers persist theirs."""
        if self.trace is not None:
            self.trace.flush()
        if self.history is not None:
            self.history[0].save_or_warn(self.history[1])
        self._to_all(Op.END_TURN)
        if self.fallback.store is not None:
            self.fallback.store.end_turn()

    def close(self) -> None:
        """Tell the serving workers to stop, end local ones, stop listening."""
        self.listener.close()
        if self.trace is not None:
            self.trace.close()
        self._to_all(Op.SHUTDOWN)
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
        for _, link in arrivals:  # set up but never taken in: told to stop like the others
            refuse(link, "the coordinator is closing")
        for member in self.members.values():
            if member.link is not None:
                member.link.close()
        if self.local is not None:
            self.local.stop()
        self.fallback.close()

    def _to_all(self, op: Op) -> None:
        with self._lock:
            for rank, member in self.members.items():
                if member.serving:
                    try:
                        self._send(rank, op, [])
                    except WorkerError as exc:
                        self._lose(rank, exc)

    def lost_workers(self) -> list[int]:
        return [rank for rank, m in self.members.items() if m.state == LOST]
