"""The bench's batch rows: aggregate tok/s of `serve` for N concurrent clients against the same N requests
sent one after another, side by side in one server (tools/bench_serve.py runs them alone).

`colibri-stream serve` runs as a child process (--slots and --max-queue = the largest client count, the
prefix cache off: the same prompts are sent again and each run must compute them); the clients are threads
of this process, as an agent's requests come from other processes. For each N, N distinct prompts (greedy,
``max_tokens`` each) run in the order sequential, concurrent, concurrent, sequential, and that round's rates
are the means of its two runs of each kind: measured once each, sequential always first, the second run of
even one client read 1.14-1.21x the first (a process still warming up), which flattered every ratio. A round
of the demo model's 4 clients takes ~0.1 s per run, so one round moved by +-10% from run to run on a shared
host: ``rounds`` rounds are measured and each N's ratio is their median (the rates beside it are that
round's). The 1-client row is the noise floor. Greedy answers of every concurrent run must equal the
sequential run's (batching changes no token).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from colibri_stream.bench.system import ContenderFailed, cli_argv

MODEL_ID = "bench"


@dataclass(frozen=True)
class BatchSettings:
    clients: tuple[int, ...] = (1, 4, 8)
    max_tokens: int = 32
    prompt_tokens: int = 24
    rounds: int = 3
    ram: str = "100%"
    activations: str = "float32"


def complete(port: int, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    """One /v1/completions request -> (text, completion tokens)."""
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=3600) as response:
        answer = json.loads(response.read())
    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]


def measure(port: int, prompts: list[list[int]], max_tokens: int, concurrent: bool) -> tuple[float, list[str]]:
    """(aggregate completion tok/s, texts) for these prompts sent together or one after another."""
    start = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: complete(port, p, max_tokens), prompts))
    else:
        results = [complete(port, p, max_tokens) for p in prompts]
    wall = time.perf_counter() - start
    return sum(tokens for _, tokens in results) / wall, [text for text, _ in results]


def prompts_for(n: int, length: int, vocab: int) -> list[list[int]]:
    """n distinct deterministic prompts of ``length`` token ids (away from the special ids at 0..9)."""
    return [[10 + (97 * i + 31 * j) % (vocab - 10) for j in range(length)] for i in range(n)]


def clients_row(port: int, prompts: list[list[int]], max_tokens: int, rounds: int) -> dict:
    """One client count's row: each round sequential, concurrent, concurrent, sequential; the median
    round's rates and every round's ratio."""
    found = []  # (ratio, sequential, concurrent) per round
    same = True
    for _ in range(rounds):
        runs = [measure(port, prompts, max_tokens, concurrent) for concurrent in (False, True, True, False)]
        sequential, together = (runs[0][0] + runs[3][0]) / 2, (runs[1][0] + runs[2][0]) / 2
        found.append((together / sequential, sequential, together))
        same = same and all(texts == runs[0][1] for _, texts in runs)
    ratio = statistics.median(r for r, _, _ in found)
    _, sequential, together = min(found, key=lambda f: abs(f[0] - ratio))
    return {
        "clients": len(prompts),
        "sequential_tok_per_s": round(sequential, 3),
        "concurrent_tok_per_s": round(together, 3),
        "ratio": round(ratio, 3),
        "round_ratios": [round(r, 3) for r, _, _ in found],
        "same_answers": same,
    }


def batch_section(container: Path, kv_dir: Path, settings: BatchSettings = BatchSettings()) -> dict:
    """Every client count's row, sent to one `serve` child process on ``container``."""
    vocab = json.loads((container / "config.json").read_text())["vocab_size"]
    slots = max(settings.clients)
    os.sync()  # the bench's models were just written: their write-back would run beside the rounds
    with served(container, kv_dir, settings, kv_dir.parent / "batch-serve.log") as port:
        # warm-up, one full request alone and one burst of the most clients: after a 4-token request the
        # first measured run (1 client) read 0.82-0.88x the same run repeated
        warm = prompts_for(slots + 1, settings.prompt_tokens + 1, vocab)
        measure(port, warm[:1], settings.max_tokens, concurrent=False)
        measure(port, warm[1:], settings.max_tokens, concurrent=True)
        rows = [
            clients_row(port, prompts_for(n, settings.prompt_tokens, vocab), settings.max_tokens, settings.rounds)
            for n in settings.clients
        ]
    ratios = {f"batch_{row['clients']}_clients": row["ratio"] for row in rows if row["clients"] > 1}
    return {"settings": asdict(settings), "rows": rows, "ratios": ratios}


@contextmanager
def served(
    container: Path, kv_dir: Path, settings: BatchSettings, log: Path, timeout_s: float = 300.0
) -> Iterator[int]:
    """`colibri-stream serve` on ``container`` at a free local port, until the block ends -> the port. Its
    output goes to ``log``, whose end a failure to start shows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    slots = str(max(settings.clients))
    argv = cli_argv("serve", str(container), "--port", str(port), "--slots", slots, "--max-queue", slots)
    argv += ["--ram", settings.ram, "--activations", settings.activations, "--kv-dir", str(kv_dir)]
    argv += ["--no-prefix-cache", "--model-name", MODEL_ID]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_until_listening(server, port, log, timeout_s)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_until_listening(server: subprocess.Popen, port: int, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise ContenderFailed(f"colibri-stream serve exited {server.returncode} before listening:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    raise ContenderFailed(f"colibri-stream serve did not listen on port {port} within {timeout_s:.0f} s (log: {log})")


def batch_table(section: dict) -> list[str]:
    """The rows as a markdown table."""
    lines = [
        "| clients | sequential tok/s | concurrent tok/s | ratio (median round) | every round | same answers |",
        "|---|---:|---:|---:|---|---|",
    ]
    for row in section["rows"]:
        rounds = ", ".join(f"{r:.2f}" for r in row["round_ratios"])
        lines.append(
            f"| {row['clients']} | {row['sequential_tok_per_s']:.2f} | {row['concurrent_tok_per_s']:.2f} | "
            f"{row['ratio']:.2f}x | {rounds} | {row['same_answers']} |"
        )
    return lines
