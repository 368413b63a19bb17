"""A lost worker costs seconds, never the conversation: a local worker killed (-9) or stopped (SIGSTOP,
past a 2 s --worker-timeout) at a random step of `run`, `chat` or `serve` over 2 or 3 local workers; the
turn completes with the tokens one process gives, the session log stays usable, the failover is in the
stats; started again with its own command line, the worker rejoins and serves again (chat: between
turns; serve: between steps). A worker whose disk fails mid-run says why and is served around the
same way. Every worker process a test starts or finds is ended in its finally.

Coordinators of `run` are real processes (the CLI); `chat` and `serve` coordinate in this process (their
workers are its children), so the test can hold the next user line / request until the worker is back."""

from __future__ import annotations

import io
import json
import logging
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import psutil
import pytest

from colibri_stream import cli
from colibri_stream.experts.cluster.local import free_port
from tests.test_colibri_stream.experts.cluster.test_worker_faults import (
    colibri,
    gone,
    hand_started,
    in_process,
    workers_of,
)

TIMEOUT_S = 2
PROMPT = "5,9,2,7"
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
SEED = random.randrange(1 << 30)  # printed on failure: the steps and victims a run drew


def rng(*salt: object) -> random.Random:
    return random.Random(f"{SEED}-{salt}")


def grown(kv_dir: Path, at_least: int, within: float = 120) -> None:
    """Until the one session log under ``kv_dir`` holds ``at_least`` bytes (a turn under way)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        logs = list(kv_dir.rglob("*.kvlog"))
        if logs and logs[0].stat().st_size >= at_least:
            return
        time.sleep(0.01)
    raise AssertionError(f"seed {SEED}: no session log reached {at_least} B under {kv_dir}")


def local_workers(count: int, parent: psutil.Process | None = None) -> list[psutil.Process]:
    parent = parent or psutil.Process()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = [p for p in parent.children() if "--rank" in _command_line(p)]
        if len(found) == count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{count} workers never started")


def _command_line(process: psutil.Process) -> list[str]:
    """A child's command line; none for one that has exited (a zombie not yet reaped, e.g. an earlier
    test's child): psutil raises for those, which killed the fault thread of a chat test once."""
    try:
        return process.cmdline()
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return []


def end_all(processes: list[psutil.Process | subprocess.Popen]) -> None:
    for process in processes:
        try:
            process.kill()
            process.wait(30)
        except (psutil.Error, ProcessLookupError):
            pass


def rank_of(process: psutil.Process) -> int:
    line = process.cmdline()
    return int(line[line.index("--rank") + 1])


