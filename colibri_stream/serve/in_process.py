"""The real HTTP server in a thread of this process on a free port of 127.0.0.1: what the serving
benchmark tools/bench_agent.py measures, requests over a real socket (the batch rows run `serve` itself)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from colibri_stream.serve.app import Server, create_app


@dataclass
class Running:
    """A server started by ``start_server``: stop() ends it (the model thread with it) and waits."""

    http: uvicorn.Server
    thread: threading.Thread
    port: int

    def stop(self) -> None:
        self.http.should_exit = True
        self.thread.join()


def start_server(server: Server) -> Running:
    """Serve ``server`` on a free port of 127.0.0.1 in a thread; returns once it listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    http_server = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=http_server.run, daemon=True)
    thread.start()
    while not http_server.started:
        time.sleep(0.05)
    return Running(http_server, thread, port)
