"""The one turn behind run, demo, chat and serve: the usage history is saved and the trace written
after every turn on each of them, the trace is streamed (never held in memory), and run and serve
report the same stats schema."""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn

from colibri_stream import cli
from colibri_stream.cli.chat import Chat
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, load_runtime, run_turn
from colibri_stream.serve.app import Server, create_app
from colibri_stream.serve.auth import SESSION_HEADER

FAMILY = "deepseek_v3"
WAIT_S = 120


def history_total(path: Path) -> float:
    counts = json.loads(path.read_text())["counts"]
    return sum(sum(layer) for layer in counts.values())


def trace_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def streaming_runtime(container: Path, tmp_path: Path, buffer_lines: int = 1024):
    store = StoreOptions(ram="60%", history=tmp_path / "history.json", trace=tmp_path / "trace.jsonl")
    runtime = load_runtime(container, RuntimeOptions(store=store, kv_dir=tmp_path / "kv", model_id="tiny"))
    runtime.loaded.experts.trace.buffer_lines = buffer_lines
    return runtime


def test_chat_saves_history_and_trace_after_each_turn(make_container, tmp_path, capsys):
    runtime = streaming_runtime(make_container(FAMILY), tmp_path)
    flags = argparse.Namespace(
        session="talk",
        system=None,
        max_new_tokens=4,
        temperature=0.0,
        top_p=1.0,
        seed=None,
        kv_sync_every=0,
        reset=False,
    )
    try:
        chat = Chat(runtime, flags)
        totals, lines = [], []
        for line in ("Hello there", "And then?"):
            turn = chat.ask(line)
            assert turn is not None
            totals.append(history_total(tmp_path / "history.json"))
            lines.append(trace_lines(tmp_path / "trace.jsonl"))
            assert turn.stats["expert_requests"] > 0
    finally:
        runtime.close()
    assert 0 < totals[0] < totals[1]  # the second turn's routings were added and saved
    assert 0 < lines[0] < lines[1]  # each turn's acquires are in the file when the turn ends


def test_the_trace_is_streamed_never_accumulated(make_container, tmp_path):
    """Many turns through one store: held entries stay under the buffer (a count, not a time), and the
    file holds one line per acquire."""
    runtime = streaming_runtime(make_container(FAMILY), tmp_path, buffer_lines=8)
    trace = runtime.loaded.experts.trace
    acquires_per_token = len(runtime.loaded.args.moe_layers)
    held: list[int] = []
    try:
        for turn in range(12):
            options = TurnOptions(5, on_token=lambda _: held.append(len(trace.pending)))
            run_turn(runtime, [1 + turn, 2, 3], options)
            assert trace.pending == []  # flushed at the end of the turn
    finally:
        runtime.close()
    assert max(held) < 8
    # each turn: one forward for the prompt and one per generated token but the last
    assert trace_lines(tmp_path / "trace.jsonl") == 12 * 5 * acquires_per_token
    assert not any(isinstance(v, list) and len(v) > 8 for v in vars(runtime.loaded.experts).values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict, session: str | None = None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    headers = {"content-type": "application/json"} | ({SESSION_HEADER: session} if session else {})
    conn.request("POST", path, body=json.dumps(body), headers=headers)
    response = conn.getresponse()
    assert response.status == 200, response.read()
    return json.loads(response.read())


@pytest.fixture
def serving(make_container, tmp_path):
    runtime = streaming_runtime(make_container(FAMILY), tmp_path)
    port = _free_port()
    http_server = uvicorn.Server(
        uvicorn.Config(create_app(Server(runtime)), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=http_server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not http_server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        http_server.should_exit = True
        thread.join(timeout=WAIT_S)
        runtime.close()


def test_serve_saves_history_and_trace_after_each_request(serving, tmp_path):
    totals, lines = [], []
    for i in range(3):
        body = {"model": "tiny", "prompt": f"Hello {i}", "max_tokens": 4, "temperature": 0}
        _post(serving, "/v1/completions", body, session="s")
        totals.append(history_total(tmp_path / "history.json"))
        lines.append(trace_lines(tmp_path / "trace.jsonl"))
    assert 0 < totals[0] < totals[1] < totals[2]
    assert 0 < lines[0] < lines[1] < lines[2]


def _schema(stats: dict) -> dict:
    """Keys, recursively (values differ from run to run; names must not)."""
    return {k: _schema(v) if isinstance(v, dict) else None for k, v in stats.items()}


def test_run_and_serve_report_one_stats_schema(serving, make_container, tmp_path, capsys):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    served = _post(serving, "/v1/completions", body, session="schema")["colibri"]
    argv = ["run", str(make_container(FAMILY)), "--ids", "5,6,7", "--max-new-tokens", "4", "--ram", "60%", "--json"]
    assert cli.main([*argv, "--session", "schema", "--kv-dir", str(tmp_path / "run-kv")]) == 0
    ran = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    assert _schema(ran) == _schema(served)
    for key in ("ttft_s", "decode_tok_per_s", "reused_tokens", "hit_rate", "expert_bytes_read", "peak_rss_bytes"):
        assert key in ran, key
    assert ran["store"] == served["store"] == "tiered"


def test_both_stores_implement_the_expert_store_protocol(make_container, tiny_checkpoints, tmp_path):
    from colibri_stream.experts.store import ExpertStore, ResidentStore
    from colibri_stream.runtime.loader import load, load_checkpoint
    from storage.tiers.tiered import TieredExpertStore

    resident = load_checkpoint(tiny_checkpoints[FAMILY]).experts
    streamed = load(make_container(FAMILY), store=StoreOptions(ram="60%")).experts
    try:
        assert isinstance(resident, ResidentStore) and isinstance(streamed, TieredExpertStore)
        for store in (resident, streamed):
            assert isinstance(store, ExpertStore)
            assert store.report()["expert_requests"] == 0 and store.snapshot().requests == 0
    finally:
        streamed.close()


def test_a_failed_turn_still_saves_history_and_trace(make_container, tmp_path):
    runtime = streaming_runtime(make_container(FAMILY), tmp_path)

    def client_gone(token: int) -> None:
        raise ConnectionResetError("the client went away")

    try:
        with pytest.raises(ConnectionResetError):
            run_turn(runtime, [5, 6, 7], TurnOptions(4, on_token=client_gone))
    finally:
        runtime.close()
    assert history_total(tmp_path / "history.json") > 0  # the prompt's routings were learned
    assert trace_lines(tmp_path / "trace.jsonl") == len(runtime.loaded.args.moe_layers)  # its one forward
