"""Faults around the workers (a worker lost mid-generation is test_failover.py's): a coordinator that
dies takes its workers down too; a worker of another model, or one whose budget cannot hold its share,
is refused with the reason. Coordinators and workers run as real processes (the CLI);
the runs around them that only read a result (a resume, a one-process reference, a chat over a local
worker) run through cli.main in this process."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import psutil

from colibri_stream import cli
from colibri_stream.experts.cluster.local import free_port
from colibri_stream.experts.cluster.wire import FRAME_BYTES

TIMEOUT_S = 8


def colibri(*args: str) -> list[str]:
    return [sys.executable, "-m", "colibri_stream", *map(str, args)]


def in_process(*args: object, script: str = "") -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `colibri-stream ARGS` run by cli.main here, ``script`` its stdin."""
    out, err = io.StringIO(), io.StringIO()
    stdin, sys.stdin = sys.stdin, io.StringIO(script)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            status = cli.main([str(arg) for arg in args])
    finally:
        sys.stdin = stdin
    return status, out.getvalue(), err.getvalue()


def start_generation(container: Path, kv_dir: Path, workers: int = 2) -> subprocess.Popen:
    """A long generation over local workers, its session log appended after every token."""
    command = colibri(
        "run", container, "--ids", "5,9,2,7", "--max-new-tokens", "400", "--local-workers", workers,
        "--worker-timeout", TIMEOUT_S, "--ram", "40%", "--session", "s", "--kv-dir", kv_dir, "--kv-sync-every", "1",
    )  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _command_line(process: psutil.Process) -> list[str]:
    """[] for a child gone or not yet reaped (a short-lived helper the coordinator started is briefly a zombie)."""
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def workers_of(coordinator: subprocess.Popen, count: int) -> list[psutil.Process]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = [p for p in psutil.Process(coordinator.pid).children() if "worker" in _command_line(p)]
        if len(children) == count:
            return children
        time.sleep(0.05)
    raise AssertionError(f"{count} workers never started")


def wait_for_generation(kv_dir: Path) -> None:
    """Until the session's log holds some generated positions (the turn is under way)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        logs = list(kv_dir.rglob("*.kvlog"))
        if logs and logs[0].stat().st_size > 64 * 1024:
            return
        time.sleep(0.02)
    raise AssertionError(f"no session log grew under {kv_dir}")


def finish(process: subprocess.Popen, within: float) -> tuple[int, str]:
    started = time.monotonic()
    _, err = process.communicate(timeout=within)
    assert time.monotonic() - started < within
    return process.returncode, err


def gone(processes: list[psutil.Process], within: float = 15.0) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=within)
    return not alive


def test_workers_end_when_the_coordinator_dies(make_container, tmp_path):
    coordinator = start_generation(make_container("deepseek_v3", "int4"), tmp_path / "kv")
    workers = workers_of(coordinator, 2)
    wait_for_generation(tmp_path / "kv")
    coordinator.kill()
    coordinator.communicate()
    assert gone(workers)


def hand_started(container: Path, port: int, *flags: str) -> tuple[subprocess.Popen, list]:
    """A worker started by hand (rank 1 of a world of 2), and the flags its coordinator needs."""
    common = ["--world-size", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    worker = subprocess.Popen(
        colibri("worker", container, "--rank", "1", *common, "--disk-speed", "0", *flags),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return worker, common


def test_a_worker_of_another_model_is_refused(make_container, tmp_path):
    port = free_port()
    worker, common = hand_started(make_container("deepseek_v32", "int4"), port)
    run = subprocess.run(
        colibri("run", make_container("deepseek_v3", "int4"), "--ids", "1,2", *common, "--kv-dir", tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert "worker 1 (" in run.stderr and "serves another model or container" in run.stderr
    assert worker.wait(timeout=30) == 1  # it learns the coordinator is gone


def test_a_worker_whose_budget_cannot_hold_its_share_is_refused(make_container, tmp_path):
    port = free_port()
    container = make_container("deepseek_v3", "int4")
    worker, common = hand_started(container, port, "--ram", "1KiB")
    run = subprocess.run(
        colibri("run", container, "--ids", "1,2", *common, "--kv-dir", tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert "worker 1 (" in run.stderr and "cannot take its share" in run.stderr and "RAM budget" in run.stderr
    assert worker.wait(timeout=30) != 0
    assert "Traceback" not in run.stderr


def test_hand_started_worker_serves_a_turn(make_container, tmp_path):
    """The by-hand path (--world-size/--master-port + `colibri-stream worker`) gives one process's tokens."""
    container = make_container("deepseek_v3", "int4")
    status, alone, err = in_process(
        "run", container, "--ids", "3,1,4,1,5", "--max-new-tokens", "5", "--json", "--kv-dir", tmp_path
    )
    assert status == 0, err
    worker, common = hand_started(container, free_port(), "--ram", "50%")
    run = subprocess.run(
        colibri("run", container, "--ids", "3,1,4,1,5", "--max-new-tokens", "5", "--json", *common)
        + ["--kv-dir", tmp_path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert worker.wait(timeout=30) == 0  # told to stop, not left behind
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["ids"] == json.loads(alone.splitlines()[-1])["ids"]
    stats = result["stats"]
    (only,) = stats["workers"]
    assert only["rank"] == 1 and only["experts_held"] == 2 * 16  # every record of the 2 MoE layers
    assert only["requests"] == stats["expert_requests"] == only["hits"] + only["misses"] > 0  # one turn only
    assert only["expert_bytes_read"] == stats["expert_bytes_read"] > 0
    network = stats["network"]
    tokens = 5 + 4  # the prompt and the generated tokens fed back (the last one is not)
    assert network["layer_requests"] == 2 * (1 + 4)  # a prefill and 4 decode steps through 2 MoE layers
    assert network["bytes_per_token"] == round((network["bytes_sent"] + network["bytes_received"]) / tokens)
    # float64 partial sums [rows, dim 64] per layer, each in one sealed frame (head and tags: FRAME_BYTES)
    assert network["bytes_received"] == tokens * 2 * 64 * 8 + network["layer_requests"] * FRAME_BYTES
    assert network["round_trip_ms_mean"] > 0


def test_chat_over_a_local_worker(make_container, tmp_path):
    status, _, err = in_process(
        "chat", make_container("deepseek_v3", "int4"), "--kv-dir", tmp_path, "--session", "talk",
        "--max-new-tokens", "4", "--local-workers", "1", "--ram", "60%", script="Hello there\n:stats\n",
    )  # fmt: skip
    assert status == 0, err
    store = json.loads(err.strip().splitlines()[-1])["store"]
    assert store["store"] == "workers" and store["workers"][0]["requests"] == store["expert_requests"] > 0
