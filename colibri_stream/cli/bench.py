"""`colibri-stream bench`: every contender side by side in one run (see colibri_stream/bench/suite.py),
or `--kernels`: the expert-FFN vs memcpy micro-benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from colibri_stream.bench.kernels import measure
from colibri_stream.cli.help import help_options
from colibri_stream.paths import user_cache_dir
from storage.files.safe_read import check_output_dir

BENCH_EPILOG = """\
examples:
  colibri-stream bench --quick                 # a small model, every section, a few minutes
  colibri-stream bench --json --out results/   # the full run (<= 30 min): results.json, benchmarks.md, plots
  colibri-stream bench --kernels --json        # 4-bit expert FFN per record kind vs memcpy (+ CUDA on a GPU)
  colibri-stream bench --setup-peers           # once, after pip install 'colibri-stream[peers]': llama.cpp's converter
  colibri-stream bench --sections decode,llama_cpp,load   # only these sections
  colibri-stream bench --sections batch        # 1/4/8 concurrent clients of `serve` vs one after another
The full run generates a ~15 GB bf16 model and its int4 and bf16 containers (~20 GB) in --work once.
Run as root on an idle machine: contenders are confined by a memory cgroup (page cache counted) and
the page cache is dropped before cold runs; without root both are skipped with a warning.
exit status: 0 on success, 1 when a contender fails (its error is printed) or --work lacks room for the run,
2 on bad flags."""


def default_work_dir(quick: bool) -> Path:
    return user_cache_dir("bench", "quick" if quick else "full")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "bench",
        help="benchmark against accelerate offload, the raw disk and Belady, side by side",
        description=(
            "Run every contender in one invocation under the same RAM limit: the raw disk, our decode at RAM "
            "budgets of 10/25/50/100% of expert bytes (policies, prefetch, cold/warm), transformers + "
            "accelerate disk offload, each cache policy vs Belady's optimum, and session resume vs re-prefill. "
            "Writes results.json, benchmarks.md and PNG plots to --out."
        ),
        **help_options(BENCH_EPILOG),
    )
    parser.add_argument("--quick", action="store_true", help="a small model and short runs (minutes, not half an hour)")
    parser.add_argument("--out", default="bench-results", help="directory for results (default ./bench-results)")
    parser.add_argument("--work", help="where the generated model and containers live (default ~/.cache/...)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument(
        "--sections",
        type=_sections,
        default=None,
        help="comma-separated subset of disk,decode,peer,caching,sessions,llama_cpp,load,mtp,batch (default: all; "
        "caching needs decode)",
    )
    peers = parser.add_argument_group("llama.cpp contender (pip install 'colibri-stream[peers]')")
    peers.add_argument(
        "--setup-peers",
        nargs="?",
        const="download",
        metavar="SDIST",
        help="extract llama.cpp's converter from the llama-cpp-python sdist (downloaded with pip, or the given "
        "file) into --llama-cpp-dir, then exit",
    )
    peers.add_argument("--llama-cpp-dir", help="where the converter lives (default ~/.cache/colibri-stream/peers/...)")
    kernels = parser.add_argument_group("kernel micro-benchmarks (--kernels)")
    kernels.add_argument(
        "--kernels",
        action="store_true",
        help="run the expert-FFN vs memcpy micro-benchmarks (with CUDA also H2D copies and GPU expert FFN)",
    )
    kernels.add_argument("--experts", type=int, default=8, help="experts in the working set (default 8)")
    kernels.add_argument("--dim", type=int, default=7168, help="hidden size of the experts (default 7168, DeepSeek-V3)")
    kernels.add_argument("--inter", type=int, default=2048, help="expert intermediate size (default 2048)")
    kernels.add_argument("--rows", type=int, default=1, help="activation rows per expert call (default 1: decode)")
    kernels.add_argument("--few-rows", type=int, default=4, help="rows of the few-row measurement (default 4)")
    kernels.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.set_defaults(handler=run_bench_command)


def _sections(text: str) -> tuple[str, ...]:
    from colibri_stream.bench.suite import SECTIONS

    chosen = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in chosen if name not in SECTIONS]
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown or text!r}: choose from {','.join(SECTIONS)}")
    if "caching" in chosen and "decode" not in chosen:
        raise argparse.ArgumentTypeError("caching replays the decode section's trace: add decode")
    return chosen


def run_bench_command(args: argparse.Namespace) -> int:
    if args.kernels:
        return run_kernels(args)
    from colibri_stream.bench.llama_cpp import default_llama_cpp_dir, setup_converter

    llama_cpp_dir = Path(args.llama_cpp_dir) if args.llama_cpp_dir else default_llama_cpp_dir()
    if args.setup_peers:
        sdist = None if args.setup_peers == "download" else Path(args.setup_peers)
        setup_converter(llama_cpp_dir, sdist, log=lambda line: print(f"[bench] {line}", file=sys.stderr))
        return 0
    # Imported here: the bench pulls in the converter, the demo and the report (not needed by --kernels).
    from colibri_stream.bench.report import markdown, plots
    from colibri_stream.bench.suite import FULL, QUICK_SETTINGS, SECTIONS, run_bench

    settings = QUICK_SETTINGS if args.quick else FULL
    work = Path(args.work) if args.work else default_work_dir(args.quick)
    out = Path(args.out)
    check_output_dir(work, "--work")  # before an hour of generating models into it
    check_output_dir(out, "--out")
    command = "colibri-stream " + " ".join(sys.argv[1:])
    results: dict[str, Any] = {"mode": "quick" if args.quick else "full", "date": time.strftime("%Y-%m-%d %H:%M")}
    log = lambda line: print(f"[bench] {line}", file=sys.stderr)  # noqa: E731
    results |= run_bench(settings, work, out, command, log, args.sections or SECTIONS, llama_cpp_dir)
    try:
        results["plots"] = [str(path) for path in plots(results, out)]
    except ImportError:
        results["warnings"].append("matplotlib is not installed (pip install 'colibri-stream[bench]'): no plots")
    report = markdown(results)
    (out / "benchmarks.md").write_text(report)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results) if args.json else report)
    return 0


def run_kernels(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(n_experts=args.experts, dim=args.dim, inter=args.inter, rows=args.rows, few_rows=args.few_rows)
    if torch.cuda.is_available():  # the VRAM tier's copies and GPU expert compute, same run
        from colibri_stream.bench.cuda import measure_cuda

        result["cuda"] = measure_cuda(n_experts=args.experts, dim=args.dim, inter=args.inter)
    if args.json:
        print(json.dumps(result))
    else:
        for kind, k in result["kinds"].items():
            per_rows = ", ".join(
                f"{n} row(s) {r['ffn_GBps']} GB/s (ratio {r['vs_memcpy']})" for n, r in k["rows"].items()
            )
            print(f"{kind} expert FFN, packed bytes: {per_rows}; memcpy {k['memcpy_GBps']} GB/s")
        print(f"torch dequantise+matmul (int4-f16-g64): {result['torch_dequant_matmul_GBps']} GB/s")
        if "cuda" in result:
            cuda = result["cuda"]
            print(
                f"{cuda['device']}: H2D {cuda['h2d_GBps']} GB/s, GPU int4 FFN {cuda['gpu_ffn_GBps']} GB/s, "
                f"side-stream copies {cuda['ratios']['side_stream_speedup']}x faster than on the compute stream"
            )
    return 0
