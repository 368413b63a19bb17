"""`colibri-stream run`: generate from a prompt (ids or text) and report measured stats."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from colibri_stream.budget import Budget, auto_ram_bytes, load_budget_file, parse_size
from colibri_stream.checkpoint import LoadedModel, load_checkpoint
from colibri_stream.cli_help import help_options
from colibri_stream.container_model import load_container
from colibri_stream.generate import GenerationResult, SamplingParams, generate
from colibri_stream.memory import PeakSampler, disk_read_bytes, peak_rss_bytes
from colibri_stream.plan import check_fits, plan
from colibri_stream.sessions import Session, default_kv_dir, model_fingerprint
from colibri_stream.text import load_tokenizer
from storage.container import Container, is_container
from storage.kvlog import RECORD_DTYPES
from storage.simulate import write_trace
from storage.tiered import POLICY_NAMES, StoreConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

RUN_EPILOG = """\
examples:
  colibri-stream run MODEL --ids 1,2,3 --max-new-tokens 32 --json       # ids in, ids + stats out
  colibri-stream run MODEL --prompt "Hello" --temperature 0.7 --seed 1  # text (needs tokenizer.json)
  colibri-stream run MODEL.cstream --prompt "Hi" --budget budgets/laptop-32g.toml --dtype bfloat16
  colibri-stream run MODEL.cstream --ids 1,2,3 --session notes           # continue a stored conversation
exit status: 0 on success, 1 on a user error (bad path, config, budget, session), 2 on bad flags."""


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids expects comma-separated integers, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"--ids expects non-negative integers, got {text!r}")
    return ids


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags sizing and tuning the tiered expert store (containers only); they override --budget."""
    group = parser.add_argument_group("expert streaming (containers)")
    group.add_argument("--budget", help="TOML budget file ([memory] ram/vram, [io] direct/threads, [cache] ...)")
    group.add_argument("--ram", help="RAM for expert slots: 8GiB, 512MB, 25%% (of expert bytes) or auto")
    group.add_argument("--vram", help="VRAM for expert slots, same forms as --ram (default 0: no VRAM tier)")
    group.add_argument("--vram-device", default=None, help="device of the VRAM tier (default cuda; cpu stands in)")
    group.add_argument("--policy", choices=POLICY_NAMES, help="eviction policy (default lru)")
    group.add_argument("--no-prefetch", action="store_true", help="disable router-lookahead prefetch")
    io = group.add_mutually_exclusive_group()
    io.add_argument("--direct", action="store_true", help="read experts with O_DIRECT (the default where supported)")
    io.add_argument("--buffered", action="store_true", help="read experts through the page cache instead of O_DIRECT")
    group.add_argument("--io-threads", type=int, help="disk reader threads (default 4)")
    group.add_argument("--history", help="usage-history file (learned hot store), updated after the run")
    group.add_argument("--trace", help="write the routing trace (one JSON line per MoE acquire) to this file")


def store_config(args: argparse.Namespace, container: Container) -> StoreConfig:
    budget = load_budget_file(args.budget) if args.budget else Budget()
    expert_bytes = container.expert_bytes
    provisional = plan(container, StoreConfig(ram_bytes=0), getattr(args, "dtype", "float32"))
    auto = auto_ram_bytes(provisional.dense_bytes, provisional.kv_bytes_at_max_context)
    ram = parse_size(args.ram if args.ram is not None else budget.ram, expert_bytes, "ram", auto_bytes=auto)
    vram = parse_size(args.vram if args.vram is not None else budget.vram, expert_bytes, "vram")
    history = args.history if args.history is not None else budget.history
    return StoreConfig(
        ram_bytes=ram,
        vram_bytes=vram,
        vram_device=args.vram_device or ("cuda" if torch.cuda.is_available() else "cpu"),
        policy=args.policy or budget.policy,
        prefetch=budget.prefetch and not args.no_prefetch,
        direct=args.direct or (budget.direct and not args.buffered),
        threads=args.io_threads or budget.threads,
        history_path=Path(history) if history else None,
    )


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
    sessions = parser.add_argument_group("sessions (compressed KV on disk)")
    sessions.add_argument("--session", help="continue (or start) this named conversation: reuses its stored KV prefix")
    sessions.add_argument("--reset", action="store_true", help="clear the session before this turn")
    sessions.add_argument("--kv-dir", help="where session files live (default: ~/.cache/colibri-stream/kv/<model>)")
    sessions.add_argument(
        "--kv-dtype",
        choices=sorted(RECORD_DTYPES),
        default="float32",
        help="record dtype (float32 is exact; bfloat16 halves the file)",
    )
    sessions.add_argument(
        "--kv-sync-every",
        type=int,
        default=0,
        metavar="N",
        help="also append + fsync the KV log every N generated tokens (default 0: once, at the end of the turn)",
    )
    add_store_arguments(parser)
    parser.set_defaults(handler=run)


