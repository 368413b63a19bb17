"""Decode with every layer in one C call vs the module path (engine/fused_decode.py), int8 activations,
experts preloaded (100% RAM), one model in one process, alternating rounds so machine noise hits both alike.

python tools/bench_fused_decode.py CONTAINER [--tokens 64] [--rounds 5]

CONTAINER: converted with `--dense int8` or `--dense int4` (the C steps read coded dense weights). Prints
decode tok/s per path (the median round), their ratio, the ms a token spends per path, and whether the
greedy ids agree (they must: the same kernels in the same order).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path

from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_container
from engine.fused_decode import module_path
from storage.container import Container
from storage.tiered import StoreConfig

PROMPT = [1, 17, 42, 7, 99, 5, 3, 250]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("container", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    budget = StoreConfig(ram_bytes=Container(args.container).expert_bytes, preload=True)
    loaded = load_container(args.container, store=budget, int8_activations=True)
    generate(loaded.model, PROMPT, 4, loaded.experts)  # warm
    paths = {"module path": module_path, "one call": contextlib.nullcontext}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    ids: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, context in paths.items():
            with context():
                result = generate(loaded.model, PROMPT, args.tokens, loaded.experts)
            rates[name].append(result.stats.decode_tokens / max(result.stats.decode_s, 1e-9))
            ids[name] = result.ids
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:12s} {median:7.2f} tok/s  {1000 / median:6.2f} ms/token  rounds {[round(v, 1) for v in values]}")
    ratio = statistics.median(rates["one call"]) / statistics.median(rates["module path"])
    print(f"one call / module path: {ratio:.2f}x; same greedy ids: {ids['one call'] == ids['module path']}")


if __name__ == "__main__":
    main()
