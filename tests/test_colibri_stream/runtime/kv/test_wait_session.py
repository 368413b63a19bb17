"""--wait-session: a second process on a session another holds waits for it (telling once for whom)
instead of being refused, then runs after it; both processes' turns are kept, in order. The holder is
always a real process."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from colibri_stream.checkpoint.fingerprint import model_fingerprint
from colibri_stream.errors import SessionInUseError
from colibri_stream.runtime.kv import lock as session_lock
from colibri_stream.runtime.kv.lock import SessionLease, SessionWait
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.app import Server
from colibri_stream.serve.auth import SESSION_HEADER
from storage.kv.log import KVLog, read_header_state
from tests.test_hostile.test_server_abuse import MODEL, call, completion, scenario
from tests.test_hostile.test_session_writers import COMMAND, FOOTER, chat_argv, say, start_chat, transcript

WAIT_S = 300


@pytest.fixture
def model(tiny_checkpoints):
    return tiny_checkpoints["kimi_k2"]


def _read_stderr_until(process: subprocess.Popen[str], marker: str, timeout: float = WAIT_S) -> str:
    assert process.stderr is not None
    deadline, seen = time.monotonic() + timeout, ""
    while marker not in seen:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([process.stderr], [], [], max(0.0, left))
        assert ready and left > 0, f"no {marker!r} on stderr: {seen!r}"
        line = process.stderr.readline()
        assert line, f"stderr ended before {marker!r}: {seen!r}"
        seen += line
    return seen


def test_a_waiting_chat_runs_after_the_holder_and_both_turns_are_kept_in_order(model, tmp_path):
    first = start_chat(model, tmp_path)
    second = None
    try:
        say(first, "Hello")
        argv = [*chat_argv(model, tmp_path), "--wait-session=300"]
        second = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert second.stdin is not None
        second.stdin.write("Second\n")
        second.stdin.close()
        waiting = _read_stderr_until(second, "waiting for it to end")
        assert f"session 'talk' is in use by pid {first.pid}: waiting for it to end (up to 300 s)" in waiting
        assert second.poll() is None  # it waits: not refused, not run
        say(first, "And then?")  # the holder goes on while the other waits
        first.communicate("", timeout=WAIT_S)
        assert second.stderr is not None
        rest = second.stderr.read()  # to its end: the process has exited (its answers fit stdout's pipe)
        second.wait(timeout=WAIT_S)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert first.returncode == 0
    assert second.returncode == 0, rest
    assert rest.count("waiting for it to end") == 0  # told once, before the wait
    assert "resumed, 4 messages" in rest and int(FOOTER.search(rest)[1]) > 0  # it continued the stored turns
    messages = transcript(tmp_path)
    assert [m["content"] for m in messages if m["role"] == "user"] == ["Hello", "And then?", "Second"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    runtime = load_runtime(model, RuntimeOptions(kv_dir=tmp_path))
    try:
        prompt = runtime.encode_chat(messages[:5])  # the third turn's prompt: both first turns, in order
        fingerprint, geometry, state = read_header_state(tmp_path / "talk.kvlog")
        with KVLog(tmp_path / "talk.kvlog", fingerprint, geometry, state=state) as log:
            tokens, _ = log.read()
        assert tokens[: len(prompt)].tolist() == list(prompt) and len(tokens) > len(prompt)
    finally:
        runtime.close()


def test_a_wait_that_runs_out_is_refused_in_one_line_naming_the_holder(model, tmp_path):
    with SessionLease(tmp_path, "s"):  # this process holds it for the whole test
        argv = [*COMMAND, "run", str(model), "--ids", "1,2", "--session", "s", "--kv-dir", str(tmp_path)]
        done = subprocess.run([*argv, "--wait-session=1"], capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 1, done.stderr
    told, refused = done.stderr.strip().splitlines()
    assert f"session 's' is in use by pid {os.getpid()}: waiting for it to end (up to 1 s)" in told
    assert f"error: session 's' is still in use by pid {os.getpid()} after waiting 1 s" in refused
    assert not (tmp_path / "s.kvlog").exists()  # nothing written while another held it
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=WAIT_S)  # without the flag: at once
    assert plain.returncode == 0, plain.stderr  # free now


def _hold_in_child(kv_dir, name: str, seconds: float) -> subprocess.Popen[str]:
    code = (
        "import sys, time\nfrom colibri_stream.runtime.kv.lock import SessionLease\n"
        f"lease = SessionLease({str(kv_dir)!r}, {name!r})\nprint('held', flush=True)\ntime.sleep({seconds})\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    return child


def test_serve_waits_for_a_session_another_process_holds(tiny_checkpoints, tmp_path):
    checkpoint = tiny_checkpoints["deepseek_v3"]
    runtime = load_runtime(checkpoint, RuntimeOptions(kv_dir=tmp_path, model_id=MODEL))
    assert runtime.fingerprint == model_fingerprint(checkpoint)
    told: list[str] = []
    results: dict[str, Any] = {}
    short = _hold_in_child(tmp_path, "s", 5)
    long = _hold_in_child(tmp_path, "t", 600)

    async def test(app) -> None:
        results["held_at_start"] = short.poll() is None
        results["waited"] = await call(app, "POST", "/v1/completions", completion(), {SESSION_HEADER: "s"})
        results["gave_up"] = await call(app, "POST", "/v1/completions", completion(), {SESSION_HEADER: "t"})

    try:
        scenario(Server(runtime, slots=1, max_queue=1, session_wait=SessionWait(10.0, told.append)), test)
    finally:
        runtime.close()
        long.kill()
        long.wait()
        short.wait(timeout=60)
    assert results["held_at_start"]
    assert results["waited"].status == 200, results["waited"].body
    assert results["waited"].json()["choices"][0]["text"] is not None
    assert (tmp_path / "s.kvlog").exists()
    reply = results["gave_up"]
    assert (
        reply.status == 409 and f"still in use by pid {long.pid} after waiting 10 s" in reply.json()["error"]["message"]
    )
    assert told == [
        f"session 's' is in use by pid {short.pid}: waiting for it to end (up to 10 s)",
        f"session 't' is in use by pid {long.pid}: waiting for it to end (up to 10 s)",
    ]


def test_a_wait_for_ever_ends_when_stopped(tmp_path):
    """serve's shutdown sets ``stop``: a request waiting with no limit gives up at once, refused."""
    holder = _hold_in_child(tmp_path, "s", 600)
    stop, outcome = threading.Event(), []

    def wait() -> None:
        try:
            SessionLease(tmp_path, "s", SessionWait(None, outcome.append, stop))
        except Exception as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    try:
        waiter.start()
        while not outcome:  # told it waits
            time.sleep(0.05)
        stop.set()
        waiter.join(timeout=60)
        assert not waiter.is_alive()
    finally:
        holder.kill()
        holder.wait()
    told, refused = outcome
    assert told == f"session 's' is in use by pid {holder.pid}: waiting for it to end"
    assert isinstance(refused, SessionInUseError) and "stopped waiting for it (shutting down)" in str(refused)


