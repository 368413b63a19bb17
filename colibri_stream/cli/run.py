"""`colibri-stream run`: generate from a prompt (ids or text) and report measured stats."""

from __future__ import annotations

import argparse
import json
import sys

from colibri_stream.cli.help import help_options
from colibri_stream.cli.options import (
    add_runtime_arguments,
    add_sampling_arguments,
    parse_ids,
    runtime_options,
    sampling,
    session_wait,
)
from colibri_stream.runtime.kv.lock import SessionLease
from colibri_stream.runtime.kv.sessions import check_session_name
from colibri_stream.runtime.turn import TurnOptions, load_runtime, run_turn

RUN_EPILOG = """\
examples:
  colibri-stream run MODEL --ids 1,2,3 --max-new-tokens 32 --json       # ids in, ids + stats out
  colibri-stream run MODEL --prompt "Hello" --temperature 0.7 --seed 1  # text (needs tokenizer.json)
  colibri-stream run MODEL.cstream --prompt "Hi" --budget budgets/laptop-32g.toml --dtype bfloat16
  colibri-stream run MODEL.cstream --ids 1,2,3 --session notes           # continue a stored conversation
  colibri-stream run MODEL --ids 4,5 --session notes --wait-session=60   # wait while another process has it
exit status: 0 on success, 1 on a user error (bad path, config, budget, session), 2 on bad flags."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "run",
        help="generate a continuation of a prompt",
        description=(
            "Generate a continuation of a prompt. PATH is a converted container (experts streamed under the "
            "memory budget) or a Hugging Face checkpoint directory (everything resident)."
        ),
        **help_options(RUN_EPILOG),
    )
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--ids", type=parse_ids, help="prompt token ids, comma-separated (e.g. 1,2,3)")
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json in PATH)")
    add_sampling_arguments(parser, 32, "tokens to generate")
    parser.add_argument("--json", action="store_true", help="print one JSON object {ids, stats} as the last line")
    parser.add_argument("--session", help="continue (or start) this named conversation: reuses its stored KV prefix")
    parser.add_argument("--reset", action="store_true", help="clear the session before this turn")
    add_runtime_arguments(parser)
    parser.set_defaults(handler=run)


def note_context_cut(context: int, prompt_tokens: int, max_new_tokens: int) -> None:
    """One line on stderr when the answer will be shorter than asked because the context ends first
    (a prompt that does not fit at all is run_turn's error)."""
    room = context - prompt_tokens
    if 0 < room < max_new_tokens:
        print(
            f"colibri-stream run: note: --max-new-tokens {max_new_tokens} cut to {room}: the prompt has "
            f"{prompt_tokens} tokens and the context is {context}",
            file=sys.stderr,
        )


def run(args: argparse.Namespace) -> int:
    params = sampling(args)
    if args.session is not None:
        check_session_name(args.session)  # before the (slow) model load
    runtime = load_runtime(args.path, runtime_options(args, text=args.prompt is not None))
    lease = None
    try:
        if args.session is not None and args.wait_session is not None:  # the turn's own lock shares this one
            lease = SessionLease(runtime.kv_dir, args.session, session_wait(args, "run"))
        tokenizer = runtime.tokenizer
        prompt_ids = tokenizer.encode(args.prompt).ids if tokenizer is not None else args.ids
        note_context_cut(runtime.context_size, len(prompt_ids), args.max_new_tokens)
        stream = tokenizer is not None and not args.json
        # stream implies a tokenizer (mypy does not narrow a captured variable inside a lambda)
        show = (lambda t: print(tokenizer.decode([t]), end="", flush=True)) if stream else None  # type: ignore[union-attr]
        options = TurnOptions(
            args.max_new_tokens, params, args.session, args.reset, sync_every=args.kv_sync_every, on_token=show
        )
        result = run_turn(runtime, prompt_ids, options)
    finally:
        if lease is not None:
            lease.release()
        runtime.close()
    stats = result.stats
    if args.json:
        out = {"ids": result.ids, "stats": stats}
        if tokenizer is not None:
            out["text"] = tokenizer.decode(result.ids)
        print(json.dumps(out))
    elif stream:
        print()
    else:
        print(",".join(map(str, result.ids)))
        print(
            f"prefill {stats['prefill_tokens']} tok in {stats['prefill_s']:.3f}s, "
            f"decode {stats['decode_tokens']} tok at {stats['decode_tok_per_s']:.2f} tok/s",
            file=sys.stderr,
        )
    return 0
