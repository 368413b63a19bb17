"""One side of tools/arm64_emulated_demo.py: run by the x86 host's Python and by the aarch64 Python under qemu.

python tools/arm64_demo_probe.py --tokens 24 [--prompt TEXT] [--container C] [--logits-out F.npz] [--oracle]

Prints one JSON line: the machine, torch's version, the kernel level `colibri-stream doctor` names (its
"kernels" line: the same function) and greedy ids after the prompt: the float engine's on the shipped demo
checkpoint (loaded as float32: torch's matmuls; what transformers' ids are compared with) and, given
--container (the int4 container `colibri-stream demo` converted: bf16 dense weights, int4 experts), the
container's with int8 activations (`--activations int8`: the q8 kernel, SDOT where the CPU has dot-product;
the demo itself computes float activations: the float 4-bit kernel). --logits-out: every
position's logits over the prompt and the float ids, prefilled, of each model (float, int4, int4 with int8
activations) in one .npz. --oracle: transformers' greedy ids too (the host only: transformers is not installed
for the aarch64 Python).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from colibri_stream.checkpoint.demo_model import DEMO_PROMPT, demo_model_dir
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint, load_container
from colibri_stream.text.chat_format import load_tokenizer
from engine.kernels.isa import kernel_isa


def prefill_logits(loaded: Any, ids: list[int]) -> np.ndarray:
    """[len(ids), vocab] float32 logits of one prefill forward in a fresh cache."""
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids]), 0, loaded.model.new_cache(), loaded.experts)[0]
    return np.asarray(logits.float().numpy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--prompt", default=DEMO_PROMPT, help="text to continue (default: the demo's)")
    parser.add_argument("--container", type=Path, help="the demo's int4 container (int8-activation ids, logits)")
    parser.add_argument("--logits-out", type=Path, help="write the prefill logits here (.npz)")
    parser.add_argument("--oracle", action="store_true", help="also transformers' greedy ids (needs transformers)")
    args = parser.parse_args()
    demo = demo_model_dir()
    prompt = load_tokenizer(demo).encode(args.prompt).ids
    start = time.perf_counter()
    loaded = load_checkpoint(demo)
    ids = list(generate(loaded.model, prompt, args.tokens, loaded.experts).ids)
    out: dict[str, object] = {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "kernels": kernel_isa(),
        "float_ids": ids,
    }
    logits = {"float": prefill_logits(loaded, prompt + ids)}
    if args.container is not None:
        int4 = load_container(args.container)
        logits["int4"] = prefill_logits(int4, prompt + ids)
        q8 = load_container(args.container, int8_activations=True)
        out["int8_activation_ids"] = list(generate(q8.model, prompt, args.tokens, q8.experts).ids)
        logits["int4_int8_activations"] = prefill_logits(q8, prompt + ids)
    out["probe_s"] = round(time.perf_counter() - start, 1)
    if args.logits_out is not None:
        np.savez(args.logits_out, **logits)  # type: ignore[arg-type]  # numpy's stub types **kwds as one array
    if args.oracle:
        from colibri_stream.devtools.fixtures import load_reference, oracle_greedy  # transformers: host only

        out["oracle_ids"] = oracle_greedy(load_reference(demo), prompt, args.tokens)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
