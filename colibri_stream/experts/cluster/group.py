"""``connect``: from the coordinator's flags to a DistributedExperts store — load (or create) the cluster
key, listen, start local workers if asked, wait for every worker's HELLO, check each serves this model,
hand out the shares (and replicas), wait until all are ready. The listener stays open: a lost worker
started again rejoins through it.

A worker lost during start-up (a local one that exits before it joins, any one whose link fails while it
is set up) does not end the run: it starts lost, its share served by the coordinator (or a replica
holder) as a worker lost mid-run is. A worker that joins and cannot serve (another model, a budget
below its share) is a configuration error, and that ends the start."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from colibri_stream.checkpoint.fingerprint import container_fingerprint
from colibri_stream.errors import ColibriError
from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.auth import load_key
from colibri_stream.experts.cluster.coordinator import DistributedExperts
from colibri_stream.experts.cluster.failover import Fallback
from colibri_stream.experts.cluster.local import LOCALHOST, LocalWorkers
from colibri_stream.experts.cluster.members import LOST, Member, ShareRefused, refuse, send_setup, wait_ready
from colibri_stream.experts.cluster.rendezvous import Listener
from colibri_stream.experts.cluster.replicas import Holders, with_replicas
from colibri_stream.experts.cluster.shares import measured_owners, read_expert_map
from colibri_stream.experts.cluster.transport import Link
from colibri_stream.experts.cluster.wire import Hello, WorkerError
from colibri_stream.planning.geometry import container_args
from colibri_stream.planning.settings import store_flags
from engine.families import family_of
from storage.container.reader import Container
from storage.tiers.config import StoreConfig
from storage.tiers.history import UsageHistory
from storage.tiers.trace import TraceWriter

logger = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 600.0
POLL_S = 0.05


@dataclass(frozen=True)
class ClusterOptions:
    """The coordinator's flags: --world-size/--master-addr/--master-port for workers started by hand,
    or --local-workers N to start them here."""

    world_size: int | None = None  # coordinator + workers
    master_addr: str = LOCALHOST
    master_port: int | None = None
    local_workers: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S  # a worker's answer to one request
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S  # every worker joined
    expert_map: str | Path | None = None  # explicit shares (colibri_stream/experts/cluster/shares.py)
    replicas: int = 0  # the N hottest experts of each layer (usage history) held by two workers
    key_file: str | Path | None = None  # the cluster key (auth.py; None: $COLIBRI_CLUSTER_KEY or the default)

    @property
    def enabled(self) -> bool:
        return self.local_workers > 0 or self.world_size is not None

    def checked_world_size(self) -> int:
        world = self.world_size if self.world_size is not None else self.local_workers + 1
        if self.local_workers and world != self.local_workers + 1:
            raise ColibriError(
                f"--world-size {world} with --local-workers {self.local_workers}: expected {self.local_workers + 1}"
            )
        if world < 2:
            raise ColibriError(f"--world-size {world}: the coordinator needs at least one worker (2 or more)")
        if not self.local_workers and self.master_port is None:
            raise ColibriError("--world-size needs --master-port (where the workers connect)")
        if self.replicas < 0:
            raise ColibriError(f"--replicas must be >= 0, got {self.replicas}")
        if self.timeout_s <= 0:
            raise ColibriError(f"--worker-timeout must be > 0 seconds, got {self.timeout_s:g}")
        return world


def connect(
    container: Container, options: ClusterOptions, store: StoreConfig, trace: TraceWriter | None = None
) -> DistributedExperts:
    """The store over the workers. With local workers, ``store``'s budgets are split evenly between them."""
    world = options.checked_world_size()
    if options.replicas and store.history_path is None:  # refused before any worker starts
        raise ColibriError(
            f"--replicas {options.replicas} holds the hottest experts twice, ranked by the usage history: "
            "give --history FILE (saved after every turn; the replicas follow it from the next start)"
        )
    key = load_key(options.key_file, create=True)
    listener = Listener(options.master_addr, options.master_port or 0, options.timeout_s, key)
    local, links = None, []
    try:
        exited: Callable[[], dict[int, str]] = dict
        if options.local_workers:
            flags = lambda rank: local_worker_flags(store, options.local_workers, rank)  # noqa: E731
            local = LocalWorkers.start(str(container.path), options.local_workers, listener.port, flags, key)
            exited = local.exited
        joined, gone = _gather(listener, world, options.connect_timeout_s, exited)
        links = [link for _, link in joined]
        _check_same_model(container, [hello for hello, _ in joined])
        hellos = sorted([h for h, _ in joined] + [_stand_in(container, store, local, r) for r in gone], key=_rank)
        history = _history(container, store)
        owners = _owners(container, hellos, options.expert_map)
        ranks = [h.rank for h in hellos]
        holders = with_replicas(owners, list(container.moe_layers), history and history[0], options.replicas, ranks)
        gone |= _set_up(joined, holders, options.timeout_s)
    except BaseException:
        for link in links:
            link.close()
        listener.close()
        if local is not None:
            local.stop(kill=True)
        raise
    fallback = Fallback(container, store, family_of(container_args(container)).swiglu_limit)
    members = [_member(hello, dict(joined).get(hello), gone.get(hello.rank), local) for hello in hellos]
    return DistributedExperts(
        container, members, holders, options.timeout_s, fallback, listener, store.prefetch, local, trace, history,
        rejoin_timeout_s=options.connect_timeout_s,
    )  # fmt: skip


