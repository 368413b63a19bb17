"""Decode with the dense part as int8 vs int4 records (`convert --dense int8 / int4`), int8 activations,
experts preloaded (100% RAM), same process, alternating rounds so machine noise hits both alike.

python tools/bench_dense_codes.py CHECKPOINT --work DIR [--tokens 48] [--rounds 3]

CHECKPOINT: an HF directory (e.g. `python tools/make_stress_model.py DIR --layers 6`). Prints decode tok/s
per format (the median round), the dense bytes a token reads, and whether the two agree on the greedy ids
(they need not: int4 is another model; the exact float path is `--activations float32`).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import LoadedModel, load_container
from engine.kernels.int8_dense import CodedLinear
from storage.container.reader import Container
from storage.tiers.config import StoreConfig

FORMATS = ("int8", "int4")


def convert(checkpoint: Path, work: Path, dense: str) -> Path:
    dst = work / f"dense-{dense}"
    if not (dst / "zarr.json").exists():
        Converter(checkpoint, dst, ConvertOptions(experts="int4", dense=dense), progress=False).run()
    return dst


def coded_bytes(loaded: LoadedModel) -> int:
    """Bytes of the coded dense Linears (codes and scales): what a decode token reads of them."""
    coded = [m for m in loaded.model.modules() if isinstance(m, CodedLinear)]
    return sum(m.q.nbytes + m.scales.nbytes for m in coded)


def decode_rate(loaded: LoadedModel, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Decode tok/s (the decode phase's tokens over its seconds) and the greedy ids."""
    result = generate(loaded.model, prompt, tokens, loaded.experts)
    return result.stats.decode_tokens / max(result.stats.decode_s, 1e-9), result.ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--work", type=Path, required=True, help="where the two containers are written")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    prompt = [1, 17, 42, 7, 99, 5, 3, 250]
    loaded = {}
    for dense in FORMATS:
        path = convert(args.checkpoint, args.work, dense)
        budget = StoreConfig(ram_bytes=Container(path).expert_bytes, preload=True)
        loaded[dense] = load_container(path, store=budget, int8_activations=True)
        generate(loaded[dense].model, prompt, 4, loaded[dense].experts)  # warm
    rates: dict[str, list[float]] = {dense: [] for dense in FORMATS}
    ids = {}
    for _ in range(args.rounds):
        for dense in FORMATS:
            rate, ids[dense] = decode_rate(loaded[dense], prompt, args.tokens)
            rates[dense].append(rate)
    print("| dense | decode tok/s (median) | coded dense MB per token |\n|---|---:|---:|")
    for dense in FORMATS:
        print(f"| {dense} | {statistics.median(rates[dense]):.2f} | {coded_bytes(loaded[dense]) / 1e6:.1f} |")
    ratio = statistics.median(rates["int4"]) / statistics.median(rates["int8"])
    print(f"int4 / int8: {ratio:.3f}x; same greedy ids: {ids['int8'] == ids['int4']}")


if __name__ == "__main__":
    main()
