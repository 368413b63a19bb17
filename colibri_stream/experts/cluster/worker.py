"""A worker process: one share of every MoE layer's routed experts (and any replicas of hot experts), its
own tiered store (RAM/VRAM budget, policy, usage history), serving the coordinator's per-layer requests
until told to stop.

    join      connect to the coordinator, prove the cluster key both ways (handshake.py), say HELLO (rank,
              budget, measured disk speed, model fingerprint)
    setup     receive which experts it holds, open the store sized for them, say READY
    serve     SUM: prefetch the guessed ids sent along, compute the assigned experts' part of the routed sum
              (the engine's own routed_sum over the store), send it back; PREFETCH, STATS, END_TURN, SHUTDOWN

Started again with the same flags after it was lost, a worker joins the same way and the coordinator
gives it its share back (between steps). A worker computes with the same engine code as a single
process (rows_alone, int8 activations and prompt rows as the request's flags say), so its part of the sum is the
same float64 terms. Every request is checked against the model's geometry (RequestLimits) before its
payload is allocated: a frame that does not fit ends the worker in one line.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from colibri_stream.checkpoint.fingerprint import container_fingerprint
from colibri_stream.errors import USER_ERRORS, ColibriError
from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.auth import load_key
from colibri_stream.experts.cluster.handshake import prove_to_coordinator
from colibri_stream.experts.cluster.limits import RequestLimits
from colibri_stream.experts.cluster.transport import Link, dial
from colibri_stream.experts.cluster.wire import Hello, Op, WorkerError
from colibri_stream.experts.codec import expert_from_record
from colibri_stream.planning.bandwidth import disk_bandwidth
from colibri_stream.planning.budget import StoreOptions, worker_store_config
from colibri_stream.planning.geometry import container_args, geometry_from_container
from engine.core.moe import routed_sum
from engine.families import family_of
from engine.kernels.modes import int8_activations, prompt_rows
from engine.kernels.rows import rows_alone, torch_on_one_thread
from storage.container.reader import Container
from storage.tiers.config import StoreConfig
from storage.tiers.history import UsageHistory
from storage.tiers.tiered import TieredExpertStore
from storage.tiers.trace import TraceWriter

COORDINATOR = "the coordinator"
# what a request's failure is told to the coordinator as (it serves around this worker): I/O errors and
# every user-facing error, the storage ones included (a vanished or corrupt record is a CorruptDataError)
REPORTED: tuple[type[BaseException], ...] = (OSError, *USER_ERRORS)


@dataclass(frozen=True)
class WorkerOptions:
    path: str | Path  # the container (the same model as the coordinator's)
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    store: StoreOptions
    disk_bytes_per_s: int | None = None  # None: measured at start; 0: not known (equal to the others)
    connect_timeout_s: float = 600.0
    key_file: str | Path | None = None  # None: $COLIBRI_CLUSTER_KEY, else the default key file (auth.py)


def run_worker(options: WorkerOptions) -> int:
    """Join, take a share, serve until SHUTDOWN (0); a coordinator that is gone or refuses it is a
    WorkerError (exit status 1)."""
    key = load_key(options.key_file, create=False)  # before anything slow: a worker without one is refused now
    container = Container(options.path)
    geometry = geometry_from_container(container)
    config = worker_store_config(options.store, geometry.expert_bytes)
    disk = options.disk_bytes_per_s
    if disk is None:
        disk = int(disk_bandwidth(Path(options.path))[0])
    link = dial(options.master_addr, options.master_port, options.connect_timeout_s, COORDINATOR)
    try:
        where = f"{options.master_addr}:{options.master_port}"
        prove_to_coordinator(link, key, options.connect_timeout_s, where)
        hello = Hello(
            options.rank,
            socket.gethostname(),
            os.getpid(),
            len(container.moe_layers),
            container.n_experts,
            container.layout.record_bytes,
            config.ram_bytes,
            disk,
            wire.fingerprint_crc(container_fingerprint(container)),
        )
        link.send(Op.HELLO, [hello.host.encode()[: wire.HOST_BYTES]], wire.hello_values(hello), None)
        held = _receive_setup(link, container)
        trace = TraceWriter(options.store.trace) if options.store.trace else None
        store = _open_store(link, container, config, int(held.sum()), trace)
        try:
            return Server(link, container, store, held, RequestLimits.of(container)).serve()
        finally:
            store.close()
    finally:
        link.close()


def _receive_setup(link: Link, container: Container) -> torch.Tensor:
    """bool [MoE layers, experts]: the experts this worker holds."""
    shape = (len(container.moe_layers), container.n_experts)
    head, payload = link.receive(None, "waiting for its share", max(shape[0] * shape[1], wire.MAX_TEXT_BYTES))
    if head.op == Op.REFUSE:
        raise WorkerError(f"the coordinator refused this worker: {payload.decode(errors='replace')}")
    if head.op != Op.SETUP or len(payload) != shape[0] * shape[1]:
        raise ColibriError(f"expected the share table from the coordinator, got {head.op.name} ({len(payload)} B)")
    return torch.frombuffer(payload, dtype=torch.uint8).view(shape).bool()


def _open_store(
    link: Link, container: Container, config: StoreConfig, share: int, trace: TraceWriter | None
) -> TieredExpertStore:
    """This worker's store, its RAM no more than its share of records; READY (or why not) to the coordinator."""
    try:
        history = None
        if config.history_path is not None:
            history = UsageHistory.load(config.history_path, container.n_experts, container_fingerprint(container))
        held = min(config.ram_bytes, max(share, 1) * container.layout.record_bytes)
        store = TieredExpertStore(
            container,
            replace(config, ram_bytes=held),
            lambda record: expert_from_record(container.layout, record),
            history,
            trace,
        )
    except Exception as exc:  # a budget below this share's floor, an unreadable history: the coordinator says it
        link.send(Op.READY, [f"{type(exc).__name__}: {exc}".encode()[: wire.MAX_TEXT_BYTES]], (), None)
        raise
    link.send(Op.READY, [], (), None)
    return store


