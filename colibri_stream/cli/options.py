"""Flags shared by the commands, and their translation into the library's dataclasses: library code
never sees an argparse Namespace."""

from __future__ import annotations

import argparse
import math
import sys

from colibri_stream.checkpoint.dtypes import COMPUTE_DTYPES
from colibri_stream.errors import BudgetError, RequestError
from colibri_stream.experts.cluster.group import DEFAULT_TIMEOUT_S, ClusterOptions
from colibri_stream.experts.cluster.local import LOCALHOST, MAX_LOCAL_WORKERS, check_local_workers
from colibri_stream.planning.budget import TABLES, Budget, StoreOptions, parse_size, prefix_config, prefix_size
from colibri_stream.planning.geometry import (
    DEFAULT_DENSE,
    DEFAULT_EXPERTS,
    DEFAULT_GROUP_SIZE,
    DENSE_SCHEMES,
    EXPERT_SCHEMES,
    REQUANTISED_EXPERTS,
    ContainerTarget,
)
from colibri_stream.runtime.generate import SamplingParams
from colibri_stream.runtime.kv.lock import SessionWait
from colibri_stream.runtime.mtp_governor import MODES, MTPOptions
from colibri_stream.runtime.turn import RuntimeOptions
from storage.kv.log import RECORD_DTYPES
from storage.tiers.policy import POLICY_NAMES
from storage.tiers.tiered import MAX_IO_THREADS


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids expects comma-separated integers, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"--ids expects non-negative integers, got {text!r}")
    return ids


def finite_float(text: str) -> float:
    """A number flag: "nan" and "inf" (which float() reads) are usage errors like "abc"; whether a
    finite value is in range is the library's check (SamplingParams), a one-line error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def io_threads(text: str) -> int:
    """--io-threads: 1 .. MAX_IO_THREADS (storage.tiers.tiered, where the bound is stated)."""
    value = positive_int(text)
    if value > MAX_IO_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_IO_THREADS} disk reader threads, got {text!r}")
    return value


def parse_size_flag(text: str) -> str:
    """--ram/--vram checked for form when the flags are read (a percentage needs the model, so the
    value itself is computed at load): 8GiB, 512MB, 25%, auto."""
    try:
        parse_size(text, 0, "size", auto_bytes=0)
    except BudgetError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("size: ")) from None
    return text


def add_target_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--experts, --group-size, --dense, --no-mtp: the container a conversion writes (`convert`, `pull`) or
    would write (`plan`)."""
    parser.add_argument(
        "--experts",
        choices=EXPERT_SCHEMES,
        default=DEFAULT_EXPERTS,
        help=(
            f"routed-expert format (default {DEFAULT_EXPERTS}: a compressed-tensors source's 4-bit experts copied "
            f"as shipped, {REQUANTISED_EXPERTS} otherwise; any other value re-quantises from the weights)"
        ),
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help=(
            f"quantisation group along the input dim (default: the source's where experts are copied, "
            f"{DEFAULT_GROUP_SIZE} otherwise)"
        ),
    )
    parser.add_argument(
        "--dense",
        choices=DENSE_SCHEMES,
        default=DEFAULT_DENSE,
        help=(
            f"dense-weight format (default {DEFAULT_DENSE}; f32 lossless): int8 / int4 store 2-D weights as "
            "group-quantised codes, read as codes with --activations int8 (int4 keeps the embedding, output "
            "head, router, DSA indexer and MLA's wkv_b int8)"
        ),
    )
    parser.add_argument(
        "--no-mtp",
        action="store_true",
        help=(
            "leave out the multi-token-prediction layer the checkpoint ships (DeepSeek-V3/R1, GLM-5, "
            "DeepSeek-V4): smaller container, no speculative decoding"
        ),
    )


def target_options(args: argparse.Namespace) -> ContainerTarget:
    return ContainerTarget(experts=args.experts, group_size=args.group_size, dense=args.dense, mtp=not args.no_mtp)


DEFAULTS = Budget()  # what the store flags default to without a budget file


def _shown(value: object) -> str:
    return str(value).replace("%", "%%")  # argparse %-formats help text


def _binary_size(value: str | int) -> str:
    """8589934592 -> "8GiB" (a default shown in help the way a user would write it)."""
    if isinstance(value, str):
        return value
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale and value % scale == 0:
            return f"{value // scale}{unit}"
    return str(value)


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _if_default(flag: bool) -> str:
    return " (the default)" if flag else ""


