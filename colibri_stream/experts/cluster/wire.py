"""What coordinator and workers say to each other over torch.distributed's gloo backend (point-to-point
CPU tensors; chosen over Ray by tools/bench_rpc.py: at decode sizes gloo's round trip is several times
cheaper, docs/benchmarks.md "Sharding experts over workers: the per-layer round trip").

Every message is a fixed header (int64 [HEADER]) and, where the header says so, one packed payload
(uint8) whose size the header gives; replies carry their own tag so a stats request from a server's
dashboard thread can never take a MoE layer's reply.

    coordinator -> worker   SUM       layer, rows, topk, dim, dtype, flags, prefetch layer, prefetches; payload:
                                      prefetch ids | ids [rows, topk] | weights [rows, topk] f32 | x [rows, dim]
                                      reply (TAG_SUM): float64 [rows, dim], the worker's share of the routed sum
                            PREFETCH  layer, prefetches; payload: the guess's expert ids (no reply)
                            STATS     reply (TAG_STATS): float64 [STATS_FIELDS]
                            END_TURN  persist the usage history (no reply)
                            SHUTDOWN  the worker exits
    worker -> coordinator   HELLO     protocol, MoE layers, experts, record bytes, RAM bytes, disk B/s, model
                                      fingerprint (crc32 of it), pid; then its host name (uint8 [HOST_BYTES])
                            READY     after SETUP (the owner table): 0, or the length of an error text sent next
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from colibri_stream.errors import ColibriError
from storage.stats import StoreStats

PROTOCOL_VERSION = 1
HEADER = 10
HOST_BYTES = 64
COORDINATOR = 0  # rank of the coordinator; workers are 1 .. world size - 1
TAG_SUM, TAG_STATS, TAG_CONTROL = 1, 2, 3

FLAG_ROWS_ALONE = 1  # the engine's rows_alone(): batched decode, each row computed as alone
FLAG_INT8_ACTIVATIONS = 2  # the engine's int8_activations()

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x's dtype travels as its index here
Spec = tuple[torch.dtype, tuple[int, ...]]  # one tensor of a payload
STATS_FIELDS = tuple(f.name for f in fields(StoreStats)) + ("ram_slots", "experts_held")


class Op(IntEnum):
    SUM = 1
    PREFETCH = 2
    STATS = 3
    END_TURN = 4
    SHUTDOWN = 5
    SETUP = 6


class WorkerError(ColibriError):
    """A worker that died, stalled past the timeout, refused its share or serves another model."""


@dataclass(frozen=True)
class Hello:
    """What a worker tells the coordinator when it joins."""

    rank: int
    host: str
    pid: int
    moe_layers: int
    n_experts: int
    record_bytes: int
    ram_bytes: int  # its expert budget
    disk_bytes_per_s: int  # measured at start (or given)
    fingerprint_crc: int

    def name(self) -> str:
        return f"worker {self.rank} ({self.host}, pid {self.pid})"


def fingerprint_crc(fingerprint: str) -> int:
    return zlib.crc32(fingerprint.encode())


def header(op: Op, *values: int) -> torch.Tensor:
    out = torch.zeros(HEADER, dtype=torch.int64)
    out[0] = int(op)
    out[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return out


def pack(*tensors: torch.Tensor) -> torch.Tensor:
    """One uint8 payload holding the tensors' bytes back to back."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def unpack(payload: torch.Tensor, specs: list[Spec]) -> list[torch.Tensor]:
    """The tensors ``pack`` wrote, given each one's dtype and shape in order (8-byte types first, so
    every view starts aligned)."""
    if payload.numel() != payload_bytes(specs):
        raise ValueError(f"payload of {payload.numel()} bytes, the header describes {payload_bytes(specs)}")
    out, start = [], 0
    for dtype, shape in specs:
        n = payload_bytes([(dtype, shape)])
        out.append(payload[start : start + n].view(dtype).view(shape))
        start += n
    return out


def payload_bytes(specs: list[Spec]) -> int:
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for dtype, shape in specs)


def sum_payload_specs(rows: int, topk: int, dim: int, dtype: torch.dtype, prefetches: int) -> list[Spec]:
    return [
        (torch.int64, (prefetches,)),
        (torch.int64, (rows, topk)),
        (torch.float32, (rows, topk)),
        (dtype, (rows, dim)),
    ]


def hello_tensor(hello: Hello) -> tuple[torch.Tensor, torch.Tensor]:
    values = (
        PROTOCOL_VERSION,
        hello.moe_layers,
        hello.n_experts,
        hello.record_bytes,
        hello.ram_bytes,
        hello.disk_bytes_per_s,
        hello.fingerprint_crc,
        hello.pid,
    )
    host = torch.zeros(HOST_BYTES, dtype=torch.uint8)
    encoded = hello.host.encode()[:HOST_BYTES]
    host[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    return torch.tensor(values, dtype=torch.int64), host


def read_hello(rank: int, values: torch.Tensor, host: torch.Tensor) -> Hello:
    protocol, layers, experts, record, ram, disk, crc, pid = values.tolist()
    name = bytes(host.tolist()).rstrip(b"\0").decode(errors="replace")
    if protocol != PROTOCOL_VERSION:
        raise WorkerError(f"worker {rank} ({name}) speaks protocol {protocol}, this coordinator {PROTOCOL_VERSION}")
    return Hello(rank, name, pid, layers, experts, record, ram, disk, crc)


def stats_tensor(stats: StoreStats, ram_slots: int, experts_held: int) -> torch.Tensor:
    values = [float(value) for value in astuple(stats)] + [ram_slots, experts_held]  # in STATS_FIELDS order
    return torch.tensor(values, dtype=torch.float64)


def read_stats(values: torch.Tensor) -> tuple[StoreStats, int, int]:
    raw = dict(zip(STATS_FIELDS, values.tolist(), strict=True))
    stats = StoreStats(**{f.name: raw[f.name] if f.type == "float" else int(raw[f.name]) for f in fields(StoreStats)})
    return stats, int(raw["ram_slots"]), int(raw["experts_held"])


def wait(work: dist.Work | None, seconds: float, what: str) -> None:
    """work.wait() within ``seconds``; a peer that died or stalled becomes a WorkerError saying ``what``."""
    try:
        # torch types isend/irecv as Work | None (None: this rank is outside the group, never so here)
        work.wait(timeout=timedelta(seconds=seconds))  # type: ignore[union-attr]
    except RuntimeError as exc:
        if "Timed out" in str(exc):
            raise WorkerError(f"{what}: no answer within {seconds:g} s") from None
        raise lost(exc, what) from None


def issue(start: Callable[[], dist.Work | None], what: str) -> dist.Work:
    """start() (an isend/irecv); one to a peer already known dead fails at once: a WorkerError too."""
    try:
        # torch types isend/irecv as Work | None (None: this rank is outside the group, never so here)
        return start()  # type: ignore[return-value]
    except RuntimeError as exc:
        raise lost(exc, what) from None


def lost(exc: RuntimeError, what: str) -> WorkerError:
    detail = str(exc).split("] ", 1)[-1].split(". ", 1)[0]  # gloo's "[file:line] Read error ...: reset"
    return WorkerError(f"{what}: connection lost ({detail})")