class Server:
    """The request loop of a joined worker."""

    def __init__(
        self, link: Link, container: Container, store: TieredExpertStore, held: torch.Tensor, limits: RequestLimits
    ):
        self.link = link
        self.limits = limits
        self.store = store
        self.layers = list(container.moe_layers)  # share table row -> model layer
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.held = int(held.sum())
        self.limit = family_of(container_args(container)).swiglu_limit

    def serve(self) -> int:
        while True:
            head, payload = self.link.receive(None, "waiting for a request", self.limits.payload_bytes)
            if head.op == Op.SHUTDOWN:
                return 0
            try:
                self._handle(head, payload)
            except REPORTED as exc:  # a failing disk, a bad record: say why, then leave
                if not isinstance(exc, WorkerError):
                    self.link.send(Op.ERROR, [f"{type(exc).__name__}: {exc}".encode()[: wire.MAX_TEXT_BYTES]], (), None)
                raise

    def _handle(self, head: wire.Head, payload: bytearray) -> None:
        if head.op == Op.SUM:
            self._sum(payload, *head.values[:9])
        elif head.op == Op.PREFETCH:
            layer, count = head.values[:2]
            guess = torch.frombuffer(payload, dtype=torch.int64) if count else torch.empty(0, dtype=torch.int64)
            self.limits.check_ids(guess)
            self._prefetch(layer, guess)
        elif head.op == Op.STATS:
            stats = wire.stats_tensor(self.store.snapshot(), self.store.ram.n_slots, self.held)
            self.link.send(Op.STATS, [wire.tensor_bytes(stats)], (), None)
        elif head.op == Op.END_TURN:
            self.store.end_turn()
        else:
            raise ColibriError(f"unexpected message {head.op.name} from the coordinator")

    def _sum(
        self, payload: bytearray, layer: int, rows: int, topk: int, dim: int, dtype: int, flags: int, ahead: int,
        count: int, assigned: int,
    ) -> None:  # fmt: skip
        """The assigned experts' part of ``layer``'s routed sum; first the prefetch guess for layer ``ahead``."""
        specs = wire.sum_payload_specs(rows, topk, dim, wire.DTYPES[dtype], count, assigned)
        guess, mine, ids, weights, x = wire.unpack(torch.frombuffer(payload, dtype=torch.uint8), specs)
        self.limits.check_ids(guess, mine, ids)
        if count:
            self._prefetch(ahead, guess)  # read while this layer computes
        wanted = set(mine.tolist())
        with _engine_context(flags):
            total, _ = routed_sum(x, weights, ids, self.store, layer, self.limit, owned=wanted.__contains__)
        self.link.send(Op.SUM, [wire.tensor_bytes(total)], (), None)

    def _prefetch(self, layer: int, ids: torch.Tensor) -> None:
        if layer in self.row:
            self.store.prefetch(layer, ids.tolist())


@contextlib.contextmanager
def _engine_context(flags: int) -> Iterator[None]:
    """The contexts the coordinator's forward pass was in when it sent the request."""
    with contextlib.ExitStack() as stack:
        if flags & wire.FLAG_ROWS_ALONE:
            stack.enter_context(rows_alone())
        stack.enter_context(int8_activations(bool(flags & wire.FLAG_INT8_ACTIVATIONS)))
        stack.enter_context(prompt_rows(bool(flags & wire.FLAG_PROMPT_ROWS)))
        stack.enter_context(torch_on_one_thread())
        yield
