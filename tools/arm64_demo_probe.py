"""One side of tools/arm64_emulated_demo.py: run by the x86 host's Python and by the aarch64 Python under qemu.

python tools/arm64_demo_probe.py --tokens 24 [--prompt TEXT] [--oracle]

Prints one JSON line: the machine, torch's version, the kernel level `colibri-stream doctor` names (its
"kernels" line: the same function), and the float engine's greedy ids on the shipped demo checkpoint
(bfloat16 weights, the C bf16 kernel) after the demo's prompt; with --oracle also transformers' greedy ids
(the host only: transformers is not installed for the aarch64 Python). The demo's own run (convert to
int4, then generate) is `python -m colibri_stream demo --json`, which the driver runs as a second process.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from colibri_stream.checkpoint.demo_model import DEMO_PROMPT, demo_model_dir
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint
from colibri_stream.text.chat_format import load_tokenizer
from engine.kernels.isa import kernel_isa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--prompt", default=DEMO_PROMPT, help="text to continue (default: the demo's)")
    parser.add_argument("--oracle", action="store_true", help="also transformers' greedy ids (needs transformers)")
    args = parser.parse_args()
    demo = demo_model_dir()
    prompt = load_tokenizer(demo).encode(args.prompt).ids
    start = time.perf_counter()
    loaded = load_checkpoint(demo)
    ids = generate(loaded.model, prompt, args.tokens, loaded.experts).ids
    out: dict[str, object] = {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "kernels": kernel_isa(),
        "float_ids": list(ids),
        "float_s": round(time.perf_counter() - start, 1),
    }
    if args.oracle:
        from colibri_stream.devtools.fixtures import load_reference, oracle_greedy  # transformers: host only

        out["oracle_ids"] = oracle_greedy(load_reference(demo), prompt, args.tokens)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
