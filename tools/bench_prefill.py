"""A long prompt's time to first token, ours vs llama.cpp, in one run (issue #44): the llama.cpp section's
prefill rows alone, on the bench model (`colibri-stream bench`'s 20-layer stress model, made once in --work).

    sudo python tools/bench_prefill.py --work /work/bench [--tokens 1024] [--budgets 100,25] [--out prefill.json]

Needs the `peers` extra and `colibri-stream bench --setup-peers` (llama.cpp's converter). Ours runs the int8
path (the int4-int8dense container, --activations int8), as llama.cpp computes; at 100% both run warm, below
cold under the bench's memory limit (see colibri_stream/bench/prefill_rows.py). Prints one line per row and
the ratios (prefill_vs_*: llama.cpp's TTFT over ours; long_decode_vs_*: our decode tok/s after the prompt over
llama.cpp's; above 1, ours is faster); writes everything as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from colibri_stream.bench.llama_cpp import skip_reason
from colibri_stream.bench.llama_cpp_race import LlamaCppRace
from colibri_stream.bench.prefill_rows import prefill_section_ratios
from colibri_stream.bench.suite import FULL, Bench
from colibri_stream.bench.system import cgroup_available, machine_facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="the bench's work directory (model, containers)")
    parser.add_argument("--tokens", type=int, default=FULL.prefill_tokens, help="prompt tokens")
    parser.add_argument("--budgets", default="100,25", help="RAM budgets, %% of int4 expert bytes")
    parser.add_argument("--out", type=Path, default=Path("prefill.json"))
    args = parser.parse_args()

    def log(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)

    settings = replace(FULL, prefill_tokens=args.tokens)
    bench = Bench(settings, args.work, args.out.parent, log)
    reason = skip_reason(bench.llama_cpp_dir)
    if reason:
        raise SystemExit(reason)
    bench.results.update(machine=machine_facts(args.work), warnings=[])
    if not cgroup_available():
        log("warning: no cgroup-v1 memory controller: rows below 100% run without their memory limit")
    bench.prepare_models()
    race = LlamaCppRace(bench)
    files = race.prepare()
    ours: list[dict] = []
    theirs: list[dict] = []
    failed: list[dict] = []
    for pct in (int(p) for p in args.budgets.split(",")):
        race.prefill_rows(pct, files, (ours, theirs), failed)
    for row in ours + theirs:
        speed = f"{row['ttft_s']:8.2f} s  {row['prefill_tok_per_s']} tok/s, then {row['decode_tok_per_s']:.2f} tok/s"
        print(f"{row['name']:<60} cold={row['cold']!s:<5} {speed}")
    ratios = prefill_section_ratios(ours, theirs)
    print(json.dumps(ratios))
    result = {"ours": ours, "rows": theirs, "failed": failed, "ratios": ratios, "machine": bench.results["machine"]}
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
