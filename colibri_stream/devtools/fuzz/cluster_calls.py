"""What runs a cluster-frames case (cluster_frames.py has the inputs and the edits): hostile frames to a
coordinator's listener and to a worker, both before the key handshake (anyone on the LAN: the file's
bytes as they are) and after it (a peer holding the key: each frame of the file sealed, so the geometry
checks behind the tags are what is fuzzed).

The base inputs are two frame files written from the base container (``write_bases``): what a worker
sends when it joins and answers (HELLO, READY, a STATS and a SUM reply), and what a coordinator sends a
worker (SETUP, SUM, PREFETCH, STATS, END_TURN, SHUTDOWN). The call targets run the real listener or the
real ``run_worker`` in the case's child against a scripted peer. A refused peer is the expected outcome
(a typed one-line error, or the listener's one logged line); BAD is a traceback, an exception escaping a
thread, a hang, or more than RSS_SLACK of memory while the frames were read.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

from colibri_stream.checkpoint.fingerprint import container_fingerprint
from colibri_stream.devtools.fuzz.cluster_frames import HEAD, TO_COORDINATOR, TO_WORKER, split_frames
from colibri_stream.experts.cluster import auth, wire
from colibri_stream.experts.cluster.handshake import check_worker, prove_to_coordinator
from colibri_stream.experts.cluster.members import set_up
from colibri_stream.experts.cluster.rendezvous import Listener
from colibri_stream.experts.cluster.transport import Link, Reply
from colibri_stream.experts.cluster.wire import Op, WorkerError
from colibri_stream.experts.cluster.worker import WorkerOptions, run_worker
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.planning.geometry import container_args
from storage.container.reader import Container

KEY = b"fuzz-cluster-key-" + b"0" * 47  # 64 characters: the peer that holds the key
TIMEOUT_S = 5.0
RSS_SLACK = 50 * 1024 * 1024
assert HEAD.size == wire.HEAD.size, "cluster_frames.HEAD is wire.HEAD"


# ---------------------------------------------------------------------------------- base inputs
def frame(op: Op, payload: bytes = b"", *values: int) -> bytes:
    return wire.encode_head(op, len(payload), *values) + payload


def write_bases(base_dir: str) -> None:
    """The two frame files under ``base_dir``, valid for the model of its ``container``."""
    base = Path(base_dir)
    container = Container(base / "container")
    args = container_args(container)
    layers, experts, dim, topk = len(container.moe_layers), container.n_experts, args.dim, args.n_activated_experts
    crc = wire.fingerprint_crc(container_fingerprint(container))
    hello = wire.Hello(1, "fuzz", 1, layers, experts, container.layout.record_bytes, 1 << 30, 0, crc)
    stats = torch.zeros(len(wire.STATS_FIELDS), dtype=torch.float64)
    to_coordinator = [
        frame(Op.HELLO, b"fuzz", *wire.hello_values(hello)),
        frame(Op.READY),
        frame(Op.STATS, bytes(wire.tensor_bytes(stats))),
        frame(Op.SUM, bytes(8 * dim)),  # float64 [1, dim]
    ]
    layer = container.moe_layers[0]
    ids = torch.arange(topk, dtype=torch.int64).view(1, topk)
    tensors = (torch.tensor([0]), ids.view(-1), ids, torch.full((1, topk), 1.0 / topk), torch.ones(1, dim))
    payload = b"".join(bytes(wire.tensor_bytes(t)) for t in tensors)
    to_worker = [
        frame(Op.SETUP, bytes([1]) * (layers * experts), 1),
        frame(Op.SUM, payload, layer, 1, topk, dim, 0, 0, layer, 1, topk),
        frame(Op.PREFETCH, bytes(wire.tensor_bytes(torch.tensor([1]))), layer, 1),
        frame(Op.STATS),
        frame(Op.END_TURN),
        frame(Op.SHUTDOWN),
    ]
    (base / "cluster").mkdir(parents=True, exist_ok=True)
    (base / TO_COORDINATOR).write_bytes(b"".join(to_coordinator))
    (base / TO_WORKER).write_bytes(b"".join(to_worker))


def send_frames(sock: socket.socket, data: bytes, seal: auth.Seal | None) -> None:
    """The file's bytes as they are (no seal), or each frame with its tag."""
    try:
        if seal is None:
            sock.sendall(data)
            return
        for head, payload in split_frames(data):
            sock.sendall(head + payload + seal.seal(head, [memoryview(payload)]))
    except OSError:
        pass  # the receiver dropped the link: what a refusal looks like


# ------------------------------------------------------------------------------------- judging
@contextmanager
def bounded_memory() -> Iterator[None]:
    """Fails (AssertionError: a BAD traceback) when the RSS peaked RSS_SLACK above its start, or when
    an exception escaped any thread meanwhile (each prints a traceback)."""
    process, stop, peak = psutil.Process(), threading.Event(), [0]
    start = process.memory_info().rss
    escaped: list[str] = []
    saved = threading.excepthook
    threading.excepthook = lambda args: escaped.append(f"{args.exc_type.__name__}: {args.exc_value}")

    def sample() -> None:
        while not stop.wait(0.01):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield
    finally:  # checked on the way out of a refusal too (an AssertionError then replaces the typed error)
        stop.set()
        sampler.join()
        threading.excepthook = saved
        grown = peak[0] - start
        if grown >= RSS_SLACK or escaped:
            raise AssertionError(f"RSS grew {grown >> 20} MiB reading the frames; escaped threads: {escaped}")


