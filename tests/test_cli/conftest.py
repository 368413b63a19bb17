"""Fixtures of the API tests: a real uvicorn server on loopback around a Server, started in a thread
and stopped at teardown (every wait bounded)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import uvicorn

from colibri_stream.conversation import Runtime
from colibri_stream.serve.app import Server, create_app

START_WAIT_S = 120  # the test machine may be busy


class LiveServer:
    def __init__(self, server: Server, port: int):
        self.server, self.port = server, port
        self.base = f"http://127.0.0.1:{port}"


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
        return LiveServer(server, port)

    yield start
    for http_server, _ in running:
        http_server.should_exit = True
    for _, thread in running:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a server did not stop"
