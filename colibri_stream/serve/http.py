"""The HTTP side of `serve`: uvicorn with limits on what a connection may hold. uvicorn bounds header
size (h11) and idle keep-alive time, but not how long a client may take to send its headers: a
connection that trickles them ("slowloris") would stay open forever. ``GuardedH11Protocol`` closes a
connection whose request headers have not arrived within ``header_timeout_s`` of it opening or of its
previous response; ``limit_concurrency`` answers 503 beyond ``max_connections`` connections."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = 64  # open connections (and requests in flight) before 503s
    header_timeout_s: float = 10.0  # from connect (or the last response) to complete request headers
    keep_alive_s: int = 5  # an idle kept-alive connection is closed after this
    max_header_bytes: int = 16 * 2**10


class GuardedH11Protocol(H11Protocol):
    """H11Protocol plus a deadline for the next request's headers."""

    header_timeout_s: float = HttpLimits.header_timeout_s
    _header_deadline: asyncio.TimerHandle | None = None  # none armed yet (a connection may be lost first)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        # the cycle now current: once headers arrive a new cycle replaces it and the deadline is moot
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late, self.cycle)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        self._header_deadline = None

    def _headers_late(self, cycle: Any) -> None:
        if self.cycle is cycle and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(header_timeout_s: float) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s})


def server_config(app: Any, host: str, port: int, limits: HttpLimits = HttpLimits(), **kwargs: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(limits.header_timeout_s),
        limit_concurrency=limits.max_connections,
        timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        **kwargs,
    )


def run_server(config: uvicorn.Config) -> bool:
    """Serve until Ctrl-C / SIGTERM (uvicorn re-raises the signal it caught once it has shut down, as
    KeyboardInterrupt for SIGINT); True when the server had started (False: e.g. the port was taken)."""
    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return server.started
