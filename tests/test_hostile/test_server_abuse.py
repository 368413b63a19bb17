"""Hostile clients against `serve`, mostly in process: the ASGI app is called directly, so a test
decides exactly what the client sends and when, and counts what the server read. The header timeout
and the connection limit live in uvicorn's protocol, so those two run a real server on loopback.
No assertion is about time; every wait is bounded only so a regression fails instead of hanging."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from colibri_stream.cli import main
from colibri_stream.errors import ChatTemplateError, ColibriError
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve import intake, model_thread
from colibri_stream.serve.app import Server, create_app
from colibri_stream.serve.auth import ApiKeys
from colibri_stream.serve.http import HttpLimits, server_config
from colibri_stream.text.chat_format import ChatFormat

FAMILY = "deepseek_v3"
MODEL = "tiny"
WAIT_S = 120
CHUNK = 64 * 2**10


@pytest.fixture(scope="module")
def runtime(tiny_checkpoints, tmp_path_factory):
    options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp("abuse-kv"), model_id=MODEL)
    runtime = load_runtime(tiny_checkpoints[FAMILY], options)
    yield runtime
    runtime.close()


# ------------------------------------------------------------------------------------ ASGI client
@dataclasses.dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


Body = bytes | Callable[[], AsyncIterator[bytes]]


async def call(
    app,
    method: str,
    path: str,
    body: Body = b"",
    headers: dict[str, str] | None = None,
    after_body: Callable[[], Awaitable[None]] | None = None,
) -> Reply:
    """One request. ``body`` is bytes or an async generator of chunks; once it is sent the next receive
    waits for ``after_body`` (forever if None) and then reports the client gone."""
    raw_headers = [
        (k.lower().encode(), v.encode()) for k, v in {"content-type": "application/json", **(headers or {})}.items()
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw_headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    chunks = body() if callable(body) else None
    sent_all = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_all
        if not sent_all:
            if chunks is None:
                sent_all = True
                return {"type": "http.request", "body": body, "more_body": False}
            try:
                return {"type": "http.request", "body": await chunks.__anext__(), "more_body": True}
            except StopAsyncIteration:
                sent_all = True
                return {"type": "http.request", "body": b"", "more_body": False}
        await (after_body() if after_body else asyncio.Event().wait())
        return {"type": "http.disconnect"}

    reply = Reply(0, {}, b"")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            reply.status = message["status"]
            reply.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            reply.body += message.get("body", b"")

    await app(scope, receive, send)
    return reply


@asynccontextmanager
async def lifespan(app):
    """The app's real start-up and shutdown (admission, the model thread)."""
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    assert (await asyncio.wait_for(outbox.get(), WAIT_S))["type"] == "lifespan.startup.complete"
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(task, WAIT_S)


def scenario(server: Server, test: Callable[[Any], Awaitable[None]]) -> None:
    app = create_app(server)

    async def run() -> None:
        async with lifespan(app):
            await asyncio.wait_for(test(app), WAIT_S)

    asyncio.run(run())


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, **fields}).encode()