def restart(command: list[str]) -> subprocess.Popen:
    """The lost worker started again with the same flags."""
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class LogWatch(logging.Handler):
    """Sets ``back`` when the coordinator logs that a worker rejoined and is set up; keeps every line."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.back = threading.Event()
        self.lost = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.lines.append(text)
        if "is back and set up" in text:
            self.back.set()
        if "until it rejoins" in text:
            self.lost.set()


@pytest.fixture
def log_watch():
    watch = LogWatch()
    logger = logging.getLogger("colibri_stream.experts.cluster.coordinator")
    logger.addHandler(watch)
    yield watch
    logger.removeHandler(watch)


def one_process_ids(container: Path, tmp_path: Path, tokens: int) -> list[int]:
    status, out, err = in_process(
        "run", container, "--ids", PROMPT, "--max-new-tokens", tokens, "--json", "--kv-dir", tmp_path / "alone"
    )
    assert status == 0, err
    return json.loads(out.splitlines()[-1])["ids"]


# ------------------------------------------------------------------------------------------- run
@pytest.mark.parametrize("fault, workers", [("kill", 2), ("stop", 3), ("stop", 2), ("kill", 3)])
def test_run_finishes_with_one_process_tokens_when_a_worker_is_lost(make_container, tmp_path, fault, workers):
    container, tokens, kv = make_container("deepseek_v3", "int4"), 150, tmp_path / "kv"
    expected = one_process_ids(container, tmp_path, tokens)
    command = colibri(
        "run", container, "--ids", PROMPT, "--max-new-tokens", tokens, "--local-workers", workers, "--json",
        "--worker-timeout", TIMEOUT_S, "--ram", "40%", "--session", "s", "--kv-dir", kv, "--kv-sync-every", "1",
    )  # fmt: skip
    coordinator = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    found: list[psutil.Process] = []
    try:
        found = workers_of(coordinator, workers)
        draw = rng(fault, workers)
        grown(kv, draw.randrange(12_000, 50_000))  # a random step of the ~150 (about 600 B a position)
        victim = draw.choice(found)
        victim_rank = rank_of(victim)
        victim.send_signal(SIGNALS[fault])
        out, err = coordinator.communicate(timeout=120)
    finally:
        end_all([coordinator, *found])
    assert coordinator.returncode == 0, f"seed {SEED}: {err}"
    result = json.loads(out.splitlines()[-1])
    assert result["ids"] == expected, f"seed {SEED}"
    stats = result["stats"]
    assert stats["failovers"] == 1
    lost = next(w for w in stats["workers"] if w["rank"] == victim_rank)
    assert lost["state"] == "lost" and lost["failovers"] == 1 and lost["pid"] == victim.pid
    assert ("connection lost" if fault == "kill" else f"no answer within {TIMEOUT_S} s") in lost["last_loss"]
    assert stats["coordinator_share"]["requests"] > 0  # its experts were computed by the coordinator
    assert all(w["state"] == "serving" for w in stats["workers"] if w is not lost)
    assert "Traceback" not in err and f"pid {victim.pid}" in err
    assert gone(found)  # the stopped one too: a lost local worker is ended

    # The session log is intact: one process resumes it, reusing the prompt and what was generated.
    status, out, err = in_process(
        "run", container, "--ids", PROMPT, "--max-new-tokens", "2", "--session", "s", "--kv-dir", kv, "--json"
    )
    assert status == 0, err
    assert json.loads(out.splitlines()[-1])["stats"]["reused_tokens"] >= 3


def test_a_worker_whose_disk_fails_is_lost_with_the_reason_and_the_run_finishes(make_container, tmp_path):
    """A worker started by hand over its own copy of the container; mid-generation the copy's expert files
    vanish (a failing disk): the worker reports why and leaves, the coordinator serves its experts."""
    container, tokens, kv = make_container("deepseek_v3", "int4"), 150, tmp_path / "kv"
    expected = one_process_ids(container, tmp_path, tokens)
    copy = tmp_path / "worker-disk"
    shutil.copytree(container, copy)
    worker, common = hand_started(copy, free_port(), "--ram", "20%")
    command = colibri(
        "run", container, "--ids", PROMPT, "--max-new-tokens", tokens, *common, "--json", "--ram", "40%",
        "--worker-timeout", TIMEOUT_S, "--session", "s", "--kv-dir", kv, "--kv-sync-every", "1",
    )  # fmt: skip
    coordinator = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        grown(kv, rng("disk").randrange(12_000, 40_000))
        shutil.rmtree(copy / "experts")
        out, err = coordinator.communicate(timeout=120)
        worker_status = worker.wait(30)
    finally:
        end_all([coordinator, worker])
    assert coordinator.returncode == 0, f"seed {SEED}: {err}"
    result = json.loads(out.splitlines()[-1])
    assert result["ids"] == expected, f"seed {SEED}"
    (lost,) = result["stats"]["workers"]
    assert lost["state"] == "lost" and "CorruptDataError" in lost["last_loss"] and "missing" in lost["last_loss"]
    assert result["stats"]["coordinator_share"]["requests"] > 0
    assert worker_status == 1 and "Traceback" not in worker.stderr.read()  # a one-line error, not a crash


# ------------------------------------------------------------------------------------------ chat
class HeldStdin(io.StringIO):
    """A chat's stdin: each line once ``ready`` (a callable) allows it."""

    def __init__(self, lines: list[tuple[str, threading.Event | None]]):
        super().__init__()
        self.lines = lines

    def readline(self, size: int | None = -1) -> str:
        if not self.lines:
            return ""
        text, ready = self.lines.pop(0)
        if ready is not None:
            assert ready.wait(120), f"seed {SEED}: held line {text!r} never released"
        return text + "\n"


