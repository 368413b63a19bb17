"""Time to first token of an agent's requests, with and without the prefix cache, and after a restart
(a benchmark, not a test; colibri_stream/bench/agent_trace.py says what the trace is).

    python tools/bench_agent.py [--model demo|stress|PATH] [--ram 100%] [--preamble-tokens 4096]
                                [--sessions 5] [--turns 4] [--stress-layers 20] [--work DIR] [--json FILE]
    python tools/bench_agent.py --replay tests/fixtures/agents/claude_code_recorded.json [--context 32768]
                                [--rounds 1] [--max-tokens 8] [--model demo|PATH] [--ram 100%] [--json FILE]

Three phases, each with a fresh server on the same container, measured in one run:
  off       --no-prefix-cache: every request computes its whole prompt (today's stateless behaviour)
  cached    the prefix cache on, starting empty: only the first request computes the preamble
  restart   a new server on the cached phase's KV directory: each session's last request sent again,
            and a new session on the same preamble: from disk, nothing recomputed but new messages
The preamble is capped at half the model's context; the stress model is generated with an 8192-token
context for a 4k preamble.

--replay FIXTURE: one recorded agent request (tests/fixtures/agents/*_recorded.json: its route and body as
the client sent them, max_tokens cut to --max-tokens) against `serve` on the demo as `colibri-stream serve`
without PATH runs it (the int4 container in the user cache), planned for --context tokens. Per round:
  cold      a fresh server on an empty KV directory: the whole prompt computed
  warm      the same request again on that server: the prompt from the prefix cache
  restart   a new server on that KV directory: the prompt from disk
TTFT is the client's time to the first streamed delta (to the stream's end if the answer has none); CPU s
the process's CPU time over the whole request (server and client are this process): on a shared machine
it moves less than the wall time does.
Run it on main's code for a before row: PYTHONPATH=<a checkout of main> python tools/bench_agent.py --replay ...
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_serve import container_for  # the script beside this one (tools/ is on sys.path when run)

from colibri_stream.bench.agent_trace import AgentTrace, RequestRecord, TraceShape, as_rows, run_phase, summary
from colibri_stream.checkpoint.demo_model import demo_cache_dir, demo_container_path, demo_model_dir
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.app import Server
from colibri_stream.serve.in_process import start_server
from storage.container.reader import is_container
from storage.kv.prefix_store import PrefixConfig

MODEL_ID = "bench-agent"


def serve_phase(
    container: Path, kv_dir: Path, ram: str, prefix: bool, trace: AgentTrace | TraceShape, phase: str, turns: range
) -> tuple[list[RequestRecord], AgentTrace]:
    """A fresh server on ``container`` running ``turns`` of ``trace`` (a new trace of that shape when a
    shape is given); returns the records and the trace, whose conversations a later phase continues."""
    options = RuntimeOptions(
        store=StoreOptions(ram=ram), kv_dir=kv_dir, model_id=MODEL_ID, prefix=PrefixConfig(enabled=prefix)
    )
    runtime = load_runtime(container, options)
    if isinstance(trace, TraceShape):
        trace = AgentTrace(runtime, trace)  # keeps only the runtime's text side once the phase ends
    running = start_server(Server(runtime, slots=1, max_queue=trace.shape.sessions))
    try:
        return run_phase(running.port, MODEL_ID, trace, phase, turns), trace
    finally:
        running.stop()
        runtime.close()


def replay_once(port: int, fixture: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The recorded request (route and body; max_tokens cut) streamed once: TTFT, wall time, usage."""
    body = dict(fixture["body"], max_tokens=max_tokens)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=7200)
    cpu, start = time.process_time(), time.perf_counter()
    connection.request("POST", fixture["path"], json.dumps(body).encode(), {"content-type": "application/json"})
    response = connection.getresponse()
    first: float | None = None
    usage: dict[str, Any] = {}
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        if first is None and _is_delta(event):
            first = time.perf_counter()
        found = event.get("usage") or (event.get("message") or event.get("response") or {}).get("usage")
        usage = found or usage
    end = time.perf_counter()
    connection.close()
    if response.status != 200:
        raise SystemExit(f"{fixture['path']}: HTTP {response.status}")
    timings = {"ttft_s": round((first or end) - start, 3), "wall_s": round(end - start, 3)}
    return timings | {"cpu_s": round(time.process_time() - cpu, 3), "usage": usage}


def _is_delta(event: dict[str, Any]) -> bool:
    """A streamed piece of the answer in any of the three APIs."""
    if event.get("type") in ("content_block_delta", "response.output_text.delta", "response.reasoning_text.delta"):
        return True
    return any(choice.get("delta", {}).get("content") for choice in event.get("choices", []))


