"""Decode tok/s and network bytes per token: routed experts over 2 local workers vs one process with the
same total RAM for experts, measured side by side in one run (issue #19).

    python tools/bench_workers.py CONTAINER [--ram 50%] [--workers 2] [--tokens 48] [--rounds 3]
    python tools/make_stress_model.py HF --layers 6 && colibri-stream convert HF CONTAINER   # the stress model

Each round runs `colibri-stream run --json` once per contender, alternating, with the same prompt and
greedy decoding (the tokens must match: placement never changes them); the best decode tok/s of the
rounds is reported per contender, and their ratio. Network figures come from the coordinator's stats
(bytes both ways / tokens through the MoE layers; the mean round trip of a layer's requests).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile


def run(container: str, ram: str, tokens: int, workers: int, kv_dir: str) -> dict:
    command = [sys.executable, "-m", "colibri_stream", "run", container, "--ids", "11,7,3,5,8,13,2,9"]
    command += ["--max-new-tokens", str(tokens), "--ram", ram, "--json", "--kv-dir", kv_dir]
    if workers:
        command += ["--local-workers", str(workers)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def summary(result: dict) -> dict:
    stats = result["stats"]
    out = {
        "decode_tok_per_s": stats["decode_tok_per_s"],
        "ttft_s": stats["ttft_s"],
        "hit_rate": stats["hit_rate"],
        "misses": stats["misses"],
        "expert_bytes_read": stats["expert_bytes_read"],
    }
    if "network" in stats:
        out["network"] = stats["network"]
        out["workers"] = [
            {k: w[k] for k in ("rank", "experts_held", "ram_slots", "misses", "expert_bytes_read", "io_wait_s")}
            for w in stats["workers"]
        ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("container")
    parser.add_argument("--ram", default="50%", help="RAM for experts, in total (default 50%% of their bytes)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as kv_dir:
        for _ in range(args.rounds):
            results = {
                "one_process": run(args.container, args.ram, args.tokens, 0, kv_dir),
                f"{args.workers}_workers": run(args.container, args.ram, args.tokens, args.workers, kv_dir),
            }
            if len({tuple(r["ids"]) for r in results.values()}) != 1:
                raise SystemExit("the contenders generated different tokens: placement must never change them")
            for name, result in results.items():
                if name not in best or result["stats"]["decode_tok_per_s"] > best[name]["decode_tok_per_s"]:
                    best[name] = summary(result)
    one, many = best["one_process"], best[f"{args.workers}_workers"]
    report = {
        "container": args.container,
        "ram": args.ram,
        "decode_tokens": args.tokens,
        "rounds": args.rounds,
        "contenders": best,
        "workers_vs_one_process": round(many["decode_tok_per_s"] / one["decode_tok_per_s"], 3),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
