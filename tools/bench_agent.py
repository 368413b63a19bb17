"""Time to first token of an agent's requests, with and without the prefix cache, and after a restart
(a benchmark, not a test; colibri_stream/bench/agent_trace.py says what the trace is).

    python tools/bench_agent.py [--model demo|stress|PATH] [--ram 100%] [--preamble-tokens 4096]
                                [--sessions 5] [--turns 4] [--stress-layers 20] [--work DIR] [--json FILE]

Three phases, each with a fresh server on the same container, measured in one run:
  off       --no-prefix-cache: every request computes its whole prompt (today's stateless behaviour)
  cached    the prefix cache on, starting empty: only the first request computes the preamble
  restart   a new server on the cached phase's KV directory: each session's last request sent again,
            and a new session on the same preamble: from disk, nothing recomputed but new messages
The demo model's context is 2048 tokens, so its preamble is cut to fit (--preamble-tokens is capped at
half the context); the stress model is generated with an 8192-token context for a 4k preamble.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from bench_serve import container_for  # the script beside this one (tools/ is on sys.path when run)

from colibri_stream.bench.agent_trace import AgentTrace, RequestRecord, TraceShape, as_rows, run_phase, summary
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.app import Server
from colibri_stream.serve.in_process import start_server
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
    args = parser.parse_args()
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
