"""Decode tok/s with one competing CPU-bound process against idle (`loaded_vs_idle`), per thread count
and OpenMP waiting policy, measured side by side in one run (a benchmark, not a test).

    python tools/bench_load.py CONTAINER [--ram 100%] [--tokens 24] [--repeats 2]

Each configuration runs in its own child process (the waiting policy is read when torch loads OpenMP):
greedy decode of --tokens tokens from a 24-token prompt, best of --repeats, first with the machine idle,
then beside `python -c "while True: pass"`. Prints a markdown table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load
loaded = load(sys.argv[2], "float32", StoreOptions(ram=sys.argv[3]))
prompt = [10 + (31 * j) % (loaded.args.vocab_size - 10) for j in range(24)]
generate(loaded.model, prompt, 4, loaded.experts)
rates = [generate(loaded.model, prompt, int(sys.argv[4]), loaded.experts).stats.decode_tok_per_s
         for _ in range(int(sys.argv[5]))]
print(json.dumps(max(rates)))
"""


def decode_rate(threads: int, policy: str, args: argparse.Namespace, loaded: bool) -> float:
    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if loaded else None
    try:
        time.sleep(0.5 if hog else 0)
        argv = [str(threads), args.container, args.ram, str(args.tokens), str(args.repeats)]
        out = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("container")
    parser.add_argument("--ram", default="100%")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = []
    print("| threads | OMP_WAIT_POLICY | idle tok/s | loaded tok/s | loaded_vs_idle |")
    print("|---|---|---|---|---|")
    for threads in (1, 2):
        for policy in ("ACTIVE", "PASSIVE"):
            idle = decode_rate(threads, policy, args, loaded=False)
            busy = decode_rate(threads, policy, args, loaded=True)
            rows.append({"threads": threads, "policy": policy, "idle": idle, "loaded": busy, "ratio": busy / idle})
            print(f"| {threads} | {policy} | {idle:.2f} | {busy:.2f} | {busy / idle:.2f}x |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