def serve_demo_container() -> Path:
    """The container `colibri-stream serve` without PATH serves (colibri_stream/cli/demo.py ensure_container:
    the shipped model in int4, in the user cache), converted here if it is not there yet."""
    dst = demo_container_path(demo_model_dir(), demo_cache_dir())
    if not is_container(dst):
        Converter(demo_model_dir(), dst, ConvertOptions()).run()
    return dst


def replay(args: argparse.Namespace) -> None:
    """--replay: cold, warm and restart rows of one recorded request, --rounds times."""
    fixture = json.loads(Path(args.replay).read_text())
    container = serve_demo_container() if args.model == "demo" else Path(args.model)
    rows = []
    for round_ in range(args.rounds):
        kv = Path(tempfile.mkdtemp(prefix="bench-agent-replay-"))
        try:
            for phase in ("cold", "restart"):
                options = RuntimeOptions(
                    store=StoreOptions(ram=args.ram, context=args.context),
                    kv_dir=kv,
                    model_id=MODEL_ID,
                    prefix=PrefixConfig(enabled=True),
                )
                runtime = load_runtime(container, options)
                running = start_server(Server(runtime, slots=1, max_queue=1))
                try:
                    rows.append({"round": round_, "phase": phase} | replay_once(running.port, fixture, args.max_tokens))
                    if phase == "cold":
                        warm = replay_once(running.port, fixture, args.max_tokens)
                        rows.append({"round": round_, "phase": "warm"} | warm)
                finally:
                    running.stop()
                    runtime.close()
        finally:
            shutil.rmtree(kv, ignore_errors=True)
    engine = sys.modules["engine"].__file__
    print(f"{args.replay} on {container.name}, --context {args.context}, --ram {args.ram}; engine {engine}")
    print("| round | phase | prompt | cached | TTFT s | wall s | CPU s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        prompt, cached = _prompt_tokens(r["usage"])
        timings = f"{r['ttft_s']:.2f} | {r['wall_s']:.2f} | {r['cpu_s']:.1f}"
        print(f"| {r['round']} | {r['phase']} | {prompt} | {cached} | {timings} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _prompt_tokens(usage: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, cached ones) from an Anthropic, chat or Responses usage."""
    if "input_tokens" in usage and "cache_read_input_tokens" in usage:  # Anthropic: input excludes cached
        cached = usage["cache_read_input_tokens"] or 0
        return usage["input_tokens"] + cached, cached
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return usage.get("prompt_tokens", usage.get("input_tokens", 0)), details.get("cached_tokens", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="demo, stress or a container path (default demo)")
    parser.add_argument("--ram", default="100%", help="RAM budget for expert slots (default 100%%)")
    parser.add_argument("--preamble-tokens", type=int, default=4096)
    parser.add_argument("--sessions", type=int, default=5)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--stress-layers", type=int, default=20)
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "colibri-stream" / "bench-agent"))
    parser.add_argument("--json", help="also write every request's record and the summary here")
    parser.add_argument("--replay", metavar="FIXTURE", help="replay one recorded agent request (see above)")
    parser.add_argument("--context", type=int, default=32768, help="--replay: the context planned for")
    parser.add_argument("--rounds", type=int, default=1, help="--replay: cold/warm/restart rounds")
    parser.add_argument("--max-tokens", type=int, default=8, help="--replay: the answer's limit")
    args = parser.parse_args()
    if args.replay:
        replay(args)
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    container = container_for(args.model, work, args.stress_layers, stress_context=8192)
    context = json.loads((container / "config.json").read_text())["max_position_embeddings"]
    shape = TraceShape(min(args.preamble_tokens, context // 2), args.sessions, args.turns)
    kv = work / f"kv-{container.name}"
    shutil.rmtree(kv, ignore_errors=True)
    turns = range(shape.turns)
    records, _ = serve_phase(container, kv / "off", args.ram, False, shape, "off", turns)
    cached, trace = serve_phase(container, kv / "on", args.ram, True, shape, "cached", turns)
    # a new server on the same directory: every conversation goes on with one more request
    again = range(shape.turns, shape.turns + 1)
    after, _ = serve_phase(container, kv / "on", args.ram, True, trace, "restart", again)
    records += cached + after
    print(
        f"{args.model} ({container.name}), --ram {args.ram}: preamble {shape.preamble_tokens} tokens", file=sys.stderr
    )
    print("| phase | session | turn | prompt | cached | computed | new | TTFT s | goal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        print(
            f"| {r.phase} | {r.session} | {r.turn} | {r.prompt_tokens} | {r.cached_tokens} | {r.computed_tokens} "
            f"| {r.new_tokens} | {r.ttft_s:.3f} | {'ok' if r.within_goal else 'MISSED'} |"
        )
    result = summary(records)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"records": as_rows(records), "summary": result}, indent=1))


if __name__ == "__main__":
    main()
