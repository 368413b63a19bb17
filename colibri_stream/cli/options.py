"""Flags shared by the commands, and their translation into the library's dataclasses: library code
never sees an argparse Namespace."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from colibri_stream.checkpoint.dtypes import COMPUTE_DTYPES
from colibri_stream.errors import BudgetError, RequestError
from colibri_stream.experts.cluster.auth import KEY_ENV, KEY_FILE_HINT
from colibri_stream.experts.cluster.group import DEFAULT_TIMEOUT_S, ClusterOptions
from colibri_stream.experts.cluster.local import LOCALHOST, MAX_LOCAL_WORKERS, check_local_workers
from colibri_stream.planning.budget import StoreOptions, prefix_config
from colibri_stream.planning.geometry import (
    DEFAULT_DENSE,
    DEFAULT_EXPERTS,
    DEFAULT_GROUP_SIZE,
    DENSE_SCHEMES,
    EXPERT_SCHEMES,
    REQUANTISED_EXPERTS,
    ContainerTarget,
)
from colibri_stream.planning.settings import SETTINGS, TABLES, Budget, Kind, Setting, Value
from colibri_stream.runtime.generate import SamplingParams
from colibri_stream.runtime.kv.lock import SessionWait
from colibri_stream.runtime.loader import ACTIVATIONS
from colibri_stream.runtime.mtp_governor import MODES, MTPOptions
from colibri_stream.runtime.turn import RuntimeOptions
from storage.kv.log import RECORD_DTYPES


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


DEFAULTS = Budget()  # whose values the flags' help shows as defaults: the settings table's


def _flag_type(setting: Setting) -> Callable[[str], object]:
    """The argparse type of a setting's flag: its form checked as the flags are read (a percentage needs
    the model, so a size is computed at load), its range as a budget file's is."""

    def read(text: str) -> object:
        if setting.kind is Kind.COUNT:
            value = positive_int(text) if setting.low == 1 else int(text)
            if setting.high is not None and value > setting.high:
                raise argparse.ArgumentTypeError(f"expected at most {setting.high} {setting.unit}, got {text!r}")
            return value
        try:
            setting.check(text, setting.flag)
        except BudgetError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{setting.flag}: ")) from None
        return text

    read.__name__ = setting.flag  # argparse names the type in its errors: "invalid --ram value"
    return read


def _help(setting: Setting, default: Value) -> str:
    """The row's help and the default ``DEFAULTS`` gives it, %-escaped for argparse."""
    if setting.kind is Kind.COUNT and setting.high is not None:
        text = f"{setting.help}, {setting.low}..{setting.high}"
    else:
        text = setting.help
    if setting.shown:
        text += f" (default: {setting.shown})"
    elif default is not None:
        text += f" (default {setting.show(default)})"
    return text.replace("%", "%%")


def add_setting_arguments(
    group: argparse.ArgumentParser | argparse._ArgumentGroup, which: str, ram_default: str | int | None = None
) -> None:
    """The flags of the settings table's rows in group ``which`` (planning/settings.py): every flag defaults to
    None, "the budget file's, else the table's"; the help shows ``DEFAULTS``, never a literal. ``ram_default``:
    what a command that sizes RAM its own way without --ram or --budget says (plan, demo)."""
    for setting in SETTINGS:
        if setting.group != which:
            continue
        default = ram_default if setting.name == "ram" and ram_default is not None else DEFAULTS[setting.name]
        if setting.kind is Kind.SWITCH and setting.off_flag:  # --direct / --buffered: either, or the budget's
            pair = group.add_mutually_exclusive_group()
            pair.add_argument(
                setting.flag, dest=setting.name, action="store_const", const=True,
                help=f"{setting.help}{' (the default)' if default else ''}",
            )  # fmt: skip
            pair.add_argument(
                setting.off_flag, dest=setting.name, action="store_const", const=False,
                help=f"{setting.off_help}{'' if default else ' (the default)'}",
            )  # fmt: skip
        elif setting.kind is Kind.SWITCH:
            group.add_argument(
                setting.flag, dest=setting.name, action=argparse.BooleanOptionalAction,
                help=_help(setting, default),
            )  # fmt: skip
        else:
            group.add_argument(
                setting.flag, dest=setting.name, metavar=setting.metavar, help=_help(setting, default),
                choices=setting.choices or None, type=str if setting.choices else _flag_type(setting),
            )  # fmt: skip


def add_store_arguments(parser: argparse.ArgumentParser, ram_default: str | int | None = None) -> None:
    """Flags sizing and tuning the tiered expert store (containers only); they override --budget."""
    group = parser.add_argument_group("expert streaming (containers)")
    tables = ", ".join(f"[{table}]" for table in TABLES)
    group.add_argument("--budget", help=f"TOML budget file ({tables}; an unknown key is an error)")
    add_setting_arguments(group, "store", ram_default)
    group.add_argument("--trace", help="write the routing trace (one JSON line per MoE acquire) to this file")


def add_context_argument(parser: argparse.ArgumentParser) -> None:
    """--context N: the positions a run is sized and checked for (plan, run, chat, serve)."""
    add_setting_arguments(parser, "context")


def store_options(args: argparse.Namespace) -> StoreOptions:
    """The settings the command's flags give (those it has; None: not given) and its budget file, read
    here, once, for the whole command."""
    flags = vars(args)  # a command has some groups of settings: a flag it lacks was not given
    given = {s.name: flags.get(s.name) for s in SETTINGS}
    return StoreOptions(budget=args.budget, given=given, trace=args.trace)


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
        choices=ACTIVATIONS,
        default="float32",
        help="float32 (default): token-exact against the reference; int8: the 4-bit experts and int8/int4 dense "
        "records multiply int8-quantised activations with integer dot products, as llama.cpp does (faster, "
        "lossy: +0.2%% held-out perplexity on the demo model, docs/quantization.md; the dense records then stay "
        "codes in memory); int8-tiles: int8, with a prompt's rows computed as tile GEMMs (AVX-512 VNNI CPUs; "
        "faster prompts; a prompt's values then differ from decoded ones in their last bits, docs/kernels.md)",
    )


def add_runtime_arguments(parser: argparse.ArgumentParser, path_help: str = "") -> None:
    """Flags of the commands that hold a model and its sessions (run, chat, serve): PATH, dtype,
    sessions, expert streaming. ``path_help``: PATH may be left out, and what that means (serve: the demo)."""
    path = "a converted container, or a Hugging Face checkpoint directory"
    if path_help:
        parser.add_argument("path", nargs="?", help=f"{path}; {path_help}")
    else:
        parser.add_argument("path", help=path)
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


def add_prefix_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "prefix cache (the KV of earlier prompts, shared by every request and session, kept across restarts)"
    )
    add_setting_arguments(group, "prefix")


def runtime_options(args: argparse.Namespace, text: bool = True, model_id: str | None = None) -> RuntimeOptions:
    store = store_options(args)
    return RuntimeOptions(
        dtype=args.dtype,
        activations=args.activations,
        store=store,
        kv_dir=args.kv_dir,
        kv_dtype=args.kv_dtype,
        model_id=model_id,
        text=text,
        cluster=cluster_options(args),
        prefix=prefix_config(store),
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
        "--cluster-key-file",
        metavar="FILE",
        help="the cluster key every worker must prove (and this coordinator proves to them); default: "
        f"${KEY_ENV}, else {KEY_FILE_HINT}, created (mode 0600) when missing: copy it to each worker's machine",
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
        key_file=args.cluster_key_file,
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
