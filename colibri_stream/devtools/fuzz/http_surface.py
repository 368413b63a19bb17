"""The HTTP surface: ``colibri-stream serve`` runs in a child (memory-limited, its own process group)
and hostile bodies, headers and paths are sent to it one at a time. The property: never a 5xx,
never a hang, and the server stays up (``/health`` answers after every request)."""

from __future__ import annotations

import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from colibri_stream.devtools.fuzz import mutations as mut
from colibri_stream.devtools.fuzz.harness import (
    BAD_CRASH,
    BAD_HANG,
    BAD_HTTP,
    MEMORY_LIMIT_BYTES,
    OK,
    TYPED,
    Case,
    Verdict,
    child_env,
)

REQUEST_TIMEOUT_S = 60.0
MODEL = "fuzz"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "fuzz-label"}  # sessions: the header
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/v1/chat/completions/../../health",
         "/%00", "/v1/completions?stream=true"]  # fmt: skip

_header_value = st.one_of(
    st.sampled_from(["application/json", "text/plain", "application/json; charset=latin-1", "", "x" * 65536]),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30),
)


def request_strategy() -> st.SearchStrategy[dict[str, Any]]:
    body = st.one_of(
        st.fixed_dictionaries(
            {"base": st.sampled_from(["chat", "completion"]), "stream": st.booleans(), "ops": mut.json_ops()}
        ),  # fmt: skip
        st.fixed_dictionaries({"raw": st.binary(max_size=64)}),
        st.fixed_dictionaries({"raw": st.sampled_from([b"{", b"[]", b"null", b'{"messages": ' + b"[" * 100000])}),
    )
    return st.fixed_dictionaries(
        {
            "method": st.sampled_from(["POST", "POST", "POST", "GET", "PUT"]),
            "path": st.sampled_from(PATHS[:2] * 3 + PATHS),
            "body": body,
            "headers": st.dictionaries(
                st.sampled_from(
                    ["Content-Type", "Authorization", "X-Fuzz", "Accept", "Transfer-Encoding", "X-Colibri-Session"]
                ),
                _header_value,
                max_size=2,
            ),
        }
    )


def encode_body(body: dict[str, Any]) -> tuple[bytes, list[dict]]:
    if "raw" in body:
        return body["raw"], [{"raw": body["raw"][:200].hex(), "bytes": len(body["raw"])}]
    doc = json.loads(json.dumps(CHAT if body["base"] == "chat" else COMPLETION))
    doc["stream"] = body["stream"]
    doc, resolved = mut.apply_json_ops(doc, body["ops"], "/nonexistent-canary")
    return mut.dump_json(doc).encode(), [{"base": body["base"], "stream": body["stream"]}, *resolved]


class ServedModel:
    """A ``colibri-stream serve`` child on a free loopback port."""

    def __init__(self, checkpoint: Path, workdir: Path, memory_bytes: int = MEMORY_LIMIT_BYTES):
        self.checkpoint, self.workdir, self.memory_bytes = checkpoint, workdir, memory_bytes
        self.process: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.workdir.mkdir(parents=True, exist_ok=True)
        limit = self.memory_bytes

        def limit_memory() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        argv = [sys.executable, "-m", "colibri_stream", "serve", str(self.checkpoint), "--port", str(self.port),
                "--kv-dir", "kv", "--model-name", MODEL, "--slots", "2", "--max-queue", "2",
                "--default-max-tokens", "4"]  # fmt: skip
        self.log = (self.workdir / "serve.log").open("ab")
        self.process = subprocess.Popen(
            argv,
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            preexec_fn=limit_memory,
            start_new_session=True,
            env=child_env({"HOME": str(self.workdir)}),
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited with {self.process.returncode}; see {self.workdir / 'serve.log'}")
            if self.health(timeout=2) == 200:
                return
            time.sleep(0.2)
        raise RuntimeError("serve did not come up in 180 s")

    def health(self, timeout: float = 30.0) -> int | None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
            conn.request("GET", "/health")
            return conn.getresponse().status
        except OSError:
            return None

    def send(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int | None, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request(method, path, body=body if method != "GET" else None, headers=headers)
            response = conn.getresponse()
            return response.status, response.read(1 << 20)
        except TimeoutError:
            return None, b"timeout"
        except (OSError, http.client.HTTPException) as exc:
            return -1, repr(exc).encode()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None


def judge_response(case: Case, status: int | None, payload: bytes, alive: bool) -> Verdict:
    result: dict[str, Any] = {"status": status, "body": payload[:500].decode(errors="replace")}
    if status is None:
        return Verdict(BAD_HANG, f"no answer in {REQUEST_TIMEOUT_S} s", "http:hang", result)
    if not alive:
        return Verdict(BAD_CRASH, "the server stopped answering /health", "http:crash", result)
    if status >= 500:
        return Verdict(BAD_HTTP, f"HTTP {status}: {result['body'][:200]}", f"http:{status}", result)
    return Verdict(TYPED if status >= 400 else OK, str(status), f"http:{status}", result)


def fuzz_http(served: ServedModel, report, examples: int, seed: int | None = None, derandomize: bool = False) -> None:
    """``examples`` hostile requests; each verdict goes to ``report`` (a runner.Report)."""

    @settings(max_examples=examples, database=None, derandomize=derandomize, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(request_strategy())
    def one(request):
        body, described = encode_body(request["body"])
        mutation = [{"method": request["method"], "path": request["path"], "headers": request["headers"]}, *described]
        headers = {"Content-Type": "application/json", **request["headers"]}
        curl = ["curl", "-sS", "-X", request["method"], f"http://127.0.0.1:PORT{request['path']}"]
        curl += [x for k, v in headers.items() for x in ("-H", f"{k}: {v[:80]}")] + ["--data-binary", "@body"]
        case = Case("http", str(served.workdir), mutation, [], kind="http", argv=curl)
        if served.process is None or served.process.poll() is not None:
            served.start()
        status, payload = served.send(request["method"], request["path"], body, headers)
        alive = served.health() == 200
        verdict = judge_response(case, status, payload, alive)
        report.add(case, verdict)
        if not alive or status is None:
            served.stop()

    if seed is not None and not derandomize:
        from hypothesis import seed as hypothesis_seed

        one = hypothesis_seed(seed)(one)
    one()
