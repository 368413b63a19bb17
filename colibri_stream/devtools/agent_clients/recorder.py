"""A recording reverse proxy for `tools/agent_clients.py --record DIR`: clients talk to it as to `serve`;
it forwards every request unchanged to the upstream server, streams the answer back as it comes (SSE
included), and saves each request as a JSON fixture, credentials redacted:

    DIR/<label>/<NNN>-<method>-<route>.json   {"client", "method", "path", "headers", "body", "response"}

``body`` is the parsed JSON (the raw text when it is not JSON); ``response`` holds the upstream status
and the first RESPONSE_HEAD characters of its body, so a refusal's message is kept beside its request.
``label`` names the client now running (the caller sets it between runs). Standard library only.
"""

from __future__ import annotations

import http.client
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REDACTED = "<redacted>"
SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "cookie", "proxy-authorization", "openai-api-key"}
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "proxy-connection", "te"}
RESPONSE_HEAD = 2000  # characters of each answer kept beside its request
UPSTREAM_TIMEOUT_S = 900.0  # a cold 26k-token prefill on a busy machine takes minutes
READ_CHUNK = 64 << 10


def redacted_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    """The request's headers, lower-cased, with every credential replaced (a repeated header: joined)."""
    out: dict[str, str] = {}
    for name, value in headers:
        name = name.lower()
        value = REDACTED if name in SECRET_HEADERS else value
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


def parsed_body(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return raw.decode(errors="replace")


class Recorder:
    """The proxy: ``start()`` binds 127.0.0.1 on a free port (``port``), ``stop()`` ends it."""

    def __init__(self, upstream_port: int, out_dir: Path, upstream_host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self.out_dir = out_dir
        self.label = "unlabelled"
        self.lock = threading.Lock()
        self.count = 0
        self.server = _QuietServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="recorder", daemon=True)

    def start(self) -> Recorder:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def save(self, method: str, path: str, headers: dict[str, str], raw: bytes, status: int, head: bytes) -> Path:
        with self.lock:
            self.count += 1
            number, label = self.count, self.label
        route = re.sub(r"[^A-Za-z0-9]+", "_", path.split("?", 1)[0]).strip("_") or "root"
        target = self.out_dir / label / f"{number:03d}-{method.lower()}-{route}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "client": label,
            "method": method,
            "path": path,
            "headers": headers,
            "body": parsed_body(raw),
            "response": {"status": status, "body_head": head.decode(errors="replace")},
        }
        target.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        return target


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client closing its kept-alive connection is no error worth a traceback."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler(recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the caller prints its own table
            pass

        def do_GET(self) -> None:
            self._proxy()

        def do_POST(self) -> None:
            self._proxy()

        def do_DELETE(self) -> None:
            self._proxy()

        def do_PUT(self) -> None:
            self._proxy()

        def _body(self) -> bytes:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                parts = []
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(parts)
            return self.rfile.read(int(self.headers.get("content-length") or 0))

        def _proxy(self) -> None:
            raw = self._body()
            forward = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            forward["content-length"] = str(len(raw))
            upstream = http.client.HTTPConnection(*recorder.upstream, timeout=UPSTREAM_TIMEOUT_S)
            head = b""
            status = 502
            try:
                upstream.request(self.command, self.path, raw if raw or self.command != "GET" else None, forward)
                answer = upstream.getresponse()
                status = answer.status
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in HOP_HEADERS:
                        self.send_header(name, value)
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                while chunk := answer.read1(READ_CHUNK):
                    head += chunk[: max(0, RESPONSE_HEAD - len(head))]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (OSError, http.client.HTTPException) as exc:  # the client or the server went away
                head += f"[recorder: {type(exc).__name__}: {exc}]".encode()
                self.close_connection = True
            finally:
                upstream.close()
                headers = redacted_headers(list(self.headers.items()))
                recorder.save(self.command, self.path, headers, raw, status, head)

    return Handler
