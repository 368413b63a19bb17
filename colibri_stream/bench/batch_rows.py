"""The bench's batch rows: aggregate tok/s of `serve` for N concurrent clients against the same N requests
sent one after another, side by side in one server (tools/bench_serve.py runs them alone).

The real HTTP server runs in a thread of this process (colibri_stream/serve/in_process.py) with --slots =
the largest client count. For each N, N distinct prompts (greedy, ``max_tokens`` each) run in the order
sequential, concurrent, concurrent, sequential, and that round's rates are the means of its two runs of
each kind: measured once each, sequential always first, the second run of even one client read 1.14-1.21x
the first (a process still warming up), which flattered every ratio. A round of the demo model's 4 clients
takes ~0.1 s per run, so one round moved by +-10% from run to run on a shared host: ``rounds`` rounds are
measured and each N's ratio is their median (the rates beside it are that round's). The 1-client row is the
noise floor. Greedy answers of every concurrent run must equal the sequential run's (batching changes no
token).
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.app import Server
from colibri_stream.serve.in_process import start_server
from storage.prefix_store import PrefixConfig

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
    """Every client count's row, served by one in-process server on ``container`` (prefix cache off: the
    same prompts are sent again and each run must compute them)."""
    options = RuntimeOptions(
        activations=settings.activations,
        store=StoreOptions(ram=settings.ram, kv_sequences=2 * max(settings.clients)),
        kv_dir=kv_dir,
        model_id=MODEL_ID,
        prefix=PrefixConfig(enabled=False),
    )
    runtime = load_runtime(container, options)
    slots = max(settings.clients)
    running = start_server(Server(runtime, slots=slots, max_queue=slots))
    try:
        # warm-up, one full request alone and one burst of the most clients: after a 4-token request the
        # first measured run (1 client) read 0.82-0.88x the same run repeated
        warm = prompts_for(slots + 1, settings.prompt_tokens + 1, runtime.vocab_size)
        measure(running.port, warm[:1], settings.max_tokens, concurrent=False)
        measure(running.port, warm[1:], settings.max_tokens, concurrent=True)
        rows = [
            clients_row(
                running.port,
                prompts_for(n, settings.prompt_tokens, runtime.vocab_size),
                settings.max_tokens,
                settings.rounds,
            )  # fmt: skip
            for n in settings.clients
        ]
    finally:
        running.stop()
    ratios = {f"batch_{row['clients']}_clients": row["ratio"] for row in rows if row["clients"] > 1}
    return {"settings": asdict(settings), "rows": rows, "ratios": ratios}


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
