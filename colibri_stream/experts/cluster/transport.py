"""One TCP link between the coordinator and one worker: frames (wire.py) sent and received with
deadlines, replies matched to their requests in order.

The socket is non-blocking and every wait is a poll with the time left, so a send and a receive can run
in two threads at once (the forward pass and a server's dashboard) without sharing a socket timeout. A
worker answers its requests in order; the coordinator queues a Reply per request that has one, and
whoever waits for a reply reads frames off the socket until its own is filled (a dashboard's stats
request may read a MoE layer's reply on the way, into that layer's buffer). A link that fails (closed,
silent past its deadline, a frame it cannot read) is closed for good: every later call raises the same
WorkerError at once, and no other link is touched.

Nothing a peer sends is allocated before it is checked: a head's payload size against the limit the
receiver gives for that step (the geometry of the model, or a text's bound), and once the link is sealed
(auth.py, after the key handshake) its tag, over head and payload, before it is used. A frame that fails
either ends the link.
"""

from __future__ import annotations

import select
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.auth import Seal
from colibri_stream.experts.cluster.wire import TAG_BYTES, Head, Op, WorkerError

CONNECT_RETRY_S = 0.1
# keepalive: first probe after 30 s of silence, then every 10 s, 6 unanswered -> the link is dead (~90 s)
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 6
Bytes = bytes | bytearray | memoryview
Limit = int | Callable[[Head], int]  # the most payload bytes a frame may announce (given its head)


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
        self.seal: Seal | None = None  # set once the key handshake is done: every later frame is tagged
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
            head = wire.encode_head(op, size, *values)
            frame = [memoryview(head), *views]
            if self.seal is not None:
                frame.append(memoryview(self.seal.seal(head, views)))
            try:
                self._send_all(frame, _deadline(timeout_s))
            except (OSError, TimeoutError) as exc:
                raise self._fail(exc, f"sending {op.name.lower()}", timeout_s) from None
            self.bytes_sent += sum(view.nbytes for view in frame)

    def _send_all(self, views: list[memoryview], deadline: float | None) -> None:
        while views:
            try:
                sent = self.sock.sendmsg(views)
            except BlockingIOError:
                self._await(select.POLLOUT, deadline)
                continue
            _consume(views, sent)

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
        expected = self._pending[0] if self._pending else None
        allowed = expected.out.nbytes if expected is not None else 0

        def limit(head: Head) -> int:
            return wire.MAX_TEXT_BYTES if head.op == Op.ERROR else allowed

        try:
            head, raw = self._read_head(deadline, limit, what)
            if head.op == Op.ERROR:
                text = self._read_payload(head, raw, deadline).decode(errors="replace")
                raise WorkerError(f"{self.name}: {text}")
            if expected is None or head.op != expected.op or head.payload_bytes != expected.out.nbytes:
                raise WorkerError(f"{self.name}, {what}: unexpected {head.op.name} frame of {head.payload_bytes} B")
            self._pending.popleft()
            self._receive_payload(raw, wire.tensor_bytes(expected.out), deadline)
            expected.done = True
        except (OSError, TimeoutError) as exc:
            raise self._fail(exc, what, timeout_s) from None
        except WorkerError as exc:
            raise self._fail(exc, what, timeout_s) from None

    def receive(self, timeout_s: float | None, what: str, limit: Limit) -> tuple[Head, bytearray]:
        """The next frame whole (head, payload): a worker's next request, a handshake's answer; a frame
        announcing more than ``limit`` payload bytes ends the link before anything is allocated."""
        deadline = _deadline(timeout_s)
        with self._recv_lock:
            self._check()
            try:
                head, raw = self._read_head(deadline, limit, what)
                return head, self._read_payload(head, raw, deadline)
            except (OSError, TimeoutError) as exc:
                raise self._fail(exc, what, timeout_s) from None
            except WorkerError as exc:
                raise self._fail(exc, what, timeout_s) from None

    def _read_head(self, deadline: float | None, limit: Limit, what: str) -> tuple[Head, bytearray]:
        """(the head, its bytes) once its size is checked: a sealed frame's tag comes after its payload."""
        head_bytes = bytearray(wire.HEAD.size)
        self._receive_into([memoryview(head_bytes)], deadline)
        head = wire.decode_head(head_bytes)
        allowed = limit(head) if callable(limit) else limit
        if head.payload_bytes > allowed:
            raise WorkerError(
                f"{self.name}, {what}: a {head.op.name} frame of {head.payload_bytes} B, more than the {allowed} B "
                "it may carry here"
            )
        return head, head_bytes

    def _read_payload(self, head: Head, raw: bytearray, deadline: float | None) -> bytearray:
        payload = bytearray(head.payload_bytes)
        self._receive_payload(raw, memoryview(payload), deadline)
        return payload

    def _receive_payload(self, head: bytearray, payload: memoryview, deadline: float | None) -> None:
        """``payload`` filled, and once sealed its tag read in the same calls and checked."""
        if self.seal is None:
            self._receive_into([payload], deadline)
            return
        tag = bytearray(TAG_BYTES)
        self._receive_into([payload, memoryview(tag)], deadline)
        if not self.seal.frame_ok(head, payload, tag):
            raise WorkerError(f"{self.name}: a frame that does not match its cluster-key tag")

    def _receive_into(self, views: list[memoryview], deadline: float | None) -> None:
        """Fill ``views`` in order, as few calls as the socket allows."""
        views = [view for view in views if view.nbytes]
        while views:
            try:
                n = self.sock.recvmsg_into(views)[0] if len(views) > 1 else self.sock.recv_into(views[0])
            except BlockingIOError:
                self._await(select.POLLIN, deadline)
                continue
            if n == 0:
                raise ConnectionResetError("closed by the peer")
            self.bytes_received += n
            _consume(views, n)

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


def _consume(views: list[memoryview], done: int) -> None:
    """Drop the ``done`` bytes sent or received from the front of ``views`` (a part cut short keeps its rest)."""
    while done and views:
        if done >= views[0].nbytes:
            done -= views[0].nbytes
            views.pop(0)
        else:
            views[0], done = views[0][done:], 0


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
