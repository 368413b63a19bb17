"""Decode with the dense part held in bf16 (C kernel) vs upcast to float32 at load, same process.

python tools/bench_dense.py CONTAINER [--tokens 32] [--rounds 2]

Both load the same container with a 100% RAM budget and alternate, so machine noise hits both alike;
greedy ids must agree.
"""

from __future__ import annotations

import argparse
import gc
import json

import colibri_stream.planning.placement as placement
from colibri_stream.runtime import loader
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.memory import return_large_frees_to_the_os
from storage.container.reader import Container
from storage.tiers.config import StoreConfig


def decode(path: str, prompt: list[int], tokens: int) -> dict:
    loaded = loader.load_container(path, store=StoreConfig(ram_bytes=Container(path).expert_bytes))
    try:
        generate(loaded.model, prompt, tokens, loaded.experts)  # warm: the experts these tokens use are read
        result = generate(loaded.model, prompt, tokens, loaded.experts)
    finally:
        loaded.experts.close()
    dense = sum(p.nbytes for p in loaded.model.parameters())
    return {"decode_tok_per_s": round(result.stats.decode_tok_per_s, 2), "dense_bytes": dense, "ids": result.ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("container")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    return_large_frees_to_the_os()
    kernel = placement.bf16_kernel_available
    prompt = list(range(5, 21))
    rows = []
    for _ in range(args.rounds):
        for name, available in (("float32 dense", lambda: False), ("bf16 dense", kernel)):
            placement.bf16_kernel_available = available
            rows.append({"dense": name, **decode(args.container, prompt, args.tokens)})
            gc.collect()
    placement.bf16_kernel_available = kernel
    same = len({tuple(r.pop("ids")) for r in rows}) == 1
    print(json.dumps({"rows": rows, "same_ids": same}))


if __name__ == "__main__":
    main()
