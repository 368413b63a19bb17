"""Hostile path arguments, state files and counts (#39): `--trace` a FIFO (it blocked in open() forever),
a directory or /dev/full; a damaged `<session>.chat.json`; `--kv-dir`, `convert`'s destination and
`bench --work` a file; a history in a missing directory; `io.threads`, `--io-threads` and
`--local-workers` in the thousands; local workers that fail to start part-way (no orphans); a stray
client on the cluster's rendezvous (it hung the coordinator for GROUP_TIMEOUT). Each is one typed line
naming the path or flag, at once, and loses nothing."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from colibri_stream import cli
from colibri_stream.errors import SessionError
from colibri_stream.experts.cluster import local
from colibri_stream.experts.cluster.wire import WorkerError
from colibri_stream.planning.budget import load_budget_file
from colibri_stream.runtime.kv.transcript import load_transcript
from storage.errors import BudgetError  # the library's BudgetError derives from it
from storage.files.safe_read import NotRegularFileError, OutputPathError
from storage.tiers.config import MAX_IO_THREADS, StoreConfig
from storage.tiers.history import UsageHistory
from storage.tiers.trace import TraceWriter


@pytest.fixture
def no_hang():
    """A call that would block forever fails the test in 10 s instead."""

    def expire(*_):
        raise TimeoutError("blocked")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"colibri-stream {command}: error: "), err
    return err[0]


def run_argv(model, *extra: str) -> list[str]:
    return ["run", str(model), "--prompt", "hi", "--max-new-tokens", "2", *extra]


# ------------------------------------------------------------------------------------------- trace
@pytest.mark.parametrize("kind", ["fifo", "dir", "dev-full", "missing-dir", "file-parent"])
def test_a_trace_path_that_cannot_be_a_file_is_refused_at_once(tmp_path, no_hang, kind):
    path = {
        "fifo": tmp_path / "trace",
        "dir": tmp_path,
        "dev-full": "/dev/full",
        "missing-dir": tmp_path / "nowhere" / "trace",
        "file-parent": tmp_path / "file" / "trace",
    }[kind]
    if kind == "fifo":
        os.mkfifo(path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        (OutputPathError, NotRegularFileError), match="not a regular file|does not exist|is a file"
    ) as error:
        TraceWriter(path)  # was: a FIFO blocked here forever; the others were tracebacks
    assert str(path) in str(error.value)


def test_a_trace_to_dev_full_is_one_line_from_run(make_container, tmp_path, capsys):
    container = make_container("deepseek_v3")
    assert cli.main(run_argv(container, "--kv-dir", str(tmp_path), "--trace", "/dev/full")) == 1
    assert "/dev/full: routing trace is a character device" in one_error_line(capsys, "run")


def test_a_trace_over_an_old_file_replaces_it(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("old and longer than what follows\n" * 10)
    writer = TraceWriter(path)
    writer.write(0, [1, 2])
    writer.close()
    assert path.read_text() == '{"layer": 0, "experts": [1, 2]}\n'


# ------------------------------------------------------------------------------------- transcripts
DAMAGED = {
    "truncated": b'{"messages": [{"role": "user", "con',
    "a list": b"[]",
    "wrong entries": b'{"messages": [1, 2]}',
    "no content": b'{"messages": [{"role": "user"}]}',
    "not UTF-8": b'{"messages": [{"role": "user", "content": "\xff"}]}',
}


@pytest.mark.parametrize("content", DAMAGED.values(), ids=DAMAGED.keys())
def test_a_damaged_transcript_is_a_session_error_naming_it_and_reset(tmp_path, content):
    path = tmp_path / "s.chat.json"
    path.write_bytes(content)
    with pytest.raises(SessionError, match="chat --reset") as error:
        load_transcript(path, "s")
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert path.read_bytes() == content  # left for its owner to recover


def test_chat_on_a_damaged_transcript_is_one_line_and_reset_starts_over(
    tiny_checkpoints, tmp_path, capsys, monkeypatch
):
    path = tmp_path / "s.chat.json"
    path.write_bytes(b"[]")
    argv = ["chat", str(tiny_checkpoints["deepseek_v3"]), "--kv-dir", str(tmp_path), "--session", "s"]
    argv += ["--max-new-tokens", "2"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert cli.main(argv) == 1  # was: AttributeError, a traceback (exit 3)
    assert f"{path}: chat transcript" in one_error_line(capsys, "chat")
    assert path.read_bytes() == b"[]"
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert cli.main([*argv, "--reset"]) == 0
    assert [m["role"] for m in json.loads(path.read_text())["messages"]] == ["user", "assistant"]


# ---------------------------------------------------------------------------- directories as files
def test_kv_dir_a_file_is_one_line(make_container, tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("mine")
    argv = run_argv(make_container("deepseek_v3"), "--kv-dir", str(file), "--session", "s")
    assert cli.main(argv) == 1  # was: FileExistsError, a traceback
    assert f"{file}: --kv-dir must be a directory, and it is a file" in one_error_line(capsys, "run")
    assert file.read_text() == "mine"


def test_convert_into_a_file_is_one_line(tiny_checkpoints, tmp_path, capsys):
    file = tmp_path / "out.cstream"
    file.write_text("mine")
    for dst in (file, file / "inside"):
        assert cli.main(["convert", str(tiny_checkpoints["deepseek_v3"]), str(dst), "--no-progress"]) == 1
        assert f"{dst}: the destination container must be a directory" in one_error_line(capsys, "convert")
    assert file.read_text() == "mine"


def test_bench_work_a_file_is_one_line(tmp_path, capsys):
    file = tmp_path / "work"
    file.write_text("mine")
    argv = ["bench", "--quick", "--work", str(file), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 1
    assert f"{file}: --work must be a directory, and it is a file" in one_error_line(capsys, "bench")


# ----------------------------------------------------------------------------------------- history
def test_a_history_in_a_missing_directory_is_refused_when_loaded(tmp_path):
    path = tmp_path / "gone" / "history.json"
    with pytest.raises(OutputPathError, match="directory .*gone does not exist") as error:
        UsageHistory.load(path, n_experts=4)  # was: accepted, then a traceback after the first turn
    assert str(path) in str(error.value)
    assert UsageHistory.load(tmp_path / "history.json", n_experts=4).counts == {}  # a new one is fine


def test_run_with_a_history_in_a_missing_directory_is_one_line(make_container, tmp_path, capsys):
    history = tmp_path / "gone" / "h.json"
    assert cli.main(run_argv(make_container("deepseek_v3"), "--kv-dir", str(tmp_path), "--history", str(history))) == 1
    assert "cannot write usage history" in one_error_line(capsys, "run")


def test_a_history_path_with_a_nul_byte_from_a_budget_file_is_one_line(make_container, tmp_path, capsys):
    """A budget's history = "\\u0000" (no file name can hold NUL: os.stat raised ValueError, a traceback;
    found by the 30-minute fuzz run)."""
    budget = tmp_path / "budget.toml"
    budget.write_text('[memory]\nram = "50%"\n[cache]\npolicy = "pinned"\nhistory = "\\u0000"\n')
    argv = ["run", str(make_container("deepseek_v3")), "--ids", "5,6", "--max-new-tokens", "1", "--budget", str(budget)]
    assert cli.main([*argv, "--kv-dir", str(tmp_path)]) == 1
    assert "usage history cannot be there: the path holds a NUL byte" in one_error_line(capsys, "run")


# ------------------------------------------------------------------------------------------ counts
def test_io_threads_are_bounded_in_the_budget_file_the_flag_and_the_store(tmp_path, capsys):
    budget = tmp_path / "budget.toml"
    budget.write_text("[io]\nthreads = 100000\n")
    with pytest.raises(BudgetError, match=f"io.threads must be 1..{MAX_IO_THREADS}, got 100000"):
        load_budget_file(budget)
    with pytest.raises(BudgetError, match=f"1..{MAX_IO_THREADS}"):
        StoreConfig(ram_bytes=0, threads=100000)
    with pytest.raises(SystemExit) as exit_status:
        cli.main(["run", "model", "--prompt", "x", "--io-threads", "100000"])
    assert exit_status.value.code == 2
    assert f"at most {MAX_IO_THREADS} disk reader threads" in capsys.readouterr().err
    budget.write_text(f"[io]\nthreads = {MAX_IO_THREADS}\n")
    assert load_budget_file(budget)["threads"] == MAX_IO_THREADS


def test_local_workers_are_bounded_before_the_model_loads(tmp_path, capsys):
    argv = ["run", str(tmp_path / "no-model"), "--prompt", "x", "--local-workers", "1000"]
    assert cli.main(argv) == 1
    assert f"--local-workers must be 0..{local.MAX_LOCAL_WORKERS}, got 1000" in one_error_line(capsys, "run")


def test_workers_started_before_one_fails_are_killed_and_reaped(monkeypatch):
    real_popen = subprocess.Popen
    started: list[subprocess.Popen] = []

    def popen(command, **kwargs):
        if len(started) == 3:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs))
        return started[-1]

    before = {child.pid for child in psutil.Process().children()}
    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(WorkerError, match="cannot start local worker 4 of 5 .*temporarily unavailable"):
        local.LocalWorkers.start("model", 5, 1, lambda rank: [], b"k" * 64)
    assert len(started) == 3 and all(process.returncode is not None for process in started)
    assert {child.pid for child in psutil.Process().children()} == before  # killed and reaped: no zombies


# ------------------------------------------------------------------------------------- rendezvous
def test_a_stray_client_on_the_workers_port_is_closed_and_the_wait_ends_within_the_timeout():
    """A program that connects to --master-port and sends garbage, or nothing, never reaches the
    coordinator: the listener closes it (garbage at once, silence after its hello timeout), and the wait for
    the workers ends with a WorkerError at its own timeout (on torch's TCPStore it waited 10 minutes)."""
    from colibri_stream.experts.cluster.group import _gather
    from colibri_stream.experts.cluster.rendezvous import Listener

    listener = Listener(local.LOCALHOST, 0, hello_timeout_s=1.0, key=b"k" * 64)
    try:
        garbage = socket.create_connection((local.LOCALHOST, listener.port))
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 8)
        silent = socket.create_connection((local.LOCALHOST, listener.port))
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker\(s\) \[1\] did not join .* within 2 s"):
            _gather(listener, 2, 2.0, dict)
        assert time.monotonic() - start < 8
        for client in (garbage, silent):
            client.settimeout(10)
            try:
                assert client.recv(1) == b""  # closed by the listener, never handed to the coordinator
            except ConnectionResetError:
                pass  # closed with our bytes unread: the same verdict
            client.close()
    finally:
        listener.close()
