"""`colibri-stream demo`: the shipped demo model, converted once, then streamed under a small RAM budget.

The demo model (``colibri_stream/demo_model``, package data: a small MoE trained on the Python standard
library, see its README.md) is converted to int4 into the user's cache directory on first use. Each run then
generates under a RAM budget smaller than the model's routed experts, so experts really stream from
disk, and continues a named session so a second run restores the prompt's KV state from its file.
Everything after the conversion is the one turn every command runs (load_runtime, run_turn).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from colibri_stream.checkpoint.demo_model import DEMO_PROMPT, demo_cache_dir, demo_container_path, demo_model_dir
from colibri_stream.cli.help import help_options
from colibri_stream.cli.options import add_store_arguments, store_options
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.errors import ColibriError
from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, load_runtime, run_turn
from storage.container.reader import is_container

DEMO_SESSION = "demo"
DEFAULT_RAM = "40%"  # of the routed experts' bytes: less than the model, so experts stream
MIB = 1024 * 1024
DEMO_EPILOG = """\
examples:
  colibri-stream demo                                              # convert once, complete, print stats
  colibri-stream demo --prompt "class Stack:" --max-new-tokens 64  # your own Python prompt
  colibri-stream demo --ram 100% --json                            # every expert fits: {text, ids, stats}
  colibri-stream demo --reset                                      # forget the session: a cold start
  colibri-stream demo --model MODEL.cstream --prompt "Hello"       # the same walk-through on your own model
exit status: 0 on success, 1 on a user error (missing demo model, budget, session in use), 2 on bad flags."""


def ensure_container(model_dir: Path, cache_dir: Path, progress: bool) -> Path:
    """The int4 container of ``model_dir``; converted (or an interrupted conversion resumed) on first use."""
    dst = demo_container_path(model_dir, cache_dir)
    report = Converter(model_dir, dst, ConvertOptions(), progress=progress).run()
    if report["status"] == "converted" and progress:
        print(f"converted the demo model to int4: {dst}", file=sys.stderr)
    return dst


def demo_source(model: Path | None) -> Path:
    """The container the demo runs: the shipped model's (converted once), a given container, or a given
    checkpoint's (converted once)."""
    if model is not None and is_container(model):
        return model
    if model is not None and not (model / "config.json").is_file():
        raise ColibriError(f"--model {model}: neither a container nor a checkpoint directory with a config.json")
    return ensure_container(model or demo_model_dir(), demo_cache_dir(), progress=True)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="run the shipped demo model, streaming its experts from disk",
        description=(
            "Convert the shipped demo MoE (trained on the Python standard library) to int4 on first use, "
            f"then complete a Python prompt under a RAM budget smaller than its experts (default {DEFAULT_RAM}), "
            "continuing a session so the next run reuses the prompt's stored KV state."
        ),
        **help_options(DEMO_EPILOG),
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="a container or Hugging Face checkpoint directory (any supported family, DeepSeek-V4 included) "
        "instead of the shipped demo model; a checkpoint is converted to int4 once, into the demo's cache",
    )
    parser.add_argument("--prompt", default=DEMO_PROMPT, help=f"text to complete (default {DEMO_PROMPT!r})")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate (default 48)")
    parser.add_argument("--reset", action="store_true", help="forget the demo session first (a cold start)")
    parser.add_argument("--json", action="store_true", help="print one JSON object {text, ids, stats} as the last line")
    add_store_arguments(parser, ram_default=DEFAULT_RAM)
    parser.set_defaults(handler=demo, ram=DEFAULT_RAM)


def demo(args: argparse.Namespace) -> int:
    path = demo_source(args.model)
    runtime = load_runtime(path, RuntimeOptions(store=store_options(args)))
    tokenizer = runtime.tokenizer
    assert tokenizer is not None  # loaded with its text side
    prompt_ids = tokenizer.encode(args.prompt).ids  # the same ids as `run --prompt`
    show = None
    if not args.json:
        print(args.prompt, end="", flush=True)
        show = lambda t: print(tokenizer.decode([t]), end="", flush=True)  # noqa: E731
    options = TurnOptions(args.max_new_tokens, session=DEMO_SESSION, reset=args.reset, on_token=show)
    try:
        result = run_turn(runtime, prompt_ids, options)
        ram_bytes = runtime.loaded.experts.config.ram_bytes  # type: ignore[union-attr]  # a local container's store
    finally:
        runtime.close()
    if args.json:
        print(json.dumps({"text": tokenizer.decode(result.ids), "ids": result.ids, "stats": result.stats}))
    else:
        print("\n")
        print(describe(result.stats, ram_bytes))
    return 0


def describe(stats: dict, ram_bytes: int) -> str:
    """The tier stats in two lines and one sentence saying what they mean."""
    recall = stats["prefetch_recall"]
    meaning = (
        f"The {ram_bytes / MIB:.1f} MiB RAM cache holds only part of the routed experts, so a miss is an expert "
        "read from disk when the router picked it, a hit one already in RAM; prefetch recall is the share of "
        "used experts guessed one layer ahead, and reused tokens were restored from disk instead of recomputed."
    )
    return (
        f"experts: {stats['expert_requests']} requests, {stats['hits']['ram']} RAM hits, {stats['misses']} misses "
        f"({stats['expert_bytes_read'] / MIB:.1f} MiB read from disk), prefetch recall "
        f"{'n/a' if recall is None else f'{recall:.2f}'}\n"
        f"session: {stats['reused_tokens']} prompt tokens reused from the KV file, "
        f"{stats['prefill_tokens']} prefilled, decode {stats['decode_tok_per_s']:.1f} tok/s\n"
        + textwrap.fill(meaning, width=100)
    )
