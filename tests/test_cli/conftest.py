"""Fixtures of the API tests: a real uvicorn server on loopback around a Server, started in a thread
and stopped at teardown (every wait bounded)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import uvicorn

from colibri_stream.runtime.turn import Runtime
from colibri_stream.serve.app import Server, create_app

START_WAIT_S = 120  # the test machine may be busy


class LiveServer:
    def __init__(self, server: Server, port: int, http_server: uvicorn.Server, thread: threading.Thread):
        self.server, self.port = server, port
        self.base = f"http://127.0.0.1:{port}"
        self.http_server, self.thread = http_server, thread

    def stop(self) -> None:
        """Shut down as Ctrl-C does (the worker ends, its sessions are closed)."""
        self.http_server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def live_server() -> Iterator[Callable[..., LiveServer]]:
    """(runtime, **Server options) -> a LiveServer serving it; all stop at the module's end."""
    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(runtime: Runtime, **options) -> LiveServer:
        server = Server(runtime, **options)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config = uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="error")
        http_server = uvicorn.Server(config)
        thread = threading.Thread(target=http_server.run, daemon=True)
        thread.start()
        running.append((http_server, thread))
        deadline = time.monotonic() + START_WAIT_S
        while not http_server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return LiveServer(server, port, http_server, thread)

    yield start
    for http_server, _ in running:
        http_server.should_exit = True
    for _, thread in running:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a server did not stop"