def chat(container: Path, kv: Path, workers: int, lines: list[tuple[str, threading.Event | None]]) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    stdin, sys.stdin = sys.stdin, HeldStdin(lines)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            flags = ["--local-workers", str(workers)] if workers else []
            args = ["chat", container, "--kv-dir", kv, "--session", "talk", "--max-new-tokens", "120", "--ram", "40%"]
            args += ["--kv-sync-every", "1"]
            status = cli.main([str(a) for a in args] + flags + ["--worker-timeout", str(TIMEOUT_S)])
    finally:
        sys.stdin = stdin
    assert status == 0, err.getvalue()
    return out.getvalue(), err.getvalue()


@pytest.mark.parametrize("fault, workers", [("kill", 3), ("stop", 2)])
def test_chat_keeps_its_conversation_through_a_loss_and_takes_the_worker_back(
    make_container, tmp_path, log_watch, fault, workers
):
    container = make_container("deepseek_v3", "int4")
    script = ["Hello there, tell me a long story", "And another one"]
    expected, _ = chat(container, tmp_path / "alone", 0, [(script[0], None), (":stats", None), (script[1], None)])
    kv, killed, back, started = tmp_path / "kv", threading.Event(), threading.Event(), []

    def strike() -> None:  # during turn 1: a random worker lost, started again once its loss is reported
        found = local_workers(workers)
        started.extend(found)
        draw = rng("chat", fault, workers)
        grown(kv, draw.randrange(8_000, 30_000))
        victim = draw.choice(found)
        command = victim.cmdline()
        victim.send_signal(SIGNALS[fault])
        killed.set()
        assert log_watch.lost.wait(60)
        started.append(restart(command))
        back.set()

    thread = threading.Thread(target=strike, daemon=True)
    thread.start()
    try:
        got, err = chat(
            container,
            kv,
            workers,
            [
                (script[0], None),
                (":stats", killed),  # meets the loss if turn 1 ended before the kill landed
                (script[1], log_watch.back),
                (":stats", None),
            ],
        )
        thread.join(60)
        assert back.is_set(), f"seed {SEED}: the fault thread never ran: {log_watch.lines}"
        rejoined_status = started[-1].wait(30)  # before end_all kills whatever is left
    finally:
        end_all(started)
    assert got == expected, f"seed {SEED}"
    store = json.loads(err.strip().splitlines()[-1])["store"]
    assert store["failovers"] == 1
    (rejoined,) = [w for w in store["workers"] if w["state"] == "rejoined"]
    assert rejoined["pid"] == started[-1].pid and rejoined["requests_this_process"] > 0  # used again in turn 2
    assert rejoined["seconds_lost"] > 0
    assert ("connection lost" if fault == "kill" else f"no answer within {TIMEOUT_S} s") in rejoined["last_loss"]
    assert rejoined_status == 0  # the rejoined worker was told to stop with the others


