"""A worker process: one share of every MoE layer's routed experts, its own tiered store (RAM/VRAM
budget, policy, usage history), serving the coordinator's per-layer requests until told to stop.

    join      rendezvous with the coordinator, say HELLO (budget, measured disk speed, model fingerprint)
    setup     receive the owner table, open the store sized for this worker's share, say READY
    serve     SUM: prefetch the guessed ids sent along, compute this share of the routed sum (the
              engine's own routed_sum over the store), send it back; PREFETCH, STATS, END_TURN, SHUTDOWN

A worker computes with the same engine code as a single process (rows_alone and int8 activations as the
request's flags say), so its share of the sum is the same float64 terms.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from colibri_stream.checkpoint.fingerprint import container_fingerprint
from colibri_stream.errors import ColibriError
from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.rendezvous import join_group
from colibri_stream.experts.cluster.wire import COORDINATOR, Hello, Op
from colibri_stream.experts.codec import expert_from_record
from colibri_stream.planning.bandwidth import disk_bandwidth
from colibri_stream.planning.budget import StoreOptions, worker_store_config
from colibri_stream.planning.geometry import container_args, geometry_from_container
from engine.families import family_of
from engine.moe import routed_sum
from engine.q8 import int8_activations
from engine.rows import rows_alone, torch_on_one_thread
from storage.container import Container
from storage.history import UsageHistory
from storage.tiered import StoreConfig, TieredExpertStore
from storage.trace import TraceWriter

IDLE_S = 365 * 86400.0  # a worker waits for the next request as long as the coordinator lives


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


def run_worker(options: WorkerOptions) -> int:
    """Join, take a share, serve until SHUTDOWN (0) or until the coordinator is gone (1)."""
    container = Container(options.path)
    geometry = geometry_from_container(container)
    config = worker_store_config(options.store, geometry.expert_bytes)
    disk = options.disk_bytes_per_s
    if disk is None:
        disk = int(disk_bandwidth(Path(options.path))[0])
    join_group(options.master_addr, options.master_port, options.rank, options.world_size, options.connect_timeout_s)
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
    for tensor in wire.hello_tensor(hello):
        _send(tensor, wire.TAG_CONTROL)
    try:
        owners = _receive_owners(container)
        trace = TraceWriter(options.store.trace) if options.store.trace else None
        store = _open_store(container, config, int((owners == options.rank).sum()), trace)
        try:
            return Server(container, store, owners, options.rank).serve()
        finally:
            store.close()
    finally:
        dist.destroy_process_group()


def _open_store(container: Container, config: StoreConfig, share: int, trace: TraceWriter | None) -> TieredExpertStore:
    """This worker's store, its RAM no more than its share of records; READY (or why not) to the coordinator."""
    try:
        history = None
        if config.history_path is not None:
            history = UsageHistory.load(config.history_path, container.n_experts, container_fingerprint(container))
        held = min(config.ram_bytes, share * container.layout.record_bytes)
        store = TieredExpertStore(
            container,
            replace(config, ram_bytes=held),
            lambda record: expert_from_record(container.layout, record),
            history,
            trace,
        )
    except Exception as exc:  # a budget below this share's floor, an unreadable history: the coordinator says it
        _ready(f"{type(exc).__name__}: {exc}")
        raise
    _ready("")
    return store


def _receive_owners(container: Container) -> torch.Tensor:
    head = _receive(torch.int64, (wire.HEADER,), wire.TAG_CONTROL)
    if head[0] != Op.SETUP:
        raise ColibriError(f"expected the owner table from the coordinator, got message {int(head[0])}")
    return _receive(torch.int64, (len(container.moe_layers), container.n_experts), wire.TAG_CONTROL)


def _ready(error: str) -> None:
    text = error.encode()
    _send(torch.tensor([len(text)], dtype=torch.int64), wire.TAG_CONTROL)
    if text:
        _send(torch.tensor(list(text), dtype=torch.uint8), wire.TAG_CONTROL)


class Server:
    """The request loop of a joined worker."""

    def __init__(self, container: Container, store: TieredExpertStore, owners: torch.Tensor, rank: int):
        self.store = store
        self.layers = list(container.moe_layers)  # owner table row -> model layer
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.owned = [set(torch.nonzero(owners[i] == rank).flatten().tolist()) for i in range(len(self.layers))]
        self.limit = family_of(container_args(container)).swiglu_limit

    def serve(self) -> int:
        while True:
            op, *values = _receive(torch.int64, (wire.HEADER,)).tolist()
            if op == Op.SHUTDOWN:
                return 0
            self._handle(Op(op), values)

    def _handle(self, op: Op, values: list[int]) -> None:
        if op == Op.SUM:
            self._sum(*values[:8])
        elif op == Op.PREFETCH:
            layer, count = values[:2]
            self._prefetch(layer, _receive(torch.int64, (count,)))
        elif op == Op.STATS:
            stats = wire.stats_tensor(self.store.snapshot(), self.store.ram.n_slots, sum(map(len, self.owned)))
            _send(stats, wire.TAG_STATS)
        elif op == Op.END_TURN:
            self.store.end_turn()
        else:
            raise ColibriError(f"unexpected message {op.name} from the coordinator")

    def _sum(self, layer: int, rows: int, topk: int, dim: int, dtype: int, flags: int, ahead: int, count: int) -> None:
        """This share of ``layer``'s routed sum; first the prefetch guess for layer ``ahead`` sent along."""
        specs = wire.sum_payload_specs(rows, topk, dim, wire.DTYPES[dtype], count)
        guess, ids, weights, x = wire.unpack(_receive(torch.uint8, (wire.payload_bytes(specs),)), specs)
        if count:
            self._prefetch(ahead, guess)  # read while this layer computes
        owned = self.owned[self.row[layer]]
        with _engine_context(flags):
            total, _ = routed_sum(x, weights, ids, self.store, layer, self.limit, owned=owned.__contains__)
        _send(total, wire.TAG_SUM)

    def _prefetch(self, layer: int, ids: torch.Tensor) -> None:
        if layer in self.row:
            self.store.prefetch(layer, ids.tolist())


def _receive(dtype: torch.dtype, shape: tuple[int, ...], tag: int = 0) -> torch.Tensor:
    """The coordinator's next message, however long it takes (a chat waits for its user); a coordinator
    that is gone is a WorkerError (exit status 1)."""
    out = torch.empty(shape, dtype=dtype)
    wire.wait(wire.issue(lambda: dist.irecv(out, COORDINATOR, tag=tag), "the coordinator"), IDLE_S, "the coordinator")
    return out


def _send(tensor: torch.Tensor, tag: int) -> None:
    work = wire.issue(lambda: dist.isend(tensor, COORDINATOR, tag=tag), "the coordinator")
    wire.wait(work, IDLE_S, "the coordinator")


@contextlib.contextmanager
def _engine_context(flags: int) -> Iterator[None]:
    """The contexts the coordinator's forward pass was in when it sent the request."""
    with contextlib.ExitStack() as stack:
        if flags & wire.FLAG_ROWS_ALONE:
            stack.enter_context(rows_alone())
        stack.enter_context(int8_activations(bool(flags & wire.FLAG_INT8_ACTIVATIONS)))
        stack.enter_context(torch_on_one_thread())
        yield