def test_a_request_that_leaves_while_it_waits_gives_the_session_back(tmp_path):
    """A client gone while its request waits (--wait-session): the lease the waiting thread still gets
    once the holder ends is released, not kept by the server for ever (other processes refused)."""
    holder = _hold_in_child(tmp_path, "s", 600)
    lock = session_lock.session_lock_path(tmp_path, "s")
    key = lock.parent.resolve() / lock.name  # other tests of this process may hold sessions of their own
    told: list[str] = []
    server = SimpleNamespace(  # what wait_for_session uses of a Server
        runtime=SimpleNamespace(kv_dir=tmp_path),
        waiters=ThreadPoolExecutor(1),
        session_wait=SessionWait(None, told.append),
    )

    async def leave_while_waiting() -> None:
        request = asyncio.ensure_future(Server.wait_for_session(server, "s"))  # type: ignore[arg-type]
        while not told:  # it waits for the holder
            await asyncio.sleep(0.05)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        holder.kill()
        holder.wait()
        server.waiters.shutdown(wait=True)  # the thread has taken the lease the request no longer wants
        deadline = time.monotonic() + 30  # a few turns of the loop suffice; no timing measured
        while key in session_lock._HELD and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the loop runs the release

    try:
        asyncio.run(leave_while_waiting())
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert key not in session_lock._HELD
    again = _hold_in_child(tmp_path, "s", 0)  # another process gets the session at once
    assert again.wait(timeout=WAIT_S) == 0
