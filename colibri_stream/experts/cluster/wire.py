"""What coordinator and workers say to each other: length-prefixed frames over one TCP socket per worker
(colibri_stream/experts/cluster/transport.py). One socket per worker, not one gloo group for all: a
timed-out gloo receive closes every pair of its group, so one lost worker cut the coordinator off from
the others; a socket's failure is its own (docs/benchmarks-log.md, "Workers: failover, rejoin, measured
shares and the transport").

Every frame is a fixed head, int64 [HEAD] = (op, payload bytes, then up to VALUES values), and a payload
of that many bytes: tensors' bytes back to back, 8-byte types first so every view starts aligned.

    both, before any other  AUTH      the cluster key handshake (auth.py, handshake.py); every later frame is
                                      sealed: head | payload | tag (TAG_BYTES, over both)
    coordinator -> worker   SETUP     rank; payload: uint8 [MoE layers, experts], 1 where this worker holds
                                      the expert (its share and its replicas); reply READY
                            SUM       layer, rows, topk, dim, dtype, flags, prefetch layer, prefetches,
                                      assigned; payload: prefetch ids | assigned ids | ids [rows, topk] |
                                      weights [rows, topk] f32 | x [rows, dim]
                                      reply SUM: float64 [rows, dim], the assigned experts' part of the sum
                            PREFETCH  layer, prefetches; payload: the guess's expert ids (no reply)
                            STATS     reply STATS: float64 [STATS_FIELDS]
                            END_TURN  persist the usage history (no reply)
                            SHUTDOWN  the worker exits
                            REFUSE    payload: why (a second worker with a serving rank); the worker exits
    worker -> coordinator   HELLO     protocol, rank, MoE layers, experts, record bytes, RAM bytes, disk B/s,
                                      fingerprint crc, pid; payload: its host name (utf-8)
                            READY     payload: empty, or why it cannot take its share
                            ERROR     payload: why it cannot answer (a failing disk); it exits after
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import astuple, dataclass, fields
from enum import IntEnum
from typing import Any

import torch

from colibri_stream.errors import ColibriError
from storage.tiers.stats import StoreStats

PROTOCOL_VERSION = 3  # 3: the cluster key handshake, sealed frames
VALUES = 10
HEAD = struct.Struct(f"<{2 + VALUES}q")  # op, payload bytes, values
HOST_BYTES = 64

FLAG_ROWS_ALONE = 1  # the engine's rows_alone(): batched decode, each row computed as alone
FLAG_INT8_ACTIVATIONS = 2  # the engine's int8_activations()
FLAG_PROMPT_ROWS = 4  # the engine's prompt_rows(): a prompt's rows as tile GEMMs

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x's dtype travels as its index here
Spec = tuple[torch.dtype, tuple[int, ...]]  # one tensor of a payload
STATS_FIELDS = tuple(f.name for f in fields(StoreStats)) + ("ram_slots", "experts_held")
MAX_TEXT_BYTES = 4096  # an error text or host name in a payload
TAG_BYTES = 16  # a sealed frame's tag (auth.Seal)
FRAME_BYTES = HEAD.size + TAG_BYTES  # what a sealed frame adds to its payload


class Op(IntEnum):
    SUM = 1
    PREFETCH = 2
    STATS = 3
    END_TURN = 4
    SHUTDOWN = 5
    SETUP = 6
    HELLO = 7
    READY = 8
    ERROR = 9
    REFUSE = 10
    AUTH = 11


class WorkerError(ColibriError):
    """A worker that died, stalled past the timeout, refused its share or serves another model."""


@dataclass(frozen=True)
class Head:
    """A frame's head: what it is, how many payload bytes follow, its values."""

    op: Op
    payload_bytes: int
    values: tuple[int, ...]


@dataclass(frozen=True)
class Hello:
    """What a worker tells the coordinator when it joins (or rejoins)."""

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


def encode_head(op: Op, payload_bytes: int, *values: int) -> bytes:
    if len(values) > VALUES:
        raise ValueError(f"a frame carries at most {VALUES} values, got {len(values)}")
    return HEAD.pack(int(op), payload_bytes, *values, *([0] * (VALUES - len(values))))


def decode_head(raw: bytes | bytearray | memoryview) -> Head:
    op, size, *values = HEAD.unpack(raw)
    if op not in Op._value2member_map_ or size < 0:
        raise WorkerError(f"not a colibri-stream frame (op {op}, {size} payload bytes): another program on the port?")
    return Head(Op(op), size, tuple(values))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes without a copy where it is contiguous (bf16 too: numpy has no bf16, uint8 does)."""
    array: Any = tensor.contiguous().view(-1).view(torch.uint8).numpy()  # numpy's stubs: not a Buffer
    return memoryview(array)


def unpack(payload: torch.Tensor, specs: list[Spec]) -> list[torch.Tensor]:
    """The tensors of a uint8 payload, given each one's dtype and shape in order."""
    if payload.numel() != payload_bytes(specs):
        raise ValueError(f"payload of {payload.numel()} bytes, the head describes {payload_bytes(specs)}")
    out, start = [], 0
    for dtype, shape in specs:
        n = payload_bytes([(dtype, shape)])
        out.append(payload[start : start + n].view(dtype).view(shape))
        start += n
    return out


def payload_bytes(specs: list[Spec]) -> int:
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for dtype, shape in specs)


def sum_payload_specs(rows: int, topk: int, dim: int, dtype: torch.dtype, prefetches: int, assigned: int) -> list[Spec]:
    return [
        (torch.int64, (prefetches,)),
        (torch.int64, (assigned,)),
        (torch.int64, (rows, topk)),
        (torch.float32, (rows, topk)),
        (dtype, (rows, dim)),
    ]


def hello_values(hello: Hello) -> tuple[int, ...]:
    return (
        PROTOCOL_VERSION,
        hello.rank,
        hello.moe_layers,
        hello.n_experts,
        hello.record_bytes,
        hello.ram_bytes,
        hello.disk_bytes_per_s,
        hello.fingerprint_crc,
        hello.pid,
    )


def read_hello(values: tuple[int, ...], host: bytes) -> Hello:
    protocol, rank, layers, experts, record, ram, disk, crc, pid = values[:9]
    name = host[:HOST_BYTES].decode(errors="replace")
    if protocol != PROTOCOL_VERSION:
        raise WorkerError(f"worker {rank} ({name}) speaks protocol {protocol}, this coordinator {PROTOCOL_VERSION}")
    if min(rank, layers, experts, record, ram, disk) < 0:
        raise WorkerError(f"worker {rank} ({name}) said a negative count in its HELLO: {values[:9]}")
    return Hello(rank, name, pid, layers, experts, record, ram, disk, crc)


def stats_tensor(stats: StoreStats, ram_slots: int, experts_held: int) -> torch.Tensor:
    values = [float(value) for value in astuple(stats)] + [ram_slots, experts_held]  # in STATS_FIELDS order
    return torch.tensor(values, dtype=torch.float64)


def read_stats(values: torch.Tensor) -> tuple[StoreStats, int, int]:
    """A worker's counters; a WorkerError when they are not counters (negative, NaN, past 2^62)."""
    if not bool(((values >= 0) & (values < 2.0**62)).all()):  # NaN compares false
        raise WorkerError(f"a worker sent STATS that are not counters: {values.tolist()[:4]} ...")
    raw = dict(zip(STATS_FIELDS, values.tolist(), strict=True))
    stats = StoreStats(**{f.name: raw[f.name] if f.type == "float" else int(raw[f.name]) for f in fields(StoreStats)})
    return stats, int(raw["ram_slots"]), int(raw["experts_held"])
