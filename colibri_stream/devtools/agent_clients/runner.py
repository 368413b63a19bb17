"""`tools/agent_clients.py`: the real agents, two turns each, against `colibri-stream serve`, and the table.

The server runs as a child process (`python -m colibri_stream serve MODEL --api-key KEY --request-log
FILE`, a fresh KV directory, so the prefix cache starts empty); each client runs in a fresh working
directory holding hello.py, with HOME (and so every config and session store) inside the run's folder,
its two turns each bounded by a timeout (the process group is killed past it). What a turn sent is read
from the server's request log (serve/request_log.py): the lines written while the turn ran.

A turn's *main request* is its model request (chat, Messages or Responses) with the most prompt tokens:
agents also send short side requests (a title, a quota probe); a turn with a refused model request has
none (its numbers show as "-"). TTFT and cached tokens in the table are
those of turn 1's and turn 2's main requests, as the server measured them (arrival to first token).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colibri_stream.devtools.agent_clients.clients import CLIENTS, QUIET_ENV, Client, Target
from colibri_stream.devtools.agent_clients.recorder import Recorder

MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
PROMPTS = (
    "What does hello.py print? Answer in one sentence.",
    "Now add a comment at the top of hello.py that says what it does.",
)
HELLO = 'def main():\n    print("hello, world")\n\n\nif __name__ == "__main__":\n    main()\n'
SERVE_START_S = 600.0
OUTPUT_TAIL = 1500  # characters of a client's output kept for the report


@dataclass
class TurnRun:
    exit_status: int | None  # None: killed at the time limit
    seconds: float
    requests: list[dict[str, Any]]
    output_tail: str

    def main_request(self) -> dict[str, Any] | None:
        """None when a model request of the turn was refused: the request left is then a side one (a
        title), whose numbers would pass for the agent's."""
        model = [r for r in self.requests if r["method"] == "POST" and r["route"] in MODEL_ROUTES]
        answered = [r for r in model if r["status"] == 200 and r["prompt_tokens"] is not None]
        if not answered or any(r["status"] >= 400 for r in model):
            return None
        return max(answered, key=lambda r: r["prompt_tokens"])


@dataclass
class ClientRun:
    client: Client
    version: str
    turns: list[TurnRun] = field(default_factory=list)

    def failures(self) -> list[str]:
        """Each distinct refused request: 'STATUS METHOD ROUTE: message' (first seen first)."""
        seen: dict[str, None] = {}
        for turn in self.turns:
            for r in turn.requests:
                if r["status"] >= 400:
                    seen[f"{r['status']} {r['method']} {r['route']}: {_message(r['error'])}"] = None
        return list(seen)


def _message(error: str | None) -> str:
    try:
        body = json.loads(error or "")
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return (error or "").strip()


class RequestLogReader:
    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new_lines(self) -> list[dict[str, Any]]:
        with self.path.open() as log:
            log.seek(self.offset)
            text = log.read()
        complete = text[: text.rfind("\n") + 1]
        self.offset += len(complete.encode())
        return [json.loads(line) for line in complete.splitlines() if line]