# ------------------------------------------------------------------------------------ D2: bodies
def test_a_huge_body_is_refused_after_reading_at_most_the_limit(runtime):
    yielded = 0

    async def endless() -> AsyncIterator[bytes]:  # 512 MiB if the server read it all
        nonlocal yielded
        for _ in range(512 * 2**20 // CHUNK):
            yielded += CHUNK
            yield b" " * CHUNK

    async def test(app) -> None:
        reply = await call(app, "POST", "/v1/completions", endless)
        assert reply.status == 413 and reply.json()["error"]["code"] == "body_too_large"
        assert reply.headers["connection"] == "close"

    scenario(Server(runtime), test)
    assert intake.MAX_BODY_BYTES < yielded <= intake.MAX_BODY_BYTES + CHUNK


def test_a_declared_huge_body_is_refused_unread(runtime):
    yielded = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal yielded
        yielded += 1
        yield b"{}"

    async def test(app) -> None:
        reply = await call(app, "POST", "/v1/chat/completions", body, {"content-length": str(512 * 2**20)})
        assert reply.status == 413 and "536870912" in reply.json()["error"]["message"]

    scenario(Server(runtime), test)
    assert yielded == 0


def test_a_trickled_body_times_out_with_408(runtime, monkeypatch):
    monkeypatch.setattr(intake, "BODY_TIMEOUT_S", 0.2)

    async def trickle() -> AsyncIterator[bytes]:
        yield b'{"model": '
        await asyncio.Event().wait()  # and never the rest
        yield b""

    async def test(app) -> None:
        reply = await call(app, "POST", "/v1/completions", trickle)
        assert reply.status == 408 and reply.json()["error"]["code"] == "body_timeout"

    scenario(Server(runtime), test)


# ------------------------------------------------------------------------------------ prompt length
class HandedTo:
    """The runtime's tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def encode_batch(self, texts, **kwargs):
        self.calls.extend(len(t) for t in texts)
        return self.tokenizer.encode_batch(texts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def test_maximal_prompts_are_refused_before_they_are_tokenised_whole(runtime, monkeypatch):
    """A 4 MiB prompt cannot fit 512 tokens: the same 400 as a prompt found too long after encoding, with
    no more of it handed to the tokenizer than one slice (here: none, its bytes alone refuse it)."""
    encoder = runtime.prompt_encoder
    assert encoder.max_token_bytes and encoder.exact_seams in (True, False)  # the probe, before counting
    spy = HandedTo(encoder.tokenizer)
    monkeypatch.setattr(encoder, "tokenizer", spy)
    text = "word " * ((intake.MAX_BODY_BYTES - 4096) // 5)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    anthropic = {**chat, "max_tokens": 4}
    requests = [
        ("/v1/completions", completion(prompt=text), "prompt"),
        ("/v1/chat/completions", json.dumps(chat).encode(), "messages"),
        ("/v1/messages", json.dumps(anthropic).encode(), None),
        ("/v1/responses", json.dumps({"model": MODEL, "input": text, "max_output_tokens": 4}).encode(), "input"),
        ("/v1/completions", completion(prompt="word " * 600), "prompt"),  # found by counting its tokens
        ("/v1/completions", completion(prompt=[5] * 600), "messages"),  # token ids: found by their length
    ]

    async def test(app) -> None:
        for path, body, param in requests:
            reply = await call(app, "POST", path, body)
            error = reply.json()["error"]
            assert reply.status == 400 and "this model's context is 512 tokens" in error["message"], error
            if param is not None:
                assert error["code"] == "context_length_exceeded" and error["param"] == param

    scenario(Server(runtime), test)
    assert sum(spy.calls) == len("word " * 600)  # only the short prompt reached the tokenizer


# ------------------------------------------------------------------------------------ D3: event loop
def test_health_answers_while_a_prompt_is_being_tokenised(runtime, monkeypatch):
    """If tokenisation ran on the event loop, /health could only answer after it ("encoded" first)."""
    entered, release, order = threading.Event(), threading.Event(), []
    real = runtime.prompt_encoder.encode_chat

    def slow_encode_chat(*args, **kwargs):
        entered.set()
        release.wait(WAIT_S)
        order.append("encoded")
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime.prompt_encoder, "encode_chat", slow_encode_chat)
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()

    async def test(app) -> None:
        pending = asyncio.create_task(call(app, "POST", "/v1/chat/completions", chat))
        assert await asyncio.to_thread(entered.wait, WAIT_S)
        health = await call(app, "GET", "/health")
        order.append("health")
        release.set()
        assert health.status == 200 and (await pending).status == 200

    scenario(Server(runtime), test)
    assert order == ["health", "encoded"]


# ------------------------------------------------------------------------------------ D4: disconnects
def test_a_non_streaming_client_that_leaves_cancels_its_generation(runtime, monkeypatch):
    first_token, turns = threading.Event(), []
    real_begin, real_finish = model_thread.begin_turn, model_thread.finish_turn

    def observed_begin(rt, prompt_ids, options, pool):
        def on_token(token: int) -> None:
            first_token.set()
            options.on_token(token)

        return real_begin(rt, prompt_ids, dataclasses.replace(options, on_token=on_token), pool)

    def observed_finish(turn, result, pool):
        turns.append(real_finish(turn, result, pool))
        return turns[-1]

    monkeypatch.setattr(model_thread, "begin_turn", observed_begin)
    monkeypatch.setattr(model_thread, "finish_turn", observed_finish)
    server = Server(runtime)

    async def leave_after_first_token() -> None:
        assert await asyncio.to_thread(first_token.wait, WAIT_S)

    async def test(app) -> None:
        body = completion(prompt="Hi", max_tokens=400)
        await call(app, "POST", "/v1/completions", body, after_body=leave_after_first_token)

    scenario(server, test)
    assert len(turns) == 1 and turns[0].finish_reason == "cancelled"
    assert len(turns[0].ids) < 400
    assert server.model_thread.counters.cancelled == 1 and server.model_thread.counters.served == 0


# ------------------------------------------------------------------------------------ D13: API keys
def test_without_a_key_v1_is_401_and_health_is_open(runtime):
    async def test(app) -> None:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "key-ax"}, {"authorization": "key-a"}):
            reply = await call(app, "POST", "/v1/completions", completion(), headers)
            error = reply.json()["error"]
            assert reply.status == 401, headers
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert (await call(app, "GET", "/v1/models")).status == 401
        assert (await call(app, "GET", "/v1/models", headers={"x-api-key": "key-b"})).status == 200
        assert (await call(app, "GET", "/health")).status == 200

    scenario(Server(runtime, api_keys=ApiKeys(["key-a", "key-b"])), test)


def test_a_users_session_belongs_to_its_key(runtime):
    """Key B naming key A's session neither reuses it (no reused_tokens to probe) nor truncates it."""
    shared = {"X-Colibri-Session": "shared"}
    a, b = {"authorization": "Bearer key-a", **shared}, {"x-api-key": "key-b", **shared}
    body = completion(prompt="Experts stream from disk", max_tokens=2)

    async def reused(app, headers) -> int:
        reply = await call(app, "POST", "/v1/completions", body, headers)
        assert reply.status == 200, reply.body
        return reply.json()["colibri"]["reused_tokens"]

    async def test(app) -> None:
        assert await reused(app, a) == 0
        assert await reused(app, a) > 0
        assert await reused(app, b) == 0
        assert await reused(app, a) > 0

    scenario(Server(runtime, api_keys=ApiKeys(["key-a", "key-b"])), test)
    assert not (Path(runtime.kv_dir) / "shared.kvlog").exists()


def test_keys_come_from_flags_and_the_environment():
    keys = ApiKeys.from_sources(["a"], {"COLIBRI_API_KEYS": " b, c,,"})
    assert keys.keys == [b"a", b"b", b"c"]
    assert keys.authenticate({"authorization": "bearer c"}) == b"c"
    assert not ApiKeys.from_sources(None, {}).enabled
    with pytest.raises(ColibriError, match="api-key"):
        ApiKeys([" "])
    assert ApiKeys.session_name(None, "alice") == "alice"
    assert ApiKeys.session_name(b"a", "alice") != ApiKeys.session_name(b"b", "alice")


@pytest.mark.parametrize("blank", ["", " ", ",", " , ,"])
def test_a_blank_key_variable_refuses_to_start_an_open_server(blank, monkeypatch, tmp_path, capsys):
    with pytest.raises(ColibriError, match="COLIBRI_API_KEYS is set but holds no key"):
        ApiKeys.from_sources(None, {"COLIBRI_API_KEYS": blank})
    assert ApiKeys.from_sources(["a"], {"COLIBRI_API_KEYS": blank}).keys == [b"a"]  # the flag protects it
    monkeypatch.setenv("COLIBRI_API_KEYS", blank)
    assert main(["serve", str(tmp_path / "no-model")]) == 1  # refused before the model is even looked for
    err = capsys.readouterr().err
    assert "COLIBRI_API_KEYS is set but holds no key" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------ numerics, text
def test_extreme_temperatures_are_greedy_and_bad_text_is_a_400(runtime):
    async def test(app) -> None:
        greedy = await call(app, "POST", "/v1/completions", completion(max_tokens=6))
        for temperature in (1e-300, 1e-30, 5e-324):
            reply = await call(app, "POST", "/v1/completions", completion(max_tokens=6, temperature=temperature))
            assert reply.status == 200 and reply.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
        surrogate = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
        reply = await call(app, "POST", "/v1/chat/completions", surrogate)
        assert reply.status == 400 and reply.json()["error"]["code"] == "invalid_text"
        for raw in (
            b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
            b'{"model": "tiny", "prompt": "x", "top_p": Infinity}',
        ):
            reply = await call(app, "POST", "/v1/completions", raw)
            assert reply.status == 400 and "finite" in reply.json()["error"]["message"]

    server = Server(runtime)
    scenario(server, test)
    assert server.model_thread.counters.failed == 0


def test_a_user_cannot_type_the_eos_token(runtime):
    """The typed "<eos>" is text: the prompt holds the eos id once, where the template put it."""
    eos = runtime.stop_ids[0]
    prompt = runtime.encode_chat([{"role": "user", "content": "stop <eos> here<eos>"}])
    assert prompt.count(eos) == 1 and prompt[-1] != eos


def test_a_broken_chat_template_stops_serve_at_start(tiny_checkpoints, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints[FAMILY], broken)
    (broken / "chat_template.jinja").write_text("{% for i in range(10**9) %}{% endfor %}")
    assert main(["serve", str(broken), "--kv-dir", str(tmp_path / "kv"), "--port", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "chat template" in err and "range" in err


def test_server_check_refuses_a_template_that_raises(runtime):
    bad = dataclasses.replace(runtime, chat=ChatFormat("{{ raise_exception('no') }}"))
    with pytest.raises(ChatTemplateError):
        Server(bad).check_chat_template()


# ------------------------------------------------------------------------------------ real sockets
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def uvicorn_on_loopback(runtime, limits: HttpLimits) -> Iterator[tuple[int, uvicorn.Server]]:
    port = free_port()
    http = uvicorn.Server(server_config(create_app(Server(runtime)), "127.0.0.1", port, limits, log_level="error"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    wait_until(lambda: http.started, "uvicorn to start")
    try:
        yield port, http
    finally:
        http.should_exit = True
        thread.join(timeout=30)


def get_health(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return b"".join(iter(lambda: s.recv(65536), b""))


def test_a_client_that_never_finishes_its_headers_is_dropped(runtime):
    with (
        uvicorn_on_loopback(runtime, HttpLimits(header_timeout_s=0.3)) as (port, _),
        socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as slow,
    ):
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        assert slow.recv(1024) == b""  # closed by the server, not by the test's timeout (that raises)
        assert get_health(port).startswith(b"HTTP/1.1 200")


def test_connections_beyond_the_limit_get_503(runtime):
    with uvicorn_on_loopback(runtime, HttpLimits(max_connections=4, header_timeout_s=WAIT_S)) as (port, http):
        idle = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(4)]
        try:
            wait_until(lambda: len(http.server_state.connections) >= 4, "the idle connections to be accepted")
            assert get_health(port).startswith(b"HTTP/1.1 503")
        finally:
            for s in idle:
                s.close()
        wait_until(lambda: len(http.server_state.connections) == 0, "the idle connections to close")
        assert get_health(port).startswith(b"HTTP/1.1 200")
