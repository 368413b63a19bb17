"""`colibri-stream serve` end to end: the official openai client against a real uvicorn server on
loopback, on a tiny fixture checkpoint. Every wait is bounded; the server stops at module teardown."""

from __future__ import annotations

import fcntl
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import uvicorn

from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.kv.sessions import Session
from colibri_stream.runtime.loader import load_checkpoint
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.app import Server, create_app
from colibri_stream.text.chat_format import load_chat_format, load_tokenizer

FAMILY = "deepseek_v3"
MODEL = "tiny"
WAIT_S = 120  # upper bound on any wait: the test machine may be busy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Served:
    def __init__(self, port: int, server: Server):
        self.port, self.server = port, server
        self.url = f"http://127.0.0.1:{port}/v1"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=WAIT_S)

    def health(self) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=WAIT_S)
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory) -> Iterator[Served]:
    options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp("server-kv"), model_id=MODEL)
    server = Server(load_runtime(tiny_checkpoints[FAMILY], options), slots=2, max_queue=1)
    port = free_port()
    http_server = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=http_server.run, daemon=True)
    thread.start()
    wait_until(lambda: http_server.started, "uvicorn to start")
    try:
        yield Served(port, server)
    finally:
        http_server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"


def expected_chat(checkpoint: Path, messages: list[dict], max_tokens: int) -> str:
    """The answer computed without the server: template -> ids -> generate -> text."""
    chat, tokenizer = load_chat_format(checkpoint), load_tokenizer(checkpoint)
    loaded = load_checkpoint(checkpoint)
    ids = tokenizer.encode(chat.render(messages), add_special_tokens=False).ids
    out = generate(loaded.model, ids, max_tokens, loaded.experts, stop_ids=chat.stop_ids).ids
    return tokenizer.decode([t for t in out if t not in chat.stop_ids])


def test_models_lists_the_served_model(served):
    assert [m.id for m in served.client().models.list().data] == [MODEL]


def test_the_root_answers_a_connectivity_probe(served):
    """Claude Code sends ``HEAD /`` first; a 405 there reads as a server that is not the API's. GET / stays
    the dashboard's page."""
    statuses = {}
    for method in ("HEAD", "GET"):
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=WAIT_S)
        conn.request(method, "/")
        response = conn.getresponse()
        statuses[method] = (response.status, response.getheader("content-type") or "", response.read())
    assert statuses["HEAD"][0] == 200
    assert statuses["GET"][0] == 200 and statuses["GET"][1].startswith("text/html")


def test_streaming_and_json_give_the_same_text_at_temperature_0(served, tiny_checkpoints):
    client = served.client()
    messages = [{"role": "user", "content": "Hello, world!"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed == expected_chat(tiny_checkpoints[FAMILY], messages, 12)
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason
    assert whole.usage.completion_tokens <= 12


def _complete(served: Served, prompt: str, session: str) -> tuple[str, dict]:
    headers = {"X-Colibri-Session": session}
    done = served.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_headers=headers
    )
    return done.choices[0].text, done.model_extra["colibri"]


def test_concurrent_sessions_get_their_solo_tokens_and_reuse_prefixes(served):
    prompts = ["The quick brown fox", "Experts stream from disk", "Hello, world! 0123"]
    solo = [_complete(served, p, f"solo-{i}")[0] for i, p in enumerate(prompts)]
    results: dict[int, tuple[str, dict]] = {}

    def worker(i: int) -> None:
        results[i] = _complete(served, prompts[i], f"conc-{i}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT_S)
    assert [results[i][0] for i in range(len(prompts))] == solo
    again, stats = _complete(served, prompts[0], "solo-0")  # the session holds this prompt: reused
    assert again == solo[0] and stats["reused_tokens"] > 0


def test_two_requests_of_one_session_take_turns(served):
    """A session's second request waits for the first turn to end (its log is locked by that turn and
    its KV is in use), then continues the conversation; neither is refused."""
    results: dict[int, tuple[str, dict]] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, _complete(served, f"Turn {i} of a talk", "shared")))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WAIT_S)
    assert sorted(results) == [0, 1] and all(text for text, _ in results.values())
    reused = sorted(stats["reused_tokens"] for _, stats in results.values())
    assert reused[0] == 0 and reused[1] > 0  # the later turn kept the common prefix of the earlier one


