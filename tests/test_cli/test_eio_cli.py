"""run, chat and serve on a KV directory whose device starts failing mid-run, for real: ext4 on a loop
device (colibri_stream/devtools/fuzz/disks.py; root only, skipped otherwise saying why).

The failing turn ends in one typed line naming the log (exit 1; serve: 507 with the reason), and once
the device is back the session holds every acknowledged turn and nothing after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from colibri_stream.devtools import fixtures
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.app import Server
from storage.kv.log import HEADER_BYTES, read_header
from tests.test_hostile.test_server_abuse import FAMILY, MODEL, call, completion, scenario

PROMPT = fixtures.make_prompt(512, 13)
WAIT_S = 300


def _run(checkpoint: Path, kv: Path, ids: list[int]) -> subprocess.CompletedProcess:
    argv = ["run", str(checkpoint), "--ids", ",".join(map(str, ids)), "--max-new-tokens", "5"]
    argv += ["--session", "s", "--kv-dir", str(kv), "--json"]
    return subprocess.run(
        [sys.executable, "-m", "colibri_stream", *argv], capture_output=True, text=True, timeout=WAIT_S
    )


def _ok(done: subprocess.CompletedProcess) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _one_error_line(done: subprocess.CompletedProcess, log: Path) -> str:
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert str(log) in lines[0] and "I/O error" in lines[0], lines[0]
    return lines[0]


def _positions(log: Path) -> int:
    return (log.stat().st_size - HEADER_BYTES) // read_header(log)[1].record_bytes


@pytest.mark.parametrize("diverge", [False, True], ids=["append", "cut-back"])
def test_run_on_a_failing_device_says_one_line_and_keeps_the_acknowledged_turn(tiny_checkpoints, failing_disk, diverge):
    checkpoint, log = tiny_checkpoints["deepseek_v32"], failing_disk.path / "s.kvlog"
    first = _ok(_run(checkpoint, failing_disk.path, PROMPT))
    stored = log.read_bytes()
    failing_disk.fail()
    # append: the next turn extends the conversation (its new records fail); cut-back: it diverges
    # from position 5, so the log is cut first (the cut fails)
    ids = PROMPT[:5] + [99, 98] if diverge else PROMPT + first["ids"] + [77, 78]
    line = _one_error_line(_run(checkpoint, failing_disk.path, ids), log)
    assert ("cut-back" in line) == diverge
    failing_disk.heal()
    now = log.read_bytes()
    assert now == stored or (diverge and stored.startswith(now) and _positions(log) == 5)
    again = _ok(_run(checkpoint, failing_disk.path, PROMPT))  # the acknowledged turn resumes
    assert again["stats"]["reused_tokens"] == (len(PROMPT) - 1 if now == stored else 5)
    assert again["ids"] == first["ids"]


def _read_until(stream, marker: str, deadline: float) -> str:
    seen = ""
    while marker not in seen:
        assert time.monotonic() < deadline, f"no {marker!r} in {seen!r}"
        line = stream.readline()
        assert line, f"the stream ended before {marker!r}: {seen!r}"
        seen += line
    return seen


def test_chat_whose_device_fails_between_turns_keeps_the_first_turn(tiny_checkpoints, failing_disk):
    checkpoint = tiny_checkpoints[FAMILY]
    argv = [sys.executable, "-m", "colibri_stream", "chat", str(checkpoint), "--max-new-tokens", "3"]
    argv += ["--session", "c", "--kv-dir", str(failing_disk.path)]
    chat = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + WAIT_S
    try:
        assert chat.stdin is not None and chat.stderr is not None
        chat.stdin.write("first question\n")
        chat.stdin.flush()
        _read_until(chat.stderr, "tok at", deadline)  # the first turn's footer: acknowledged
        transcript = (failing_disk.path / "c.chat.json").read_bytes()
        stored = (failing_disk.path / "c.kvlog").read_bytes()
        failing_disk.fail()
        _, err = chat.communicate("second question\n", timeout=WAIT_S)
    finally:
        if chat.poll() is None:
            chat.kill()
            chat.wait()
    assert chat.returncode == 1, err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "I/O error" in errors[0] and "Traceback" not in err, err
    assert str(failing_disk.path) in errors[0]
    failing_disk.heal()
    assert (failing_disk.path / "c.chat.json").read_bytes() == transcript  # the first turn, whole; not the second
    assert json.loads(transcript)["messages"][0]["content"] == "first question"
    assert (failing_disk.path / "c.kvlog").read_bytes() == stored


def test_serve_answers_507_naming_the_failed_device(tiny_checkpoints, failing_disk):
    kv = failing_disk.path
    runtime = load_runtime(tiny_checkpoints[FAMILY], RuntimeOptions(kv_dir=kv, model_id=MODEL))
    results: dict[str, Any] = {}

    async def test(app) -> None:
        session = {"X-Colibri-Session": "s"}
        results["first"] = await call(app, "POST", "/v1/completions", completion(), session)
        failing_disk.fail()
        longer = completion(prompt="Hello there, a longer turn")
        results["failed"] = await call(app, "POST", "/v1/completions", longer, session)
        results["sessionless"] = await call(app, "POST", "/v1/completions", completion())

    try:
        scenario(Server(runtime, slots=1, max_queue=1), test)
    finally:
        runtime.close()
    assert results["first"].status == 200
    reply = results["failed"]
    assert reply.status == 507, reply.body
    error = reply.json()["error"]
    assert error["code"] == "insufficient_storage" and "I/O error" in error["message"] and str(kv) in error["message"]
    assert results["sessionless"].status == 200  # the server goes on serving what needs no disk
    assert os.path.exists(kv / "s.kvlog")
