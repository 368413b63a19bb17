"""One writer per session across processes: a second `chat` or `run` on a session another process holds
is refused in one line naming that process's pid, the holder's turns are all kept, and once the holder
ends (even by SIGKILL) the session opens again.

The holder is always a real process (a `chat` child, or this process against a child); the commands
that meet it run in this process through cli.main where the holder is the other process (no torch
import each)."""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

from colibri_stream import cli
from colibri_stream.checkpoint.fingerprint import model_fingerprint
from colibri_stream.errors import SessionInUseError
from colibri_stream.runtime.kv.lock import SessionLease
from colibri_stream.runtime.kv.pool import SessionPool
from colibri_stream.runtime.kv.sessions import Session
from colibri_stream.runtime.loader import model_config
from colibri_stream.serve.model_thread import api_error
from engine.config.args import ModelArgs

FOOTER = re.compile(r"\[\d+ tok at .*reused (\d+) tok\]")
COMMAND = [sys.executable, "-m", "colibri_stream"]


@pytest.fixture
def model(tiny_checkpoints):
    return tiny_checkpoints["kimi_k2"]


def chat_argv(model, kv_dir) -> list[str]:
    return [*COMMAND, "chat", str(model), "--kv-dir", str(kv_dir), "--session", "talk", "--max-new-tokens", "4"]


def start_chat(model, kv_dir) -> subprocess.Popen[str]:
    return subprocess.Popen(
        chat_argv(model, kv_dir), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def say(chat: subprocess.Popen[str], line: str, timeout: float = 120) -> str:
    """Send one user line and wait for the answer's footer on stderr (the turn acknowledged)."""
    assert chat.stdin is not None and chat.stderr is not None
    chat.stdin.write(line + "\n")
    chat.stdin.flush()
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([chat.stderr], [], [], deadline - time.monotonic())
        if not ready:
            break
        text = chat.stderr.readline()
        seen += text
        if not text or FOOTER.search(text):
            return seen
    raise AssertionError(f"no answer to {line!r}: {seen}")


def one_shot(argv: list[str], script: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, input=script, capture_output=True, text=True, timeout=300)


def in_process(argv: list[str], script: str = "") -> subprocess.CompletedProcess[str]:
    """``argv`` (COMMAND and its arguments) run by cli.main in this process, ``script`` its stdin."""
    assert argv[: len(COMMAND)] == COMMAND
    out, err = io.StringIO(), io.StringIO()
    stdin, sys.stdin = sys.stdin, io.StringIO(script)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            status = cli.main(argv[len(COMMAND) :])
    finally:
        sys.stdin = stdin
    return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())


def transcript(kv_dir) -> list[dict[str, str]]:
    return json.loads((kv_dir / "talk.chat.json").read_text())["messages"]


def test_a_second_chat_is_refused_naming_the_first_and_the_first_keeps_every_turn(model, tmp_path):
    first = start_chat(model, tmp_path)
    try:
        say(first, "Hello")
        second = in_process(chat_argv(model, tmp_path), "Intruder\n")
        assert second.returncode == 1
        (line,) = second.stderr.strip().splitlines()[-1:]
        assert f"session 'talk' is in use by pid {first.pid}" in line
        assert "Traceback" not in second.stderr
        run = in_process([*COMMAND, "run", str(model), "--ids", "1,2", "--session", "talk", "--kv-dir", str(tmp_path)])
        assert run.returncode == 1 and f"in use by pid {first.pid}" in run.stderr
        rm = in_process([*COMMAND, "kv", "rm", str(model), "talk", "--kv-dir", str(tmp_path)])
        assert rm.returncode == 1 and f"in use by pid {first.pid}" in rm.stderr  # between turns too
        say(first, "And then?")
    finally:
        first.communicate("", timeout=120)
    assert first.returncode == 0
    messages = transcript(tmp_path)
    assert [m["content"] for m in messages if m["role"] == "user"] == ["Hello", "And then?"]
    again = in_process(chat_argv(model, tmp_path), "Third\n")  # free once the first has ended
    assert again.returncode == 0, again.stderr
    assert "resumed, 4 messages" in again.stderr and int(FOOTER.search(again.stderr)[1]) > 0


def test_a_killed_holders_session_is_taken_over_with_its_acknowledged_turn(model, tmp_path):
    first = start_chat(model, tmp_path)
    say(first, "Hello")
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    assert (tmp_path / "talk.lock").read_text().strip() == str(first.pid)  # the dead holder's lock file
    again = in_process(chat_argv(model, tmp_path), "Again\n")
    assert again.returncode == 0, again.stderr
    assert "resumed, 2 messages" in again.stderr and int(FOOTER.search(again.stderr)[1]) > 0
    assert [m["content"] for m in transcript(tmp_path) if m["role"] == "user"] == ["Hello", "Again"]
    rm = in_process([*COMMAND, "kv", "rm", str(model), "talk", "--kv-dir", str(tmp_path)])
    assert rm.returncode == 0, rm.stderr
    assert not list(tmp_path.glob("talk*"))  # log, transcript and lock file gone (stores shared by sessions stay)


def test_a_session_the_servers_pool_holds_refuses_a_chat(model, tmp_path):
    """serve keeps the sessions it served open in its SessionPool: their locks are held until the pool
    lets them go, and a chat process on one of them is refused naming the server's pid."""
    args = ModelArgs.from_hf_config(model_config(model))
    pool = SessionPool(2)
    session = Session(tmp_path, "talk", model_fingerprint(model), args)
    pool.put(session, session.start_turn([1, 2], torch.float32).cache, [])
    refused = one_shot(chat_argv(model, tmp_path), "Hello\n")
    assert refused.returncode == 1 and f"session 'talk' is in use by pid {os.getpid()}" in refused.stderr
    pool.close()
    assert in_process(chat_argv(model, tmp_path), "Hello\n").returncode == 0


def test_the_lease_is_shared_within_a_process_and_answered_409_by_the_server(tmp_path):
    outer = SessionLease(tmp_path, "s")
    inner = SessionLease(tmp_path, "s")  # a chat's turn opening the session it holds
    inner.release()
    take = f"from colibri_stream.runtime.kv.lock import SessionLease; SessionLease({str(tmp_path)!r}, 's')"
    holder = subprocess.run([sys.executable, "-c", take], capture_output=True, text=True, timeout=120)
    assert holder.returncode != 0 and f"in use by pid {os.getpid()}" in holder.stderr  # still held by outer
    outer.release()
    outer.release()  # idempotent
    with SessionLease(tmp_path, "s"):  # free again
        pass
    error = api_error(SessionInUseError("session 's' is in use by pid 1"))
    assert error.status == 409 and error.code == "session_unavailable"
