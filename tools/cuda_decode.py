"""Decode on a stress model with the experts in RAM vs in VRAM, same run (part of tools/cuda_check.sh).

python tools/cuda_decode.py [--layers 5] [--tokens 32] [--few-slots 16] [--out decode.json]

The model has the bench's proportions (hidden 2048, 64 experts of 1024, top-6), fewer layers so it
builds in seconds. Every run holds every expert in RAM (100% budget, warmed by one run first), so the
difference is where the experts compute: the CPU int4 kernel, the GPU with every expert in VRAM, and
the GPU with fewer VRAM slots than a token's experts (every expert staged through them: the hits are
what the VRAM tier's policy keeps between tokens). The ids must be identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from colibri_stream.bench.stress_model import StressShape, write_stress_checkpoint
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_container
from storage.container.reader import Container
from storage.tiers.config import StoreConfig


def decode(container: Path, vram_slots: int, prompt: list[int], tokens: int) -> dict:
    """Two runs of ``tokens`` with ``vram_slots`` VRAM slots (0: none; the second run is measured)."""
    opened = Container(container)
    vram_bytes = min(vram_slots * opened.layout.record_bytes, opened.expert_bytes)
    config = StoreConfig(ram_bytes=opened.expert_bytes, vram_bytes=vram_bytes, vram_device="cuda")
    loaded = load_container(container, store=config)
    try:
        generate(loaded.model, prompt, tokens, loaded.experts)  # warm: every expert read (and copied up)
        before = loaded.experts.snapshot()
        result = generate(loaded.model, prompt, tokens, loaded.experts)
        stats = loaded.experts.snapshot().minus(before)  # the measured run's own counts
    finally:
        loaded.experts.close()
    return {
        "decode_tok_per_s": round(result.stats.decode_tok_per_s, 2),
        "ids": result.ids,
        "hits_vram": stats.hits_vram,
        "requests": stats.requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--few-slots", type=int, default=16, help="the small VRAM tier's slots (a token routes to 24)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shape = dataclasses.replace(StressShape(), num_hidden_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_stress_checkpoint(Path(tmp) / "hf", shape, progress=False)
        container = Path(tmp) / "int4"
        Converter(hf, container, ConvertOptions(experts="int4"), progress=False).run()
        prompt = list(range(2, 34))
        ram, gpu, few = (decode(container, slots, prompt, args.tokens) for slots in (0, 1 << 30, args.few_slots))
    result = {
        "shape": dataclasses.asdict(shape),
        "threads": torch.get_num_threads(),
        "ram_tok_per_s": ram["decode_tok_per_s"],
        "vram_tok_per_s": gpu["decode_tok_per_s"],
        "vram_vs_ram": round(gpu["decode_tok_per_s"] / max(ram["decode_tok_per_s"], 1e-9), 2),
        "same_ids": ram["ids"] == gpu["ids"] == few["ids"],
        "hits_vram": gpu["hits_vram"],
        "few_slots": args.few_slots,
        "few_slots_tok_per_s": few["decode_tok_per_s"],
        "few_slots_hit_rate": round(few["hits_vram"] / max(few["requests"], 1), 4),
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