def _raw_stream(served: Served, max_tokens: int) -> http.client.HTTPConnection:
    """A streaming request whose response is never read (the connection stays open)."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=WAIT_S)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    return conn


def test_aborting_mid_stream_frees_the_slot(served):
    before = served.health()["cancelled"]
    stream = served.client().completions.create(model=MODEL, prompt="Hi", max_tokens=400, temperature=0, stream=True)
    for _, _ in zip(range(3), stream, strict=False):
        pass
    stream.close()
    wait_until(lambda: served.health()["slots_busy"] == 0, "the slot to be freed")
    assert served.health()["cancelled"] == before + 1


def test_a_full_queue_gives_503_and_the_server_recovers(served):
    conns = [_raw_stream(served, 400) for _ in range(3)]  # 2 slots + 1 queue place
    try:
        wait_until(lambda: (h := served.health())["slots_busy"] == 2 and h["queued"] == 1, "slots and queue to fill")
        wait_until(lambda: served.health()["batch"] == 2, "both admitted requests to decode together")
        with pytest.raises(openai.APIStatusError) as refused:
            served.client().completions.create(model=MODEL, prompt="x", max_tokens=4)
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "busy" and "slots" in refused.value.body["message"]
    finally:
        for conn in conns:
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
    wait_until(lambda: (h := served.health())["slots_busy"] == 0 and h["queued"] == 0, "slots to drain")
    assert served.health()["batch"] == 0  # the disconnected clients left the batch
    assert _complete(served, "Hello", "after-503")[0]


def malformed_requests() -> list[tuple[str, str, bytes]]:
    """(method, path, body) cases, each of which must be refused with a 4xx."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    common = {
        "model": [None, 5, [], {}, "", True],  # any other name is served (test_server_logprobs.py)
        "max_tokens": [0, -1, -(10**6), "5", "", 5.5, 2.0, True, [], [1], {}],  # a large one is cut to the room
        "temperature": [-0.1, 2.5, "0", [], True, None, {}],
        "top_p": [0, -1, 1.5, "1", {}, None],
        "seed": [-1, 2**64, "1", 1.5, []],
        "stream": ["yes", 1, None, [], 0.0],
        "stop": [5, [1], ["a", "b", "c", "d", "e"], [""], {}, ""],
        "user": [5, "x" * 513, "é" * 257, True, [], {"a": 1}],  # an opaque label of at most 512 UTF-8 bytes
        "n": [0, 2, "1", None],
    }
    specific = {
        "messages": [
            None,
            "hi",
            [],
            [{}],
            [1],
            [[]],
            [{"role": "wizard", "content": "x"}],
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": [{"type": "image_url"}]}],
            [{"content": "x"}],
            [{"role": "user", "content": "x" * 5000}],
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            [{"role": "user", "content": [{"type": "text"}]}],
            [{"role": 5, "content": "x"}],
            [{"role": "user", "content": {"text": "x"}}],
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": 5}],
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": ["z"]}],
        ],
        "reasoning_effort": ["extreme", "", "HIGH", 5, True, [], {}, "off", 0.5, ["high"], {"effort": "high"}, "max"],
        "max_completion_tokens": [0, -3, "2"],
        "prompt": [None, 5, [], [-1], [10**6], [[]], [1.5], {}, "", [True], list(range(2, 600)), "hi " * 600],
    }
    cases: list[tuple[str, str, bytes]] = []
    for path, base, own in (
        ("/v1/chat/completions", chat, ("messages", "max_completion_tokens", "reasoning_effort")),
        ("/v1/completions", completion, ("prompt",)),
    ):
        for field, values in [*common.items(), *((f, specific[f]) for f in own)]:
            cases += [("POST", path, json.dumps({**base, field: v}).encode()) for v in values]
        for field in base:
            nested = [[-1]] if field == "prompt" else [[1]]  # a list of token-id prompts is a valid prompt
            cases += [("POST", path, json.dumps({**base, field: v}).encode()) for v in ({"a": 1}, nested)]
        for field in ("model", own[0]):
            cases.append(("POST", path, json.dumps({k: v for k, v in base.items() if k != field}).encode()))
        for raw in (
            b"",
            b"{",
            b"null",
            b"[]",
            b"1",
            b'"x"',
            b"{'a': 1}",
            b"\xff\xfe",
            b"[" * 100_000,
            b'{"model": NaN}',
            b"model=tiny&prompt=hi",
            json.dumps([base]).encode(),
        ):
            cases.append(("POST", path, raw))
        cases.append(("GET", path, b""))
    cases += [("GET", "/v1/nothing", b""), ("POST", "/v1/models", b"{}"), ("DELETE", "/v1/models", b"")]
    return cases


