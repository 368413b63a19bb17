"""Where workers find the coordinator: a TCP listener on --master-addr:--master-port, open as long as
the coordinator lives, so a worker can join at start or rejoin after it was lost.

A thread accepts; each connection gets its own short-lived thread that runs the cluster key handshake
(handshake.py), reads the worker's HELLO (within ``hello_timeout_s``) and hands (Hello, Link) to
``on_join``: at start a queue ``connect`` drains, later the coordinator's rejoin handshake. A connection
without the key, or that says nothing useful (a port scanner, another program, an older worker), is
refused in one logged line and closed; it never reaches the coordinator. At most MAX_GREETING
connections are greeted at once: more are closed as they come (threads and sockets stay bounded).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable

from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.handshake import check_worker
from colibri_stream.experts.cluster.transport import Link
from colibri_stream.experts.cluster.wire import Hello, Op, WorkerError

logger = logging.getLogger(__name__)
ACCEPT_POLL_S = 0.2  # how soon the accept thread sees close()
MAX_GREETING = 16  # connections in their handshake at once (a worker's takes milliseconds)

JoinHandler = Callable[[Hello, Link], None]


class Listener:
    """Accepts workers until ``close``; ``on_join`` may be swapped (start -> rejoin) at any time."""

    def __init__(self, addr: str, port: int, hello_timeout_s: float, key: bytes):
        try:
            self.sock = socket.create_server((addr, port))
        except OSError as exc:
            raise WorkerError(f"cannot listen for workers on {addr}:{port} ({exc.strerror or exc})") from None
        self.sock.settimeout(ACCEPT_POLL_S)
        self.port: int = self.sock.getsockname()[1]  # port 0: the one the OS picked
        self.address = f"{addr}:{self.port}"
        self.hello_timeout_s = hello_timeout_s
        self.key = key
        self._greeting = threading.BoundedSemaphore(MAX_GREETING)
        self.joined: queue.Queue[tuple[Hello, Link]] = queue.Queue()
        self.on_join: JoinHandler = lambda hello, link: self.joined.put((hello, link))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="colibri-workers-listener", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._greeting.acquire(blocking=False):
                logger.warning("a connection from %s:%s refused: %d others are joining", *peer[:2], MAX_GREETING)
                conn.close()
                continue
            name = f"a worker at {peer[0]}:{peer[1]}"
            threading.Thread(target=self._greet, args=(Link(conn, name),), daemon=True).start()

    def _greet(self, link: Link) -> None:
        try:
            hello = self._hello(link)
        except (WorkerError, OSError, ValueError) as exc:  # a peer's bytes: one line, never a traceback
            logger.warning("%s", exc)
            link.close()
            return
        finally:
            self._greeting.release()
        link.name = hello.name()
        if self._closed.is_set():
            link.close()
            return
        self.on_join(hello, link)

    def _hello(self, link: Link) -> Hello:
        check_worker(link, self.key, self.hello_timeout_s)
        head, payload = link.receive(self.hello_timeout_s, "joining", wire.HOST_BYTES)
        if head.op != Op.HELLO:
            raise WorkerError(f"{link.name}: sent {head.op.name} before HELLO")
        return wire.read_hello(head.values, bytes(payload))

    def close(self) -> None:
        self._closed.set()
        self.sock.close()
        self._thread.join()
        while not self.joined.empty():  # joined but never taken in: told nothing, it sees the link end
            self.joined.get_nowait()[1].close()