def add_store_arguments(parser: argparse.ArgumentParser, ram_default: str | int | None = None) -> None:
    """Flags sizing and tuning the tiered expert store (containers only); they override --budget. Every
    flag defaults to None, "the budget file's, else ``Budget``'s": the defaults in the help are read from
    ``Budget`` (whose store settings are ``StoreConfig``'s), never written here. ``ram_default``: what
    the help says of a command that sizes RAM its own way without --ram or --budget (plan, demo)."""
    ram_default = DEFAULTS.ram if ram_default is None else ram_default
    group = parser.add_argument_group("expert streaming (containers)")
    tables = ", ".join(f"[{table}]" for table in TABLES)
    group.add_argument("--budget", help=f"TOML budget file ({tables}; an unknown key is an error)")
    group.add_argument(
        "--ram",
        type=parse_size_flag,
        help=f"RAM for expert slots: 8GiB, 512MB, 25%% (of expert bytes) or auto (default {_shown(ram_default)})",
    )
    group.add_argument(
        "--vram",
        type=parse_size_flag,
        help=f"VRAM for expert slots, same forms as --ram; 0: no VRAM tier (default {_shown(DEFAULTS.vram)})",
    )
    group.add_argument("--vram-device", default=None, help="device of the VRAM tier (default cuda; cpu stands in)")
    group.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        help="which RAM expert leaves when a read needs its slot: frequent (fewest recent routings), lru, hybrid, "
        f"or pinned (lru plus the --history's hottest experts held for good) (default {DEFAULTS.policy})",
    )
    group.add_argument(
        "--prefetch",
        action=argparse.BooleanOptionalAction,
        help=f"router-guided prefetch (default {_on(DEFAULTS.prefetch)})",
    )
    group.add_argument(
        "--prefetch-layers",
        type=positive_int,
        metavar="N",
        help=f"MoE layers ahead whose experts decode guesses and prefetches (default {DEFAULTS.prefetch_layers}: the "
        "next layer's guess is the best, a later one's read has longer to land)",
    )
    group.add_argument(
        "--preload",
        action=argparse.BooleanOptionalAction,
        help="when --ram holds every expert, read them all at load rather than as prompts need them "
        f"(default {_on(DEFAULTS.preload)})",
    )
    io = group.add_mutually_exclusive_group()
    io.add_argument(
        "--direct",
        action="store_true",
        help=f"read experts with O_DIRECT where the filesystem allows{_if_default(DEFAULTS.direct)}",
    )
    io.add_argument(
        "--buffered",
        action="store_true",
        help=f"read experts through the page cache{_if_default(not DEFAULTS.direct)}",
    )
    group.add_argument(
        "--io-threads",
        type=io_threads,
        help=f"disk reader threads (per device of a spread container), 1..{MAX_IO_THREADS} "
        f"(default {DEFAULTS.threads})",
    )
    group.add_argument("--history", help="usage-history file (learned hot store), updated after every turn")
    group.add_argument("--trace", help="write the routing trace (one JSON line per MoE acquire) to this file")


def add_context_argument(parser: argparse.ArgumentParser) -> None:
    """--context N: the positions a run is sized and checked for (plan, run, chat, serve)."""
    parser.add_argument(
        "--context",
        type=positive_int,
        metavar="N",
        help="tokens of context (prompt + answer) the KV cache and activations are sized for; a longer prompt "
        "is refused, answers are cut to fit (default: the budget file's [kv] context, else the model's "
        "max_position_embeddings, which is also the most N may be)",
    )


def store_options(args: argparse.Namespace, context: int | None = None) -> StoreOptions:
    """The store flags; ``context`` is --context of the commands that take it (add_context_argument)."""
    return StoreOptions(
        budget=args.budget,
        ram=args.ram,
        vram=args.vram,
        vram_device=args.vram_device,
        policy=args.policy,
        prefetch=args.prefetch,
        direct=True if args.direct else False if args.buffered else None,
        io_threads=args.io_threads,
        prefetch_layers=args.prefetch_layers,
        preload=args.preload,
        history=args.history,
        trace=args.trace,
        context=context,
    )


def add_dtype_argument(parser: argparse.ArgumentParser, default: str = "float32") -> None:
    parser.add_argument("--dtype", choices=sorted(COMPUTE_DTYPES), default=default, help="compute dtype")