def test_malformed_requests_get_openai_shaped_4xx_and_the_server_keeps_serving(served):
    cases = malformed_requests()
    assert len(cases) >= 200
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=WAIT_S)
    for method, path, body in cases:
        conn.request(method, path, body=body, headers={"content-type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
        assert 400 <= response.status < 500, (method, path, body[:200], response.status, payload[:300])
        error = json.loads(payload)["error"]
        assert error["message"] and error["type"] == "invalid_request_error", payload
    assert served.health()["failed"] == 0
    assert _complete(served, "Hello", "after-malformed")[0]


BAD_SESSIONS = ["../x", "a/b", ".hidden", "..", "", "x" * 300, "a b", "../../etc/passwd", "a..b", "/abs", "a\\b", "~"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
def test_a_bad_session_header_is_a_400_naming_it(served, path):
    body = {"model": MODEL, "max_tokens": 2, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=WAIT_S)
    for name in BAD_SESSIONS:
        headers = {"content-type": "application/json", "X-Colibri-Session": name}
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        payload = json.loads(response.read())
        message = payload["error"]["message"]
        assert response.status == 400 and "X-Colibri-Session" in message and "session name" in message, payload


def test_user_labels_are_opaque_and_name_no_session(served):
    """Any ``user`` (Claude Code's JSON metadata, an e-mail) is accepted and no session file is made."""
    before = sorted(served.server.runtime.kv_dir.glob("*.kvlog"))
    labels = ['{"device_id":"d7726a","account_uuid":"","session_id":"x/../y"}', "alice@example.com", "é" * 256]
    for label in labels:
        done = served.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0, user=label)
        assert done.choices[0].text is not None
    assert sorted(served.server.runtime.kv_dir.glob("*.kvlog")) == before


def test_context_overflow_names_both_lengths_and_max_tokens_is_cut_to_the_room(served):
    with pytest.raises(openai.BadRequestError) as err:
        served.client().completions.create(model=MODEL, prompt=[*range(2, 502), *range(2, 102)], max_tokens=1)
    assert "600" in err.value.body["message"] and "512" in err.value.body["message"]
    # 500 + 100 > 512: the answer gets the 12 positions left (agents ask for more than any context holds)
    cut = served.client().completions.create(model=MODEL, prompt=list(range(2, 502)), max_tokens=100, temperature=0)
    assert cut.usage.completion_tokens <= 12
    if cut.choices[0].finish_reason == "length":
        assert cut.usage.completion_tokens == 12


def test_the_serve_command_answers_and_stops_on_sigint(tiny_checkpoints, tmp_path):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "colibri_stream",
        "serve",
        str(tiny_checkpoints[FAMILY]),
        "--port",
        str(port),
        "--kv-dir",
        str(tmp_path),
        "--model-name",
        MODEL,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=WAIT_S)

        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            try:
                return bool(client.models.list().data)
            except openai.APIConnectionError:
                return False

        wait_until(up, "the serve command to listen")
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert answer.choices[0].finish_reason in ("stop", "length")
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "serving 'tiny'" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_strings_cut_the_answer(served):
    client = served.client()
    full = client.completions.create(model=MODEL, prompt=list(range(2, 12)), max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.completions.create(model=MODEL, prompt=list(range(2, 12)), max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_a_session_locked_elsewhere_is_a_409(served):
    """A session log another process holds (here: another open file; flock locks conflict between open
    files, even in one process) is refused, and served once it is free. The server itself keeps the
    sessions it served open (their KV in memory), so the lock is taken before the server sees it."""
    runtime = served.server.runtime
    log = Path(runtime.kv_dir) / "locked.kvlog"
    held = Session(runtime.kv_dir, "locked", runtime.fingerprint, runtime.loaded.args)
    try:
        assert log.exists()
        with pytest.raises(openai.APIStatusError) as busy:
            _complete(served, "Hello", "locked")
        assert busy.value.status_code == 409 and busy.value.body["code"] == "session_unavailable"
    finally:
        held.close()
    assert _complete(served, "Hello", "locked")[0]
    with open(log, "rb") as other, pytest.raises(BlockingIOError):  # now the server holds it, memory-resident
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