# --------------------------------------------------------------------------- to the coordinator
def to_coordinator_raw(frames: str) -> int:
    """Anyone: the file's bytes sent to a listener as they are (no handshake)."""
    return _to_coordinator(Path(frames), sealed=False)


def to_coordinator_sealed(frames: str) -> int:
    """A key holder: the handshake, then each frame of the file sealed; the coordinator sets it up and
    asks it for STATS and one SUM."""
    return _to_coordinator(Path(frames), sealed=True)


def _to_coordinator(frames: Path, sealed: bool) -> int:
    data = frames.read_bytes()
    container = Container(frames.parent.parent / "container")
    with bounded_memory():
        listener = Listener("127.0.0.1", 0, TIMEOUT_S, KEY)
        try:
            client = threading.Thread(target=_client, args=(listener.port, data, sealed), daemon=True)
            client.start()
            deadline = time.monotonic() + 3 * TIMEOUT_S
            while time.monotonic() < deadline:  # joined, or the client done (refused: one logged line)
                try:
                    hello, link = listener.joined.get(timeout=0.05)
                except queue.Empty:
                    if client.is_alive():
                        continue
                    break
                _coordinate(link, hello, container)
                break
            client.join(3 * TIMEOUT_S)
            assert not client.is_alive(), "the client still sends after the coordinator was done with it"
        finally:
            listener.close()
    return 0


def _client(port: int, data: bytes, sealed: bool) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        seal = None
        if sealed:
            link = Link(sock.dup(), "the coordinator")
            try:
                prove_to_coordinator(link, KEY, TIMEOUT_S, "the fuzz listener")
            except WorkerError:
                return
            seal = link.seal
            link.sock.close()
            sock.setblocking(True)
        send_frames(sock, data, seal)
        _drain(sock)


def _coordinate(link: Link, hello: wire.Hello, container: Container) -> None:
    """What a coordinator does with a joined worker: SETUP/READY, then a STATS and a SUM request."""
    shape = (len(container.moe_layers), container.n_experts)
    try:
        set_up(link, hello, bytes(shape[0] * shape[1]), TIMEOUT_S)
        stats = Reply(Op.STATS, torch.empty(len(wire.STATS_FIELDS), dtype=torch.float64), "stats")
        link.send(Op.STATS, [], (), TIMEOUT_S, stats)
        link.wait(stats, TIMEOUT_S)
        wire.read_stats(stats.out)
        dim = container_args(container).dim
        out = Reply(Op.SUM, torch.empty((1, dim), dtype=torch.float64), "layer")
        link.send(Op.SUM, [b"\0" * 8], (container.moe_layers[0], 1), TIMEOUT_S, out)
        link.wait(out, TIMEOUT_S)
    except WorkerError:
        pass  # lost or refused: one line in the real coordinator
    finally:
        link.close()


def _drain(sock: socket.socket) -> None:
    """Read what the peer says until it closes (or is silent for TIMEOUT_S)."""
    sock.settimeout(TIMEOUT_S)
    try:
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass


# -------------------------------------------------------------------------------- to a worker
def to_worker_raw(frames: str) -> int:
    """Whoever bound the port: the file's bytes as the answer to the worker's handshake."""
    return _to_worker(Path(frames), sealed=False)


def to_worker_sealed(frames: str) -> int:
    """A coordinator holding the key: the handshake, HELLO read, then each frame of the file sealed."""
    return _to_worker(Path(frames), sealed=True)


def _to_worker(frames: Path, sealed: bool) -> int:
    data = frames.read_bytes()
    key_file = frames.parent / "fuzz.key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(KEY)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    fake = threading.Thread(target=_fake_coordinator, args=(server, data, sealed), daemon=True)
    fake.start()
    container = frames.parent.parent / "container"
    options = WorkerOptions(container, 1, 2, "127.0.0.1", port, StoreOptions(ram="50%"), 0, TIMEOUT_S, key_file)
    with bounded_memory():
        try:
            return run_worker(options)
        finally:
            fake.join(3 * TIMEOUT_S)
            server.close()


def _fake_coordinator(server: socket.socket, data: bytes, sealed: bool) -> None:
    server.settimeout(3 * TIMEOUT_S)
    try:
        conn, _ = server.accept()
    except OSError:
        return
    with conn:
        seal = None
        if sealed:
            link = Link(conn.dup(), "a worker")
            try:
                check_worker(link, KEY, TIMEOUT_S)
                link.receive(TIMEOUT_S, "joining", wire.HOST_BYTES)
            except WorkerError:
                return
            seal = link.seal
            link.sock.close()
        else:
            _read_some(conn)  # the worker's AUTH
        conn.setblocking(True)
        sender = threading.Thread(target=send_frames, args=(conn, data, seal), daemon=True)
        sender.start()
        _drain(conn)
        sender.join(TIMEOUT_S)


def _read_some(sock: socket.socket) -> None:
    sock.settimeout(TIMEOUT_S)
    try:
        sock.recv(wire.HEAD.size + auth.NONCE_BYTES)
    except OSError:
        pass


CALLS: dict[str, Callable[[str], int]] = {
    "to_coordinator_raw": to_coordinator_raw,
    "to_coordinator_sealed": to_coordinator_sealed,
    "to_worker_raw": to_worker_raw,
    "to_worker_sealed": to_worker_sealed,
}
