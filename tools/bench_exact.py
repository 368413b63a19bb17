"""Decode tok/s of the default exact path beside the int8 path, in one process, rounds alternating.

    python tools/bench_exact.py EXACT_CONTAINER INT8_CONTAINER [--tokens 128] [--rounds 3] [--prompt 32]

EXACT_CONTAINER: a default `convert` (bf16 dense), run with float32 activations (the token-exact path);
INT8_CONTAINER: `convert --dense int8`, run with `--activations int8` (issue #45's "int8 path"). Both at a
100% RAM budget, experts read once before the rounds. Prints each round and the median ratio
exact / int8 (#45 asks >= 0.5).
"""

from __future__ import annotations

import argparse
import json
import statistics

from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exact_container")
    parser.add_argument("int8_container")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (ids 5, 6, ...)")
    args = parser.parse_args()
    paths = {"exact": (args.exact_container, "float32"), "int8": (args.int8_container, "int8")}
    models = {name: load(path, "float32", StoreOptions(ram="100%"), act) for name, (path, act) in paths.items()}
    prompt = list(range(5, 5 + args.prompt))
    for loaded in models.values():
        generate(loaded.model, prompt, args.tokens, loaded.experts)  # every expert these tokens use is read
    rows: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(args.rounds):
        for name, loaded in models.items():
            result = generate(loaded.model, prompt, args.tokens, loaded.experts)
            rows[name].append(round(result.stats.decode_tok_per_s, 2))
            print(json.dumps({"round": round_, "path": name, "decode_tok_per_s": rows[name][-1]}), flush=True)
    for loaded in models.values():
        loaded.experts.close()
    medians = {name: statistics.median(values) for name, values in rows.items()}
    print(json.dumps({"median_tok_per_s": medians, "exact_vs_int8": round(medians["exact"] / medians["int8"], 3)}))


if __name__ == "__main__":
    main()
