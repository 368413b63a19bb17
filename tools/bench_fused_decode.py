"""Decode with every layer in one C call vs the module path (engine/mla/fused_decode.py), int8 activations,
experts preloaded (100% RAM), loaded as `run` loads it (the machine's read-ahead choice included), one
model in one process, alternating rounds so machine noise hits both alike.

python tools/bench_fused_decode.py CONTAINER [--tokens 64] [--rounds 5] [--batch 4]

CONTAINER: converted with `--dense int8` or `--dense int4` (the C steps read coded dense weights). Prints
decode tok/s per path (the median round), their ratio, the ms a token spends per path, and whether the
greedy ids agree (they must: the same kernels in the same order). With --batch B, also B conversations
decoded together (one forward_rows step of B rows) against the same steps one conversation at a time:
aggregate tok/s per path and the batch's gain.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import LoadedModel, load
from engine.mla.fused_decode import module_path

PROMPT = [1, 17, 42, 7, 99, 5, 3, 250]
PATHS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "module path": module_path,
    "one call": contextlib.nullcontext,
}


def rows_rate(loaded: LoadedModel, batch: int, steps: int, together: bool) -> float:
    """Aggregate decode tok/s of ``batch`` conversations (prompts of different lengths) over ``steps`` steps:
    one forward_rows of all rows per step, or one per conversation."""
    model, experts = loaded.model, loaded.experts
    caches = [model.new_cache() for _ in range(batch)]
    for b, cache in enumerate(caches):
        model(torch.tensor([PROMPT[: 3 + b]]), 0, cache, experts)
    start = time.perf_counter()
    for step in range(steps):
        tokens = [(step * 7 + b) % 200 + 1 for b in range(batch)]
        if together:
            model.forward_rows(tokens, caches, experts)
        else:
            for token, cache in zip(tokens, caches, strict=True):
                model.forward_rows([token], [cache], experts)
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("container", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=0, help="conversations decoded together (0: skip)")
    args = parser.parse_args()
    # as `run` loads it (the machine's read-ahead choice included): every expert in RAM, int8 activations
    loaded = load(args.container, store=StoreOptions(ram="100%"), activations="int8")
    generate(loaded.model, PROMPT, 4, loaded.experts)  # warm
    rates: dict[str, list[float]] = {name: [] for name in PATHS}
    ids: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, context in PATHS.items():
            with context():
                result = generate(loaded.model, PROMPT, args.tokens, loaded.experts)
            rates[name].append(result.stats.decode_tokens / max(result.stats.decode_s, 1e-9))
            ids[name] = result.ids
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:12s} {median:7.2f} tok/s  {1000 / median:6.2f} ms/token  rounds {[round(v, 1) for v in values]}")
    ratio = statistics.median(rates["one call"]) / statistics.median(rates["module path"])
    print(f"one call / module path: {ratio:.2f}x; same greedy ids: {ids['one call'] == ids['module path']}")
    if args.batch:
        batch_rows(loaded, args.batch, args.tokens // 2, args.rounds)


def batch_rows(loaded: LoadedModel, batch: int, steps: int, rounds: int) -> None:
    runs: dict[tuple[str, bool], list[float]] = {(name, together): [] for name in PATHS for together in (False, True)}
    for _ in range(rounds):
        for name, together in runs:
            with torch.inference_mode(), PATHS[name]():
                runs[name, together].append(rows_rate(loaded, batch, steps, together))
    for name in PATHS:
        alone, together = (statistics.median(runs[name, t]) for t in (False, True))
        print(f"{name:12s} {batch} conversations: one at a time {alone:7.2f} tok/s, together {together:7.2f} tok/s: "
              f"{together / alone:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
