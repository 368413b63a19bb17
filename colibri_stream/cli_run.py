"""`colibri-stream run`: generate from a prompt (ids or text) and report measured stats."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from colibri_stream.container_model import load_model
from colibri_stream.generate import SamplingParams, generate
from colibri_stream.text import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids expects comma-separated integers, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"--ids expects non-negative integers, got {text!r}")
    return ids


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "run",
        help="generate a continuation of a prompt",
        description="Generate a continuation of a prompt with a Hugging Face checkpoint directory.",
    )
    parser.add_argument("path", help="a converted container, or a Hugging Face checkpoint directory")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--ids", type=parse_ids, help="prompt token ids, comma-separated (e.g. 1,2,3)")
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json in PATH)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible samples")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype")
    parser.add_argument("--json", action="store_true", help="print one JSON object {ids, stats} as the last line")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    sampling = SamplingParams(args.temperature, args.top_p, args.seed)
    tokenizer = load_tokenizer(args.path) if args.prompt is not None else None
    loaded = load_model(args.path, dtype=DTYPES[args.dtype])
    prompt_ids = tokenizer.encode(args.prompt).ids if tokenizer is not None else args.ids
    vocab = loaded.args.vocab_size
    if bad := [i for i in prompt_ids if i >= vocab]:
        raise ValueError(f"prompt ids {bad[:5]} are outside the vocabulary (size {vocab})")
    stream = tokenizer is not None and not args.json
    on_token = (lambda t: print(tokenizer.decode([t]), end="", flush=True)) if stream else None
    result = generate(loaded.model, prompt_ids, args.max_new_tokens, loaded.experts, sampling, on_token=on_token)
    if args.json:
        out = {"ids": result.ids, "stats": result.stats.as_dict()}
        if tokenizer is not None:
            out["text"] = tokenizer.decode(result.ids)
        print(json.dumps(out))
    elif stream:
        print()
    else:
        print(",".join(map(str, result.ids)))
        stats = result.stats
        print(
            f"prefill {stats.prefill_tokens} tok in {stats.prefill_s:.3f}s, "
            f"decode {stats.decode_tokens} tok at {stats.decode_tok_per_s:.2f} tok/s",
            file=sys.stderr,
        )
    return 0
