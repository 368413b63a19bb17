"""Where a prompt's prefill time goes, and the fraction of the machine's compute it uses (issue #71): one
process, the model loaded once, all experts in RAM:

  1. the int8 compute peak calibrated first (colibri_stream/bench/prefill_limit.py, the bench's kernels), before
     the model loads, so nothing else of this process runs beside it;
  2. the prompt's first --warm-tokens (default: all of it) read once to warm up (the expert records into the
     store, the kernels' first calls), then the whole prompt once unprofiled: its time (`stats.prefill_s`) and
     the prompt's multiply-adds from the geometry give the fraction of the prefill limit line reached;
  3. the same prompt again under cProfile (default: the engine's C kernels are calls from Python, one row
     each; the table: each function's own time and its share of the profiled prefill), torch.profiler
     (`--profiler torch`: torch's ops only, the C kernels are not among them), or not at all (`none`).

    python tools/profile_prefill.py CONTAINER [--tokens 1024] [--warm-tokens N] [--activations int8]
        [--profiler cprofile|torch|none] [--dtype float32|bfloat16] [--top 15] [--json FILE]

An 8192-token prompt needs a model whose context is longer: `tools/make_stress_model.py DST --context 16384`;
`--tokens 8192 --warm-tokens 1024 --profiler none` times it once after a 1024-token warm-up (1024 tokens route
to nearly every expert of a layer; the stats' `expert_bytes_read` says what the timed prompt still read).

CONTAINER: e.g. the bench's stress model converted `--experts int4 --dense int8` (tools/make_stress_model.py,
then `colibri-stream convert`). The store is sized to hold every expert record (100%), the prefix cache is off.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch

from colibri_stream.bench.prefill_limit import (
    CALIBRATION_BUDGET_S,
    compute_peaks,
    prefill_limit_line,
    prompt_multiply_adds,
)
from colibri_stream.bench.sessions import random_prompt_ids
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.planning.geometry import geometry_from_container
from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, load_runtime, run_turn
from storage.container.reader import Container
from storage.kv.prefix_store import PrefixConfig


def torch_top_ops(prof: torch.profiler.profile, top: int, seconds: float) -> list[dict]:
    """The ``top`` torch ops by self CPU time, each with its share of the profiled prefill's ``seconds``."""
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [
        {
            "op": e.key,
            "calls": e.count,
            "self_s": round(e.self_cpu_time_total / 1e6, 3),
            "share": round(e.self_cpu_time_total / 1e6 / seconds, 3),
        }
        for e in events
    ]


def cprofile_top(prof: cProfile.Profile, top: int, seconds: float) -> list[dict]:
    """The ``top`` functions by their own time (C kernels and torch ops called from Python included), each
    with its share of the profiled prefill's ``seconds``."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [
        {
            "op": f"{Path(file).name}:{line}({name})" if file != "~" else name,
            "calls": calls,
            "self_s": round(own, 3),
            "share": round(own / seconds, 3),
        }
        for (file, line, name), (_, calls, own, _, _) in rows
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("container", type=Path)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--activations", default="int8")
    parser.add_argument("--warm-tokens", type=int, help="tokens of the warm-up prompt (default: --tokens)")
    parser.add_argument("--profiler", choices=("cprofile", "torch", "none"), default="cprofile")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--calibration-s", type=float, default=CALIBRATION_BUDGET_S)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dtype", default="float32", help="compute dtype (float32 or bfloat16)")
    args = parser.parse_args()

    threads = torch.get_num_threads()
    peaks = compute_peaks(threads, args.calibration_s)
    container = Container(args.container)
    geometry = geometry_from_container(container)
    ram = f"{geometry.expert_bytes + (64 << 20)}B"  # every expert record held: the prompt is compute, not reads
    options = RuntimeOptions(
        dtype=args.dtype,
        activations=args.activations,
        store=StoreOptions(ram=ram),
        text=False,
        prefix=PrefixConfig(enabled=False),
    )
    runtime = load_runtime(args.container, options)
    ids = random_prompt_ids(geometry.args.vocab_size, args.tokens, 11)
    turn = TurnOptions(max_new_tokens=1)
    try:
        run_turn(runtime, ids[: args.warm_tokens], turn)  # warm: the expert records in, the kernels' first calls
        start = time.perf_counter()
        stats = run_turn(runtime, ids, turn).stats
        wall = time.perf_counter() - start
        profiled, ops = stats, []
        if args.profiler == "torch":
            from torch.profiler import ProfilerActivity, profile  # only when asked for

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                profiled = run_turn(runtime, ids, turn).stats
            ops = torch_top_ops(prof, args.top, profiled["prefill_s"])
        elif args.profiler == "cprofile":
            cprof = cProfile.Profile()
            cprof.enable()
            profiled = run_turn(runtime, ids, turn).stats
            cprof.disable()
            ops = cprofile_top(cprof, args.top, profiled["prefill_s"])
    finally:
        runtime.close()
    work = prompt_multiply_adds(geometry.args, args.tokens)
    line = prefill_limit_line(peaks, {args.tokens: work}, {"ours": {args.tokens: stats["prefill_s"]}})
    print(
        f"prefill {args.tokens} tokens: {stats['prefill_s']:.2f} s ({wall:.2f} s the whole turn); profiled "
        f"{profiled['prefill_s']:.2f} s; {work.total / 1e9:,.1f} G multiply-adds; threads {threads}; "
        f"expert bytes read {stats['expert_bytes_read']:,}"
    )
    print(f"peaks G multiply-adds/s: {line['compute_peak_GMACps']}; kernels: {line['calibration']}")
    print(f"fraction of the int8 limit: {line['contenders']['ours'][str(args.tokens)]}")
    if args.json:
        args.json.write_text(json.dumps({"stats": stats, "profiled": profiled, "ops": ops, "limit": line}, indent=1))
    if ops:
        print(
            f"| {args.profiler}: function / op | calls | own s | share of the profiled prefill |\n|---|---:|---:|---:|"
        )
    for op in ops:
        print(f"| {op['op']} | {op['calls']} | {op['self_s']} | {op['share']} |")


if __name__ == "__main__":
    main()
