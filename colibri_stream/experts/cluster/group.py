"""``connect``: from the coordinator's flags to a DistributedExperts store — start local workers if asked,
form the group, check every worker serves this model, hand out the shares, wait until all are ready."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from colibri_stream.checkpoint.fingerprint import container_fingerprint
from colibri_stream.errors import ColibriError
from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.coordinator import DistributedExperts
from colibri_stream.experts.cluster.local import LOCALHOST, LocalWorkers, free_port
from colibri_stream.experts.cluster.rendezvous import host_group
from colibri_stream.experts.cluster.shares import measured_owners, read_expert_map
from colibri_stream.experts.cluster.wire import Hello, Op, WorkerError
from storage.container import Container
from storage.tiered import StoreConfig
from storage.trace import TraceWriter

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 600.0


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
        if self.timeout_s <= 0:
            raise ColibriError(f"--worker-timeout must be > 0 seconds, got {self.timeout_s:g}")
        return world


def connect(
    container: Container, options: ClusterOptions, store: StoreConfig, trace: TraceWriter | None = None
) -> DistributedExperts:
    """The store over the workers. With local workers, ``store``'s budgets are split evenly between them."""
    world = options.checked_world_size()
    port = options.master_port or free_port()
    local = None
    if options.local_workers:
        flags = lambda rank: local_worker_flags(store, options.local_workers, rank)  # noqa: E731
        local = LocalWorkers.start(str(container.path), options.local_workers, port, flags)
    try:
        checks = local.check if local else _nothing
        host_group(options.master_addr, port, world, options.connect_timeout_s, checks, options.timeout_s)
        hellos = [_receive_hello(rank, options.timeout_s) for rank in range(1, world)]
        _check_same_model(container, hellos)
        owners = _owners(container, hellos, options.expert_map)
        for hello in hellos:
            dist.send(wire.header(Op.SETUP), hello.rank, tag=wire.TAG_CONTROL)
            dist.send(owners, hello.rank, tag=wire.TAG_CONTROL)
        for hello in hellos:
            _receive_ready(hello, options.timeout_s)
    except BaseException:
        if local is not None:
            local.stop(kill=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return DistributedExperts(container, hellos, owners, options.timeout_s, store.prefetch, local, trace)


def local_worker_flags(store: StoreConfig, count: int, rank: int) -> list[str]:
    """A local worker's store flags: 1/count of the coordinator's RAM and VRAM budgets, its policy, I/O,
    prefetch and preload settings, and its own usage-history file beside the coordinator's (``.workerR``)."""
    flags = ["--ram", str(store.ram_bytes // count), "--policy", store.policy, "--io-threads", str(store.threads)]
    flags += ["--direct" if store.direct else "--buffered"]
    if store.vram_bytes:
        flags += ["--vram", str(store.vram_bytes // count), "--vram-device", store.vram_device]
    if not store.prefetch:
        flags.append("--no-prefetch")
    if not store.preload:
        flags.append("--no-preload")
    if store.history_path is not None:
        flags += ["--history", f"{store.history_path}.worker{rank}"]
    return flags


def _nothing() -> None:
    pass


def _receive_hello(rank: int, timeout_s: float) -> Hello:
    values = torch.empty(8, dtype=torch.int64)
    host = torch.empty(wire.HOST_BYTES, dtype=torch.uint8)
    for tensor in (values, host):
        wire.wait(dist.irecv(tensor, rank, tag=wire.TAG_CONTROL), timeout_s, f"worker {rank}, joining")
    return wire.read_hello(rank, values, host)


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


def _owners(container: Container, hellos: list[Hello], expert_map: str | Path | None) -> torch.Tensor:
    layers, experts = len(container.moe_layers), container.n_experts
    if expert_map is not None:
        return read_expert_map(expert_map, [h.rank for h in hellos], layers, experts)
    return measured_owners(hellos, layers, experts)


def _receive_ready(hello: Hello, timeout_s: float) -> None:
    length = torch.empty(1, dtype=torch.int64)
    wire.wait(dist.irecv(length, hello.rank, tag=wire.TAG_CONTROL), timeout_s, f"{hello.name()}, setting up")
    if int(length):
        text = torch.empty(int(length), dtype=torch.uint8)
        wire.wait(dist.irecv(text, hello.rank, tag=wire.TAG_CONTROL), timeout_s, f"{hello.name()}, setting up")
        raise WorkerError(f"{hello.name()} cannot take its share: {bytes(text.tolist()).decode(errors='replace')}")