# ----------------------------------------------------------------------------------------- serve
@pytest.mark.parametrize("fault, workers", [("stop", 2), ("kill", 3)])
def test_serve_answers_through_a_lost_worker_and_takes_it_back(make_container, tmp_path, log_watch, fault, workers):
    """Two requests in flight (two slots, batched) when a worker is lost: both finish with one process's
    text (no 5xx); the worker started again rejoins between steps and serves the next request."""
    from colibri_stream.serve.app import Server
    from tests.test_colibri_stream.experts.cluster.test_worker_serve import PROMPTS, cluster_runtime
    from tests.test_colibri_stream.serve.test_dashboard import MODEL, request, serving

    container = make_container("deepseek_v3", "int4")

    def complete(port: int, prompt: str) -> tuple[int, dict]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0}
        status, _, reply = request(port, "POST", "/v1/completions", body)
        return status, json.loads(reply)

    alone = cluster_runtime(container, tmp_path / "alone", 0)
    try:
        with serving(Server(alone, slots=1, max_queue=2)) as port:
            expected = [complete(port, prompt)[1]["choices"][0]["text"] for prompt in PROMPTS]
    finally:
        alone.close()
    runtime = cluster_runtime(container, tmp_path / "kv", workers, timeout_s=TIMEOUT_S)
    started: list = local_workers(workers)
    try:
        with serving(Server(runtime, slots=2, max_queue=2)) as port:
            replies: dict[int, tuple[int, dict]] = {}

            def client(i: int) -> None:
                replies[i] = complete(port, PROMPTS[i])

            clients = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
            for thread in clients:
                thread.start()
            time.sleep(rng("serve", fault, workers).uniform(0.2, 1.0))  # a random step of the requests in flight
            victim = rng("serve", "victim", fault, workers).choice(started[:workers])
            command = victim.cmdline()
            victim.send_signal(SIGNALS[fault])
            for thread in clients:
                thread.join(120)
            for i, text in enumerate(expected):
                status, reply = replies[i]
                assert status == 200 and reply["choices"][0]["text"] == text, f"seed {SEED}: {reply}"
            assert log_watch.lost.wait(60)  # (requests that ended before the fault meet it in the next)
            started.append(restart(command))
            assert log_watch.back.wait(120), log_watch.lines
            status, reply = complete(port, PROMPTS[0])  # between steps it takes its share back
            assert status == 200 and reply["choices"][0]["text"] == expected[0]
            report = runtime.loaded.experts.report()
    finally:
        runtime.close()
        end_all(started)
    assert report["failovers"] == 1
    (rejoined,) = [w for w in report["workers"] if w["state"] == "rejoined"]
    assert rejoined["pid"] == started[-1].pid and rejoined["requests_this_process"] > 0
    assert ("connection lost" if fault == "kill" else f"no answer within {TIMEOUT_S} s") in rejoined["last_loss"]


# -------------------------------------------------------------------------------------- replicas
def test_replicas_serve_a_lost_workers_experts_without_the_coordinator(make_container, tmp_path):
    """Every expert held twice (--replicas = experts per layer): after a loss the survivor computes them
    all, the coordinator none; before it both holders were asked (the less-loaded one each time)."""
    from colibri_stream.checkpoint.fingerprint import container_fingerprint
    from colibri_stream.experts.cluster.group import ClusterOptions
    from colibri_stream.planning.budget import StoreOptions
    from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, load_runtime, run_turn
    from storage.container.reader import Container
    from storage.tiers.history import UsageHistory

    path = make_container("deepseek_v3", "int4")
    container = Container(path)
    n = container.n_experts
    history = UsageHistory(n, container_fingerprint(container), {layer: [1.0] * n for layer in container.moe_layers})
    history.save(tmp_path / "usage.json")
    prompt = [int(i) for i in PROMPT.split(",")]
    expected = one_process_ids(path, tmp_path, 8)
    cluster = ClusterOptions(local_workers=2, timeout_s=TIMEOUT_S, replicas=n)
    store = StoreOptions(ram="100%", history=str(tmp_path / "usage.json"))
    runtime = load_runtime(path, RuntimeOptions(store=store, kv_dir=tmp_path / "kv", text=False, cluster=cluster))
    found = local_workers(2)
    try:
        experts = runtime.loaded.experts
        assert run_turn(runtime, prompt, TurnOptions(max_new_tokens=8)).ids == expected
        before = experts.report()
        assert before["replicas"] == n and all(w["requests"] > 0 for w in before["workers"])
        victim = rng("replicas").choice(found)
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
        experts.snapshot()  # the loss is met here, between turns: nothing in flight to compute again
        assert run_turn(runtime, prompt, TurnOptions(max_new_tokens=8)).ids == expected
        after = experts.report()
    finally:
        runtime.close()
        end_all(found)
    assert after["failovers"] == 1 and after["coordinator_share"]["requests"] == 0
    survivor = next(w for w in after["workers"] if w["state"] == "serving")
    assert survivor["requests"] > next(w for w in before["workers"] if w["rank"] == survivor["rank"])["requests"]