def open_session(args: argparse.Namespace, model_args) -> Session:
    fingerprint = model_fingerprint(args.path)
    kv_dir = Path(args.kv_dir) if args.kv_dir else default_kv_dir(fingerprint)
    session = Session(kv_dir, args.session, fingerprint, model_args, args.kv_dtype)
    if args.reset:
        session.reset()
    return session


def load_for_run(args: argparse.Namespace):
    dtype = DTYPES[args.dtype]
    if is_container(args.path):
        container = Container(args.path)
        config = store_config(args, container)
        check_fits(plan(container, config, args.dtype))
        return load_container(args.path, dtype, config)
    return load_checkpoint(args.path, dtype)


def with_periodic_sync(show, session: Session | None, cache, prompt_ids: list[int], every: int):
    """The per-token callback: print the token, and every ``every`` tokens persist the session so far."""
    if session is None or every <= 0:
        return show
    generated: list[int] = []

    def on_token(token: int) -> None:
        generated.append(token)
        if show is not None:
            show(token)
        if len(generated) % every == 0:
            session.end_turn(cache, prompt_ids + generated)  # positions computed so far; fsynced

    return on_token


def with_prefill_snapshot(on_token, experts, snapshots: list):
    """Wrap the per-token callback so the store's counters are copied when the first token arrives:
    everything after that copy is decode (hit rates and bytes per token without the prompt's reads)."""
    if not hasattr(experts, "snapshot"):
        return on_token

    def first_token_aware(token: int) -> None:
        if not snapshots:
            snapshots.append((experts.snapshot(), disk_read_bytes()))
        if on_token is not None:
            on_token(token)

    return first_token_aware


def run_turn(
    loaded: LoadedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    session: Session | None = None,
    show: Callable[[int], None] | None = None,
    trace: str | None = None,
    sync_every: int = 0,
) -> tuple[GenerationResult, dict]:
    """One generation turn: restore the session's KV prefix, generate (``show`` sees each token; the
    session is persisted every ``sync_every`` tokens), persist the turn, and collect the measured stats
    (generation, session reuse, expert tiers, memory). Closes nothing: callers (run, demo) own the
    session and the store."""
    turn = session.start_turn(prompt_ids, loaded.model.dtype) if session else None
    cache = turn.cache if turn else loaded.model.new_cache()
    at_first_token: list = []
    on_token = with_periodic_sync(show, session, cache, prompt_ids, sync_every)
    on_token = with_prefill_snapshot(on_token, loaded.experts, at_first_token)
    with PeakSampler() as uss:
        result = generate(
            loaded.model, prompt_ids, max_new_tokens, loaded.experts, sampling, cache=cache, on_token=on_token
        )
    stats = result.stats.as_dict()
    if session:
        session.end_turn(cache, prompt_ids + result.ids)
        stats.update(reused_tokens=turn.reused_tokens, kv_load_s=round(turn.kv_load_s, 6))
    if hasattr(loaded.experts, "report"):
        loaded.experts.end_turn()
        stats.update(loaded.experts.report())
        if at_first_token:
            store_then, disk_then = at_first_token[0]
            stats["decode_phase"] = loaded.experts.snapshot().minus(store_then).as_dict()
            stats["decode_phase"]["disk_read_bytes"] = disk_read_bytes() - disk_then
        if trace:
            write_trace(trace, loaded.experts.trace)
    stats.update(peak_rss_bytes=peak_rss_bytes(), peak_uss_bytes=uss.peak)
    return result, stats


def close_run(loaded: LoadedModel, session: Session | None) -> None:
    if session:
        session.close()
    if hasattr(loaded.experts, "close"):
        loaded.experts.close()


def run(args: argparse.Namespace) -> int:
    sampling = SamplingParams(args.temperature, args.top_p, args.seed)
    tokenizer = load_tokenizer(args.path) if args.prompt is not None else None
    loaded = load_for_run(args)
    prompt_ids = tokenizer.encode(args.prompt).ids if tokenizer is not None else args.ids
    vocab = loaded.args.vocab_size
    if bad := [i for i in prompt_ids if i >= vocab]:
        raise ValueError(f"prompt ids {bad[:5]} are outside the vocabulary (size {vocab})")
    stream = tokenizer is not None and not args.json
    show = (lambda t: print(tokenizer.decode([t]), end="", flush=True)) if stream else None
    session = open_session(args, loaded.args) if args.session else None
    try:
        result, stats = run_turn(
            loaded, prompt_ids, args.max_new_tokens, sampling, session, show, args.trace, args.kv_sync_every
        )
    finally:
        close_run(loaded, session)
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
