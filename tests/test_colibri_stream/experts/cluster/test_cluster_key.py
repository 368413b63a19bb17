"""Only the cluster's own processes take part (issue #70): a client without the cluster key (one speaking
the old protocol, one speaking the new one with no key or a wrong one) cannot join or rejoin, and the
tokens stay one process's; a worker does not serve a coordinator without the key either. Frames
announcing huge sizes, in both directions, are refused before anything is allocated, in one line."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from colibri_stream.experts.cluster import auth, wire
from colibri_stream.experts.cluster.auth import COORDINATOR_ROLE, WORKER_ROLE, Seal
from colibri_stream.experts.cluster.handshake import check_worker, prove_to_coordinator
from colibri_stream.experts.cluster.rendezvous import MAX_GREETING, Listener
from colibri_stream.experts.cluster.transport import Link
from colibri_stream.experts.cluster.wire import Op, WorkerError
from colibri_stream.experts.cluster.worker import WorkerOptions, run_worker
from colibri_stream.planning.budget import StoreOptions

KEY = auth.new_key_text().encode()
HUGE = (1 << 50, 1 << 30)  # one no allocator grants, one it does (1 GiB would show in the RSS)
RSS_SLACK = 50 * 1024 * 1024


# ------------------------------------------------------------------------------ hand-written peers
def old_hello(rank: int = 1, crc: int = 0) -> bytes:
    """A protocol-2 HELLO (what colibri-stream sent before the key): no handshake."""
    values = (2, rank, 2, 16, 1024, 1 << 20, 0, crc, os.getpid())
    return wire.encode_head(Op.HELLO, 4, *values) + b"evil"


def read_frame(sock: socket.socket) -> tuple[wire.Head, bytes]:
    """One unsealed frame (a REFUSE, a handshake's answer); (a SHUTDOWN head, b"") once the peer closed."""
    raw = _exactly(sock, wire.HEAD.size)
    if raw is None:
        return wire.Head(Op.SHUTDOWN, 0, ()), b""
    head = wire.decode_head(raw)
    return head, _exactly(sock, min(head.payload_bytes, wire.MAX_TEXT_BYTES)) or b""


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def new_protocol_client(port: int, key: bytes | None) -> tuple[wire.Head, bytes]:
    """A client that opens the handshake; ``key`` None: it makes up a proof. -> what the coordinator said."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        mine = auth.nonce()
        sock.sendall(wire.encode_head(Op.AUTH, len(mine), wire.PROTOCOL_VERSION) + mine)
        head, payload = read_frame(sock)
        assert head.op == Op.AUTH and len(payload) == 64
        theirs = payload[:32]
        proof = auth.proof(key, WORKER_ROLE, mine, theirs) if key else os.urandom(32)
        sock.sendall(wire.encode_head(Op.AUTH, len(proof)) + proof)
        return read_frame(sock)


def old_protocol_client(port: int) -> tuple[wire.Head, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(old_hello())
        return read_frame(sock)


def rogue_attempts(port: int) -> list[tuple[wire.Head, bytes]]:
    """The old protocol, the new one without a key, the new one with another key."""
    other = auth.new_key_text().encode()
    return [old_protocol_client(port), new_protocol_client(port, None), new_protocol_client(port, other)]


def assert_all_refused(answers: list[tuple[wire.Head, bytes]]) -> None:
    for head, payload in answers:
        assert head.op == Op.REFUSE, head
        assert b"cluster key" in payload


# ---------------------------------------------------------------------------------------- helpers
def rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.fixture
def thread_errors() -> Iterator[list[str]]:
    """Exceptions that escaped a thread (each would print a traceback)."""
    seen: list[str] = []
    saved = threading.excepthook
    threading.excepthook = lambda args: seen.append(f"{args.exc_type.__name__}: {args.exc_value}")
    yield seen
    threading.excepthook = saved


@pytest.fixture
def listener() -> Iterator[Listener]:
    served = Listener("127.0.0.1", 0, 10.0, KEY)
    yield served
    served.close()


def joined(listener: Listener, within: float = 10.0) -> wire.Hello | None:
    try:
        hello, link = listener.joined.get(timeout=within)
    except Exception:
        return None
    link.close()
    return hello


# ----------------------------------------------------------------------------- coordinator's side
def test_only_a_client_with_the_key_joins(listener, caplog, thread_errors):
    caplog.set_level(logging.WARNING, "colibri_stream.experts.cluster.rendezvous")
    assert_all_refused(rogue_attempts(listener.port))
    assert joined(listener, within=0.5) is None  # none of them reached the coordinator
    refusals = [r.getMessage() for r in caplog.records]
    assert len(refusals) == 3 and all("\n" not in line for line in refusals)
    assert "without the cluster key handshake" in refusals[0] and "cluster key" in refusals[2]

    link = Link(socket.create_connection(("127.0.0.1", listener.port)), "the coordinator")  # the real one
    prove_to_coordinator(link, KEY, 10, "test")
    hello = wire.Hello(1, "host", os.getpid(), 2, 16, 1024, 1 << 20, 0, 7)
    link.send(Op.HELLO, [b"host"], wire.hello_values(hello), 10)
    got = joined(listener)
    link.close()
    assert got is not None and got.rank == 1 and got.fingerprint_crc == 7
    assert not thread_errors


@pytest.mark.parametrize("size", HUGE)
def test_a_huge_frame_to_the_coordinator_allocates_nothing(listener, size, caplog, thread_errors):
    caplog.set_level(logging.WARNING, "colibri_stream.experts.cluster.rendezvous")
    before = rss()
    # before the handshake (anyone), then sealed after it (a key holder announcing a huge HELLO)
    with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as sock:
        sock.sendall(wire.encode_head(Op.AUTH, size, wire.PROTOCOL_VERSION))
        assert read_frame(sock)[0].op == Op.SHUTDOWN  # dropped, not waited on
    link = Link(socket.create_connection(("127.0.0.1", listener.port)), "the coordinator")
    prove_to_coordinator(link, KEY, 10, "test")
    assert link.seal is not None
    head = wire.encode_head(Op.HELLO, size, *wire.hello_values(wire.Hello(1, "h", 1, 2, 16, 1024, 1, 0, 7)))
    link.sock.sendall(head)  # a huge size: refused before any payload (or its tag) is read
    time.sleep(0.3)  # what a bytearray(size) would have taken by now
    grown = rss() - before
    with pytest.raises(WorkerError):
        link.receive(10, "the refusal", 0)  # the coordinator closed it
    link.close()
    assert grown < RSS_SLACK
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(f"{size} B" in line and "\n" not in line for line in lines)
    assert joined(listener, within=0.2) is None and not thread_errors


def test_connections_in_their_handshake_are_bounded(listener):
    silent = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(MAX_GREETING)]
    time.sleep(0.5)  # each greeted by now: the bound is reached
    extra = socket.create_connection(("127.0.0.1", listener.port), timeout=10)
    assert extra.recv(1) == b""  # closed at once, not greeted (nor given a thread)
    for sock in [*silent, extra]:
        sock.close()
    time.sleep(0.5)  # their greeters see the close and free the slots
    assert_all_refused(rogue_attempts(listener.port))  # greeted again


# ---------------------------------------------------------------------------------- worker's side
class FakeCoordinator:
    """A listening socket a worker dials; ``script(sock)`` runs on the accepted connection."""

    def __init__(self, script):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self.thread.start()

    def _serve(self, script) -> None:
        conn, _ = self.server.accept()
        try:
            script(conn)
        except OSError:
            pass
        finally:
            time.sleep(0.5)  # the worker reads what was sent before it sees the close
            conn.close()
            self.server.close()


def worker_against(container: Path, script, key_file: Path) -> tuple[str, int]:
    """(the worker's WorkerError, its RSS growth) against a fake coordinator."""
    fake = FakeCoordinator(script)
    options = WorkerOptions(
        container, 1, 2, "127.0.0.1", fake.port, StoreOptions(ram="50%"), 0, 10.0, key_file=key_file
    )
    before = rss()
    with pytest.raises(WorkerError) as raised:
        run_worker(options)
    grown = rss() - before
    fake.thread.join(10)
    return str(raised.value), grown


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "cluster.key"
    path.write_bytes(KEY + b"\n")
    path.chmod(0o600)
    return path


def test_a_worker_does_not_serve_a_coordinator_without_its_key(make_container, key_file):
    def rogue(conn: socket.socket) -> None:  # answers the handshake with a proof under another key
        head, payload = read_frame(conn)
        assert head.op == Op.AUTH
        mine = auth.nonce()
        conn.sendall(wire.encode_head(Op.AUTH, 64) + mine + auth.proof(b"x" * 64, COORDINATOR_ROLE, payload, mine))
        read_frame(conn)

    error, _ = worker_against(make_container("deepseek_v3", "int4"), rogue, key_file)
    assert "does not hold this worker's cluster key" in error and "\n" not in error


@pytest.mark.parametrize("size", HUGE)
@pytest.mark.parametrize("sealed", [False, True])
def test_a_huge_frame_to_a_worker_allocates_nothing(make_container, key_file, size, sealed):
    def huge(conn: socket.socket) -> None:
        if not sealed:  # whoever bound the port: a head instead of the handshake's answer
            read_frame(conn)
            conn.sendall(wire.encode_head(Op.AUTH, size))
            return
        link = Link(conn, "a worker")
        check_worker(link, KEY, 10)  # a key holder announcing a huge share table
        link.receive(10, "hello", wire.HOST_BYTES)
        assert link.seal is not None
        head = wire.encode_head(Op.SETUP, size, 1)
        conn.sendall(head)
        time.sleep(0.5)

    error, grown = worker_against(make_container("deepseek_v3", "int4"), huge, key_file)
    assert f"{size} B" in error and "\n" not in error
    assert grown < RSS_SLACK


def test_a_worker_without_a_key_is_refused_in_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv(auth.KEY_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    with pytest.raises(auth.ClusterKeyError, match="no cluster key"):
        auth.load_key(None, create=False)
    created = auth.load_key(None, create=True)  # a coordinator makes one, for its user only
    path = auth.default_key_path()
    assert path.stat().st_mode & 0o777 == 0o600 and auth.load_key(None, create=False) == created
    path.chmod(0o644)
    with pytest.raises(auth.ClusterKeyError, match="other users"):
        auth.load_key(None, create=False)


def test_sealed_frames_cannot_be_forged_replayed_or_reflected():
    def link_seals(nonces=None) -> tuple[Seal, Seal]:
        nonces = nonces or (auth.nonce(), auth.nonce())
        return Seal.for_side(KEY, COORDINATOR_ROLE, *nonces), Seal.for_side(KEY, WORKER_ROLE, *nonces)

    head, payload = wire.encode_head(Op.SUM, 3), memoryview(b"abc")
    coordinator, worker = link_seals()
    tag = coordinator.seal(head, [payload])
    assert len(tag) == wire.TAG_BYTES and not coordinator.frame_ok(head, payload, tag)  # reflected to its sender
    for forged_head, forged_payload in ((wire.encode_head(Op.SUM, 4), payload), (head, memoryview(b"abd"))):
        assert not link_seals((b"w", b"c"))[1].frame_ok(forged_head, forged_payload, tag)  # another link's key
        _, fresh = link_seals()
        assert not fresh.frame_ok(forged_head, forged_payload, tag)
    assert worker.frame_ok(head, payload, tag) and not worker.frame_ok(head, payload, tag)  # replayed: counter moved
    coordinator, worker = link_seals()
    first, second = coordinator.seal(head, [payload]), coordinator.seal(head, [payload[:1], payload[1:]])
    assert not worker.frame_ok(head, payload, second)  # reordered: the second frame's tag first
    coordinator, worker = link_seals()
    first, second = coordinator.seal(head, [payload]), coordinator.seal(head, [payload[:1], payload[1:]])
    assert worker.frame_ok(head, payload, first) and worker.frame_ok(head, payload, second)  # parts or whole: one tag