def add_session_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    sessions = parser.add_argument_group("sessions (compressed KV on disk)")
    sessions.add_argument("--kv-dir", help="where session files live (default: ~/.cache/colibri-stream/kv/<model>)")
    sessions.add_argument(
        "--kv-dtype",
        choices=RECORD_DTYPES,
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
    sessions.add_argument(
        "--wait-session",
        nargs="?",
        type=positive_seconds,
        const=math.inf,
        metavar="SECONDS",
        help="when another process holds the session, wait for it to end (for ever, or at most "
        "--wait-session=SECONDS) instead of refusing with the holder's pid",
    )
    return sessions


def session_wait(args: argparse.Namespace, command: str) -> SessionWait:
    """--wait-session as a SessionWait that prints once, on stderr, whom it waits for."""
    seconds = args.wait_session
    if seconds is None:
        return SessionWait()
    return SessionWait(
        None if math.isinf(seconds) else seconds,
        lambda line: print(f"colibri-stream {command}: {line}", file=sys.stderr, flush=True),
    )


def add_activations_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--activations",
        choices=("float32", "int8"),
        default="float32",
        help="float32 (default): token-exact against the reference; int8: the 4-bit experts and int8/int4 dense "
        "records multiply int8-quantised activations with integer dot products, as llama.cpp does (faster, "
        "lossy: +0.2%% held-out perplexity on the demo model, docs/quantization.md; the dense records then stay "
        "codes in memory)",
    )


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the commands that hold a model and its sessions (run, chat, serve): PATH, dtype,
    sessions, expert streaming."""
    parser.add_argument("path", help="a converted container, or a Hugging Face checkpoint directory")
    add_dtype_argument(parser)
    add_activations_argument(parser)
    add_context_argument(parser)
    add_mtp_arguments(parser)
    add_session_arguments(parser)
    add_prefix_arguments(parser)
    add_store_arguments(parser)
    add_cluster_arguments(parser)


def add_mtp_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-token prediction (DeepSeek-V3/R1, GLM-5, DeepSeek-V4 MTP modules)")
    group.add_argument(
        "--mtp",
        choices=MODES,
        default=MTPOptions.mode,
        help="draft tokens with the model's MTP module and verify them in one pass: auto (default) drafts only "
        "when the measured acceptance, hit rate, disk wait and row cost say it is faster; on: always; off: never. "
        "The tokens are those of plain decoding either way (greedy identical, sampling the same distribution)",
    )
    group.add_argument(
        "--mtp-depth",
        type=positive_int,
        default=MTPOptions.max_depth,
        metavar="K",
        help=f"most tokens drafted per step (default {MTPOptions.max_depth}; the module is re-applied past the first)",
    )


def prefix_size_flag(text: str) -> str:
    """--prefix-ram/--prefix-disk checked for form when the flags are read."""
    try:
        prefix_size(text, "size")
    except BudgetError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("size: ")) from None
    return text


def add_prefix_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "prefix cache (the KV of earlier prompts, shared by every request and session, kept across restarts)"
    )
    group.add_argument(
        "--prefix-ram",
        type=prefix_size_flag,
        metavar="SIZE",
        help=f"RAM for recently used prefix blocks; 0: none (default {_binary_size(DEFAULTS.prefix_ram)})",
    )
    group.add_argument(
        "--prefix-disk",
        type=prefix_size_flag,
        metavar="SIZE",
        help=f"prefix blocks kept in the KV directory, least recently used dropped first; 0: none "
        f"(default {_binary_size(DEFAULTS.prefix_disk)})",
    )
    group.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        help="restore the longest cached prefix of each prompt and remember what each turn computes "
        f"(default {_on(DEFAULTS.prefix_enabled)}; --no-prefix-cache computes every prompt whole)",
    )


def runtime_options(args: argparse.Namespace, text: bool = True, model_id: str | None = None) -> RuntimeOptions:
    return RuntimeOptions(
        dtype=args.dtype,
        activations=args.activations,
        store=store_options(args, args.context),
        kv_dir=args.kv_dir,
        kv_dtype=args.kv_dtype,
        model_id=model_id,
        text=text,
        cluster=cluster_options(args),
        prefix=prefix_config(args.budget, args.prefix_ram, args.prefix_disk, args.prefix_cache),
        mtp=MTPOptions(args.mtp, args.mtp_depth),
    )


def positive_seconds(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The coordinator's flags: routed experts held by `colibri-stream worker` processes."""
    group = parser.add_argument_group(
        "workers (experts sharded over processes or machines; the store flags above are then the workers' "
        "budget together, split evenly between local workers)"
    )
    group.add_argument(
        "--local-workers",
        type=int,
        default=0,
        metavar="N",
        help=f"start N workers on 127.0.0.1 (at most {MAX_LOCAL_WORKERS})",
    )
    group.add_argument("--world-size", type=int, help="coordinator + workers started by hand (`colibri-stream worker`)")
    group.add_argument("--master-addr", default=LOCALHOST, help=f"address the workers connect to (default {LOCALHOST})")
    group.add_argument(
        "--master-port", type=int, help="port the workers connect to (default with --local-workers: a free one)"
    )
    group.add_argument(
        "--worker-timeout",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help="a worker silent for S seconds on a request is lost: its experts are served by the coordinator "
        f"(or a replica) until it is started again and rejoins (default {DEFAULT_TIMEOUT_S:g})",
    )
    group.add_argument(
        "--expert-map",
        help='JSON {"1": [expert ids], "2": [...]}: which worker holds which experts in every MoE layer '
        "(default: by the workers' RAM budgets and measured disk speeds)",
    )
    group.add_argument(
        "--replicas",
        type=int,
        default=0,
        metavar="N",
        help="hold the N hottest experts of each layer (by the --history usage history) on two workers: a lost "
        "worker costs no disk reads for them, and each request goes to the less-loaded holder (default 0)",
    )


def cluster_options(args: argparse.Namespace) -> ClusterOptions:
    check_local_workers(args.local_workers)  # before the model loads
    return ClusterOptions(
        world_size=args.world_size,
        master_addr=args.master_addr,
        master_port=args.master_port,
        local_workers=args.local_workers,
        timeout_s=args.worker_timeout,
        expert_map=args.expert_map,
        replicas=args.replicas,
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, max_new_tokens: int, what: str) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=f"{what} (default {max_new_tokens})")
    parser.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1.0)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible samples")


def sampling(args: argparse.Namespace) -> SamplingParams:
    if args.max_new_tokens < 1:
        raise RequestError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return SamplingParams(args.temperature, args.top_p, args.seed)
