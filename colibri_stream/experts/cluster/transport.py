"""One TCP link between the coordinator and one worker: frames (wire.py) sent and received with
deadlines, replies matched to their requests in order.

The socket is non-blocking and every wait is a poll with the time left, so a send and a receive can run
in two threads at once (the forward pass and a server's dashboard) without sharing a socket timeout. A
worker answers its requests in order; the coordinator queues a Reply per request that has one, and
whoever waits for a reply reads frames off the socket until its own is filled (a dashboard's stats
request may read a MoE layer's reply on the way, into that layer's buffer). A link that fails (closed,
silent past its deadline, a frame it cannot read) is closed for good: every later call raises the same
WorkerError at once, and no other link is touched.
"""

from __future__ import annotations

import select
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.wire import Head, Op, WorkerError

CONNECT_RETRY_S = 0.1
# keepalive: first probe after 30 s of silence, then every 10 s, 6 unanswered -> the link is dead (~90 s)
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 6
Bytes = bytes | bytearray | memoryview


@dataclass
class Reply:
    """A reply still to come: filled in place (``out``'s bytes) when its frame arrives."""

    op: Op
    out: torch.Tensor
    what: str
    done: bool = False


class Link:
    """A framed, ordered, deadline-bound connection to one peer named ``name`` in its errors."""

    def __init__(self, sock: socket.socket, name: str):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a layer's request is one small frame
        _keep_alive(sock)
        sock.setblocking(False)
        self.sock, self.name = sock, name
        self.failure: WorkerError | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._pending: deque[Reply] = deque()

    # ------------------------------------------------------------------------------------ sending
    def send(
        self, op: Op, parts: Sequence[Bytes], values: Sequence[int], timeout_s: float | None, reply: Reply | None = None
    ) -> None:
        """One frame; ``reply``: the answer this request gets, queued before the frame leaves."""
        views = [memoryview(part).cast("B") for part in parts]
        size = sum(view.nbytes for view in views)
        with self._send_lock:
            self._check()
            if reply is not None:
                self._pending.append(reply)
            try:
                self._send_all([memoryview(wire.encode_head(op, size, *values)), *views], _deadline(timeout_s))
            except (OSError, TimeoutError) as exc:
                raise self._fail(exc, f"sending {op.name.lower()}", timeout_s) from None
            self.bytes_sent += wire.HEAD.size + size

    def _send_all(self, views: list[memoryview], deadline: float | None) -> None:
        while views:
            try:
                sent = self.sock.sendmsg(views)
            except BlockingIOError:
                self._await(select.POLLOUT, deadline)
                continue
            while sent and views:  # drop what went out, keep the rest of a part cut short
                if sent >= views[0].nbytes:
                    sent -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0], sent = views[0][sent:], 0

    # ---------------------------------------------------------------------------------- receiving
    def wait(self, reply: Reply, timeout_s: float) -> torch.Tensor:
        """``reply``'s tensor once its frame is in (frames before it fill their own replies)."""
        deadline = time.monotonic() + timeout_s
        while not reply.done:
            self._check()
            if not self._recv_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise self._fail(TimeoutError(), reply.what, timeout_s)
            try:
                if not reply.done:
                    self._read_reply(deadline, reply.what, timeout_s)
            finally:
                self._recv_lock.release()
        return reply.out

    def _read_reply(self, deadline: float, what: str, timeout_s: float) -> None:
        try:
            head = self._read_head(deadline)
            if head.op == Op.ERROR:
                text = self._read_payload(head, deadline).decode(errors="replace")
                raise WorkerError(f"{self.name}: {text}")
            expected = self._pending.popleft() if self._pending else None
            if expected is None or head.op != expected.op or head.payload_bytes != expected.out.nbytes:
                raise WorkerError(f"{self.name}, {what}: unexpected {head.op.name} frame of {head.payload_bytes} B")
            self._receive_into(wire.tensor_bytes(expected.out), deadline)
            expected.done = True
        except (OSError, TimeoutError) as exc:
            raise self._fail(exc, what, timeout_s) from None
        except WorkerError as exc:
            raise self._fail(exc, what, timeout_s) from None

    def receive(self, timeout_s: float | None, what: str) -> tuple[Head, bytearray]:
        """The next frame whole (head, payload): a worker's next request, a handshake's answer."""
        deadline = _deadline(timeout_s)
        with self._recv_lock:
            self._check()
            try:
                head = self._read_head(deadline)
                return head, self._read_payload(head, deadline)
            except (OSError, TimeoutError) as exc:
                raise self._fail(exc, what, timeout_s) from None
            except WorkerError as exc:
                raise self._fail(exc, what, timeout_s) from None

    def _read_head(self, deadline: float | None) -> Head:
        raw = bytearray(wire.HEAD.size)
        self._receive_into(memoryview(raw), deadline)
        return wire.decode_head(raw)

    def _read_payload(self, head: Head, deadline: float | None) -> bytearray:
        payload = bytearray(head.payload_bytes)
        self._receive_into(memoryview(payload), deadline)
        return payload

    def _receive_into(self, view: memoryview, deadline: float | None) -> None:
        got = 0
        while got < view.nbytes:
            try:
                n = self.sock.recv_into(view[got:])
            except BlockingIOError:
                self._await(select.POLLIN, deadline)
                continue
            if n == 0:
                raise ConnectionResetError("closed by the peer")
            got += n
        self.bytes_received += got

    # ------------------------------------------------------------------------------------ faults
    def _await(self, event: int, deadline: float | None) -> None:
        """Until the socket is readable/writable; TimeoutError past ``deadline`` (None: no deadline)."""
        poller = select.poll()
        poller.register(self.sock, event)
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError
            if poller.poll(None if left is None else max(1, int(left * 1000))):
                return

    def _fail(self, exc: BaseException, what: str, timeout_s: float | None) -> WorkerError:
        """The link's one failure (the first one wins); the socket is shut so the peer sees it at once."""
        if self.failure is None:
            if isinstance(exc, WorkerError):
                self.failure = exc
            elif isinstance(exc, TimeoutError) and timeout_s is not None:
                self.failure = WorkerError(f"{self.name}, {what}: no answer within {timeout_s:g} s")
            else:
                detail = (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__
                self.failure = WorkerError(f"{self.name}, {what}: connection lost ({detail})")
            self.shut()
        return self.failure

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def shut(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more: nothing to shut

    def close(self) -> None:
        self.shut()
        self.sock.close()


def _keep_alive(sock: socket.socket) -> None:
    """TCP keepalive probes: a peer whose machine vanished (asleep, off the network: no FIN, no RST) is
    noticed within about KEEPALIVE_S even by a side that waits without a deadline (an idle worker)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if sys.platform == "linux":
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def dial(addr: str, port: int, timeout_s: float, name: str) -> Link:
    """A worker's link to its coordinator, retried until it listens (a worker may start first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((addr, port), timeout=max(0.1, deadline - time.monotonic()))
            return Link(sock, name)
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise WorkerError(
                    f"cannot reach the coordinator at {addr}:{port} within {timeout_s:g} s ({exc})"
                ) from None
            time.sleep(CONNECT_RETRY_S)
