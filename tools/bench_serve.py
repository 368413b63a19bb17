"""Aggregate tok/s of `serve` for 1/2/4/8 concurrent clients, against the same requests sent one after
another, measured side by side in one run (a benchmark, not a test).

    python tools/bench_serve.py [--model demo|stress|PATH] [--ram 25%] [--clients 1,2,4,8]
                                [--max-tokens 32] [--stress-layers 8] [--work DIR] [--json FILE]
                                [--dense int8|int4 --activations int8]

The model is converted once into --work (the demo model, or the generated DeepSeek-V3-shaped stress
model of colibri_stream/bench/stress_model.py with --stress-layers layers) and served in-process by the
real HTTP server with --slots = the largest client count. For each N, N requests (distinct prompts of
--prompt-tokens ids, greedy, --max-tokens each) run first one after another, then all at once; the
aggregate rate is completion tokens / wall seconds and the ratio is concurrent / sequential. Greedy
answers of the concurrent run are checked against the sequential run's (batching changes no token).

Each N is measured in the order sequential, concurrent, concurrent, sequential and each rate is the mean of
its two runs: measured once each, sequential always first, the second run of even one client read 1.14-1.21x
the first (a process still warming up), which flattered every ratio. The 1-client row is the noise floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from colibri_stream.bench.stress_model import StressShape, write_stress_checkpoint
from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools.fixtures import write_tiny_tokenizer
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.planning.geometry import DEFAULT_DENSE
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.app import Server
from colibri_stream.serve.in_process import start_server
from storage.container import is_container
from storage.prefix_store import PrefixConfig

MODEL_ID = "bench"


def container_for(
    model: str, work: Path, stress_layers: int, stress_context: int = 4096, dense: str = DEFAULT_DENSE
) -> Path:
    """The container to serve ("demo", "stress" or a path), converted into ``work`` once (kept for later
    runs) with ``dense`` records. The stress model has no tokenizer: a tiny one is trained so the server can
    decode text."""
    if model not in ("demo", "stress"):
        return Path(model)
    name = f"stress-{stress_layers}-{stress_context}" if model == "stress" else "demo"
    dst = work / (f"{name}.cstream" if dense == DEFAULT_DENSE else f"{name}-{dense}.cstream")
    if not is_container(dst):
        if model == "demo":
            source = demo_model_dir()
        else:
            shape = dataclasses.replace(
                StressShape(), num_hidden_layers=stress_layers, max_position_embeddings=stress_context
            )
            source = write_stress_checkpoint(work / f"{name}-hf", shape)
        Converter(source, dst, ConvertOptions(dense=dense)).run()
    if not (dst / "tokenizer.json").exists():
        write_tiny_tokenizer(dst, json.loads((dst / "config.json").read_text())["vocab_size"])
    return dst


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="demo, stress or a container path (default demo)")
    parser.add_argument("--ram", default="25%", help="RAM budget for expert slots (default 25%%)")
    parser.add_argument("--clients", default="1,2,4,8", help="concurrent client counts (default 1,2,4,8)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--stress-layers", type=int, default=8, help="layers of the stress model (default 8)")
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "colibri-stream" / "bench-serve"))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--dense", default=DEFAULT_DENSE, help="the dense records converted (int8, int4: the int8 path)"
    )
    parser.add_argument("--activations", default="float32", choices=["float32", "int8"])
    args = parser.parse_args()
    clients = [int(n) for n in args.clients.split(",")]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    container = container_for(args.model, work, args.stress_layers, dense=args.dense)
    options = RuntimeOptions(
        activations=args.activations,
        store=StoreOptions(ram=args.ram, kv_sequences=2 * max(clients)),
        kv_dir=work / "kv",
        model_id=MODEL_ID,
        prefix=PrefixConfig(enabled=False),  # the same prompts are sent twice: both runs compute them
    )
    runtime = load_runtime(container, options)
    server = Server(runtime, slots=max(clients), max_queue=max(clients))
    running = start_server(server)
    port = running.port
    # warm-up, one full request alone and one burst of the most clients: after a 4-token request the first
    # measured run (1 client) read 0.82-0.88x the same run repeated
    warm = prompts_for(max(clients) + 1, args.prompt_tokens + 1, runtime.vocab_size)
    measure(port, warm[:1], args.max_tokens, concurrent=False)
    measure(port, warm[1:], args.max_tokens, concurrent=True)
    rows = []
    print(
        f"{args.model} at --ram {args.ram}, dense {args.dense}, {args.activations} activations: "
        f"{args.max_tokens} tokens per request",
        file=sys.stderr,
    )
    print("| clients | sequential tok/s | concurrent tok/s | ratio | same answers |")
    print("|---|---|---|---|---|")
    for n in clients:
        prompts = prompts_for(n, args.prompt_tokens, runtime.vocab_size)
        runs = [measure(port, prompts, args.max_tokens, concurrent) for concurrent in (False, True, True, False)]
        sequential, together = (runs[0][0] + runs[3][0]) / 2, (runs[1][0] + runs[2][0]) / 2
        row = {
            "clients": n,
            "sequential_tok_per_s": round(sequential, 3),
            "concurrent_tok_per_s": round(together, 3),
            "ratio": round(together / sequential, 3),
            "same_answers": all(texts == runs[0][1] for _, texts in runs),
        }
        rows.append(row)
        print(f"| {n} | {sequential:.2f} | {together:.2f} | {together / sequential:.2f}x | {row['same_answers']} |")
    running.stop()
    if args.json:
        result = {"model": args.model, "ram": args.ram, "max_tokens": args.max_tokens, "rows": rows}
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