@contextmanager
def served(
    model: Path, work: Path, key: str, model_name: str, log: Callable[[str], None], extra: Sequence[str] = ()
) -> Iterator[int]:
    """`colibri-stream serve` on ``model`` (with the ``extra`` flags) in a child process; yields its port once
    /health answers."""
    port = _free_port()
    argv = [sys.executable, "-m", "colibri_stream", "serve", str(model), "--port", str(port), "--api-key", key, *extra]
    argv += ["--model-name", model_name, "--kv-dir", str(work / "kv"), "--request-log", str(work / "requests.jsonl")]
    log(" ".join(argv[1:]))
    with (work / "serve.log").open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVE_START_S
        while not _healthy(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start; its output is in {work / 'serve.log'}")
            time.sleep(0.5)
        yield port
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def client_version(client: Client, cache: Path) -> str:
    try:
        done = subprocess.run(client.version_argv(cache), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"? ({type(exc).__name__})"
    return (done.stdout.strip() or done.stderr.strip()).splitlines()[-1] if done.returncode == 0 else "?"


def run_turn(argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> tuple[int | None, float, str]:
    """(exit status or None when killed at the limit, seconds, the output's tail); stdin is empty."""
    started = time.monotonic()
    with (cwd.parent / "output.log").open("a+") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        begin = out.tell()
        process = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            status: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = None
        out.seek(begin)
        tail = out.read()[-OUTPUT_TAIL:]
    return status, time.monotonic() - started, tail


def run_client(
    client: Client, cache: Path, work: Path, target: Target, log_reader: RequestLogReader, timeout_s: float
) -> ClientRun:
    folder = work / client.label
    (folder / "home").mkdir(parents=True, exist_ok=True)
    (folder / "project").mkdir(exist_ok=True)
    (folder / "project" / "hello.py").write_text(HELLO)
    result = ClientRun(client, client_version(client, cache))
    base_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(folder / "home"), "LANG": "C.UTF-8"}
    base_env |= {"CODEX_HOME": str(folder / "home" / ".codex"), **QUIET_ENV}
    (folder / "home" / ".codex").mkdir(exist_ok=True)
    log_reader.new_lines()  # what came before belongs to no turn of this client
    for number, prompt in enumerate(PROMPTS, start=1):
        turn = client.turn(cache, target, number, prompt)
        status, seconds, tail = run_turn(turn.argv, {**base_env, **turn.env}, folder / "project", timeout_s)
        time.sleep(0.5)  # the last answer's log line is written as its response ends
        result.turns.append(TurnRun(status, seconds, log_reader.new_lines(), tail))
    return result


def run_all(
    model: Path,
    cache: Path,
    work: Path,
    labels: list[str],
    timeout_s: float,
    record: Path | None,
    log: Callable[[str], None],
    serve_flags: Sequence[str] = (),
) -> list[ClientRun]:
    key, name = "sk-colibri-agents", "demo"
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    with served(model, work, key, name, log, serve_flags) as port:
        recorder = Recorder(port, record).start() if record is not None else None
        origin = f"http://127.0.0.1:{recorder.port if recorder else port}"
        reader = RequestLogReader(work / "requests.jsonl")
        try:
            for client in (c for c in CLIENTS if c.label in labels):
                if recorder is not None:
                    recorder.label = client.label
                log(f"running {client.name} (two turns, at most {timeout_s:.0f} s each)")
                runs.append(run_client(client, cache, work, Target(origin, key, name), reader, timeout_s))
                log(table(runs[-1:]))
        finally:
            if recorder is not None:
                recorder.stop()
    return runs


def _seconds(request: dict[str, Any] | None) -> str:
    return f"{request['ttft_s']:.2f} s" if request is not None and request["ttft_s"] is not None else "-"


def _cached(request: dict[str, Any] | None) -> str:
    if request is None or request["cached_tokens"] is None:
        return "-"
    share = request["cached_tokens"] / max(1, request["prompt_tokens"])
    return f"{request['cached_tokens']:,} of {request['prompt_tokens']:,} ({share:.0%})"


def table(runs: list[ClientRun]) -> str:
    """The Markdown table: one row per client."""
    head = "| client | version | exit status (turn 1, 2) | turns exit 0 | requests (200 / all) | tool calls parsed |"
    head += " TTFT 1st | TTFT 2nd | cached tokens, 2nd |"
    rows = [head, "|" + "---|" * 9]
    for run in runs:
        statuses = ", ".join("timeout" if t.exit_status is None else str(t.exit_status) for t in run.turns)
        requests = [r for t in run.turns for r in t.requests if r["route"] != "/health"]
        answered = sum(1 for r in requests if r["status"] == 200)
        calls = sum(r["tool_calls"] for r in requests)
        first, second = (run.turns[i].main_request() if len(run.turns) > i else None for i in (0, 1))
        ok = sum(1 for t in run.turns if t.exit_status == 0)
        cells = [run.client.name, run.version, statuses, f"{ok} / {len(run.turns)}", f"{answered} / {len(requests)}"]
        cells += [str(calls), _seconds(first), _seconds(second), _cached(second)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def report(runs: list[ClientRun]) -> str:
    """The table, then each client's refusals and the tail of a failed turn's output."""
    lines = [table(runs), ""]
    for run in runs:
        failures = run.failures()
        bad = [t for t in run.turns if t.exit_status != 0]
        if not failures and not bad:
            continue
        lines.append(f"{run.client.name}:")
        lines += [f"  refused: {failure}" for failure in failures]
        if bad:
            last = bad[0].output_tail.strip().splitlines()[-3:]
            lines += [f"  output: {line[:300]}" for line in last]
    return "\n".join(lines)


def extract_fixtures(record: Path, out: Path, runs: list[ClientRun]) -> list[Path]:
    """Each client's first-turn main request as recorded (the model POST with the largest body among its
    first requests, before turn 2 began) -> OUT/<label>_recorded.json, with the client's version."""
    written = []
    for run in runs:
        folder = record / run.client.label
        turn_one = len(run.turns[0].requests) if run.turns else 0
        recorded = sorted(folder.glob("*.json"))[: max(turn_one, 1)] if folder.is_dir() else []
        posts = [json.loads(p.read_text()) for p in recorded]
        posts = [p for p in posts if p["method"] == "POST" and p["path"].split("?")[0] in MODEL_ROUTES]
        if not posts:
            continue
        main = max(posts, key=lambda p: len(json.dumps(p["body"])))
        target = out / f"{run.client.label}_recorded.json"
        target.write_text(json.dumps({"client_version": run.version, **main}, indent=1, ensure_ascii=False) + "\n")
        written.append(target)
    return written