def local_worker_flags(store: StoreConfig, count: int, rank: int) -> list[str]:
    """A local worker's store flags: 1/count of the coordinator's RAM and VRAM budgets, every other store
    setting as the coordinator's (settings.store_flags), and its own usage-history file beside the
    coordinator's (``.workerR``)."""
    vram = store.vram_bytes // count if store.vram_bytes else None  # None: no VRAM tier, no VRAM flags
    history = None if store.history_path is None else f"{store.history_path}.worker{rank}"
    shares = {"ram": store.ram_bytes // count, "vram": vram, "history": history}
    return store_flags(store, shares | ({} if vram else {"vram_device": None}))


def _rank(hello: Hello) -> int:
    return hello.rank


def _gather(
    listener: Listener, world: int, timeout_s: float, exited: Callable[[], dict[int, str]]
) -> tuple[list[tuple[Hello, Link]], dict[int, str]]:
    """(workers joined, in rank order; rank -> why, for local workers that exited before they joined),
    within ``timeout_s``. A second worker with a rank already joined, or a rank outside the world, is
    refused (it exits saying why); the first one keeps the rank."""
    deadline = time.monotonic() + timeout_s
    joined: dict[int, tuple[Hello, Link]] = {}
    gone: dict[int, str] = {}
    try:
        while len(joined) + len(gone) < world - 1:
            gone |= {rank: why for rank, why in exited().items() if rank not in joined}
            missing = [r for r in range(1, world) if r not in joined and r not in gone]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise WorkerError(f"worker(s) {missing} did not join {listener.address} within {timeout_s:g} s")
            try:
                hello, link = listener.joined.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if hello.rank not in missing:
                why = "taken" if hello.rank in joined else f"not one of 1 .. {world - 1} (--world-size {world})"
                refuse(link, f"rank {hello.rank} is {why}")
                continue
            joined[hello.rank] = (hello, link)
    except BaseException:
        for _, link in joined.values():
            link.close()
        raise
    return [joined[rank] for rank in sorted(joined)], gone


def _stand_in(container: Container, store: StoreConfig, local: LocalWorkers | None, rank: int) -> Hello:
    """What a local worker that exited before it joined would have said (its share is computed from it)."""
    count = len(local.processes) if local is not None else 1
    pid = local.pid(rank) if local is not None else 0
    crc = wire.fingerprint_crc(container_fingerprint(container))
    layers, experts, record = len(container.moe_layers), container.n_experts, container.layout.record_bytes
    return Hello(rank, LOCALHOST, pid, layers, experts, record, store.ram_bytes // count, 0, crc)


def _member(hello: Hello, link: Link | None, why: str | None, local: LocalWorkers | None) -> Member:
    """A worker's member: serving, or lost during start-up (``why``) and ended if it is ours."""
    if why is None and link is not None:
        return Member(hello, link)
    if link is not None:
        link.close()
    if local is not None:
        local.end(hello.rank)
    logger.warning("%s during start-up; its experts are served by the coordinator until it rejoins", why)
    return Member(hello, None, state=LOST, failovers=1, last_loss=str(why), lost_since=time.monotonic())


def _check_same_model(container: Container, hellos: list[Hello]) -> None:
    crc = wire.fingerprint_crc(container_fingerprint(container))
    shape = (len(container.moe_layers), container.n_experts, container.layout.record_bytes)
    for hello in hellos:
        if (hello.moe_layers, hello.n_experts, hello.record_bytes) != shape or hello.fingerprint_crc != crc:
            raise WorkerError(
                f"{hello.name()} serves another model or container: {hello.moe_layers} MoE layers x "
                f"{hello.n_experts} experts of {hello.record_bytes} B (fingerprint crc {hello.fingerprint_crc:08x}); "
                f"{container.path} has {shape[0]} x {shape[1]} of {shape[2]} B (crc {crc:08x})"
            )


def _history(container: Container, store: StoreConfig) -> tuple[UsageHistory, str] | None:
    """The coordinator's own usage history (every routed request, saved after each turn): it ranks the
    experts ``--replicas`` holds twice. The workers keep theirs (``.workerR`` beside it for local ones)."""
    if store.history_path is None:
        return None
    fingerprint = container_fingerprint(container)
    return UsageHistory.load(store.history_path, container.n_experts, fingerprint), str(store.history_path)


def _owners(container: Container, hellos: list[Hello], expert_map: str | Path | None) -> torch.Tensor:
    layers, experts = len(container.moe_layers), container.n_experts
    if expert_map is not None:
        return read_expert_map(expert_map, [h.rank for h in hellos], layers, experts)
    return measured_owners(hellos, layers, experts)


def _set_up(joined: list[tuple[Hello, Link]], holders: Holders, timeout_s: float) -> dict[int, str]:
    """Every worker gets what it holds at once (they open their stores side by side), then each READY
    -> rank -> why, for those lost meanwhile (a closed link, no answer); one that refuses its share is
    a ShareRefused."""
    lost: dict[int, str] = {}
    for hello, link in joined:
        try:
            send_setup(link, hello, wire.tensor_bytes(holders.held_by(hello.rank)).tobytes(), timeout_s)
        except WorkerError as exc:
            lost[hello.rank] = str(exc)
    for hello, link in joined:
        if hello.rank in lost:
            continue
        try:
            wait_ready(link, hello, timeout_s)
        except ShareRefused:
            raise
        except WorkerError as exc:
            lost[hello.rank] = str(exc)
    return lost
