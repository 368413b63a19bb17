"""`colibri-stream container spread|gather|mirror|parts`: one container over several disks.

The work is storage's (storage/container/reader/: spread.py, mirror.py, parts.py); this module turns flags
into a layout, measures the devices' weights when none are given (storage/container/probe.py), and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from colibri_stream.checkpoint.fingerprint import container_fingerprint
from colibri_stream.cli.help import help_options
from storage.container.mirror import MARGIN, MirrorPlan, copy_problems, mirror_layout, plan_mirror
from storage.container.parts import HOME, PartError, Parts
from storage.container.probe import probe_directory
from storage.container.reader import Container
from storage.container.spread import Layout, apply_layout, current_parts, describe, gather_layout, spread_layout
from storage.errors import StorageError
from storage.tiers.history import UsageHistory

EPILOG = """\
examples:
  colibri-stream container spread dsv3.cstream --to /mnt/ssd2/dsv3              # weights measured
  colibri-stream container spread dsv3.cstream --to /mnt/ssd2/dsv3 --share 40%  # 40% of records move
  colibri-stream container spread dsv3.cstream --to /mnt/a:3 --to /mnt/b:1      # weights given
  colibri-stream container mirror plan dsv3.cstream --history hist.json --to /mnt/ssd2/hot
  colibri-stream container mirror stage dsv3.cstream --history hist.json --to /mnt/ssd2/hot
  colibri-stream container mirror verify dsv3.cstream
  colibri-stream container gather dsv3.cstream                                  # all back home
  colibri-stream container parts dsv3.cstream
Interrupted? Run the same command again: it resumes (copy, verify, switch the manifest, then delete).
exit status: 0 on success, 1 on a user error or a failed check (one line each), 2 on bad flags."""


class SpreadFlagError(StorageError):
    """A --to, --share or weight flag that cannot be used."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    container = commands.add_parser(
        "container",
        help="spread a container over several disks, mirror its hot experts, or gather it back",
        description=(
            "Spread a container's expert records over several directories (one per device), weighted by each "
            "device's measured random-read speed; copy the hottest experts (usage history) onto a second "
            "device; or gather everything back. Tokens never change: only where the bytes are read from."
        ),
        **help_options(EPILOG),
    )
    verbs = container.add_subparsers(dest="verb", metavar="VERB", required=True)
    spread = verbs.add_parser("spread", help="move records to other directories, by weight")
    _model(spread)
    spread.add_argument("--to", action="append", required=True, metavar="DIR[:WEIGHT]", help="a part directory")
    spread.add_argument("--share", help="share of all records the --to directories take, e.g. 40%%")
    _common(spread)
    spread.set_defaults(handler=run_spread)
    gather = verbs.add_parser("gather", help="move every record back into the container directory")
    _model(gather)
    _common(gather)
    gather.set_defaults(handler=run_gather)
    parts = verbs.add_parser("parts", help="where the records are")
    _model(parts)
    parts.add_argument("--json", action="store_true")
    parts.set_defaults(handler=run_parts)
    mirror = verbs.add_parser("mirror", help="copies of the hottest experts on a second device")
    mirror.add_argument("action", choices=("plan", "stage", "verify"))
    _model(mirror)
    mirror.add_argument("--history", help="usage-history file (plan, stage)")
    mirror.add_argument("--to", metavar="DIR[:WEIGHT]", help="directory for the copies (default: existing parts)")
    mirror.add_argument("--max-bytes", help="copy at most this much, e.g. 20GiB")
    mirror.add_argument(
        "--margin",
        type=float,
        default=MARGIN,
        help=f"copy until no device's single-copy records take over (1 - margin) of its even share (default {MARGIN})",
    )
    _common(mirror)
    mirror.set_defaults(handler=run_mirror)


def _model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="container directory")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--probe-seconds", type=float, default=1.0, help="random-read probe per device (default 1)")
    parser.add_argument("--home-weight", help="weight of the container's own directory (default: measured)")


# ------------------------------------------------------------------------------------- flags
def parse_target(text: str) -> tuple[Path, float | None]:
    """DIR or DIR:WEIGHT (a number, or bytes/s like 3GB)."""
    directory, sep, weight = text.rpartition(":")
    if not sep or not directory:
        return Path(text), None
    return Path(directory), parse_weight(weight, f"--to {text}")


def parse_weight(text: str, flag: str) -> float:
    units = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    body = text.strip().upper().removesuffix("B").removesuffix("/S")
    unit = body[-1:] if body[-1:] in units else ""
    try:
        value = float(body[: len(body) - len(unit)]) * units[unit]
    except ValueError:
        raise SpreadFlagError(f"{flag}: weight {text!r} is not a number or a speed like 3GB") from None
    if value <= 0:
        raise SpreadFlagError(f"{flag}: weight must be > 0")
    return value


def parse_share(text: str) -> float:
    value = text.strip().removesuffix("%")
    try:
        share = float(value) / (100 if text.strip().endswith("%") else 1)
    except ValueError:
        raise SpreadFlagError(f"--share {text!r}: expected a percentage like 40%") from None
    if not 0 < share < 1:
        raise SpreadFlagError(f"--share {text!r}: must be between 0% and 100%")
    return share


def measured(directory: Path, container: Container, args: argparse.Namespace) -> float:
    try:
        speed = probe_directory(directory, container.layout.record_bytes, args.probe_seconds)
    except OSError as exc:
        raise PartError(f"{directory}: cannot probe its read speed ({exc.strerror or exc})") from None
    print(f"{directory}: {speed.bytes_per_s / 1e6:.0f} MB/s random {speed.method} reads", file=sys.stderr)
    return speed.bytes_per_s


def _home_weight(container: Container, args: argparse.Namespace) -> float:
    if args.home_weight:
        return parse_weight(args.home_weight, "--home-weight")
    return measured(container.path, container, args)


# ------------------------------------------------------------------------------------ commands
def run_spread(args: argparse.Namespace) -> int:
    container = Container(args.model)
    layout = _spread_layout(container, [t for flag in args.to for t in flag.split(",") if t], args)
    return _apply(container, layout, args)


def _spread_layout(container: Container, texts: list[str], args: argparse.Namespace) -> Layout:
    targets = [(d, w if w is not None else measured(d, container, args)) for d, w in map(parse_target, texts)]
    if args.share:
        share = parse_share(args.share)
        home = (1 - share) / share * sum(w for _, w in targets)
    else:
        home = _home_weight(container, args)
    return spread_layout(container, targets, home)


def spread_container(path: str, texts: list[str]) -> dict[str, int]:
    """`convert --spread`: the conversion's container spread as `container spread --to` would."""
    container = Container(path)
    args = argparse.Namespace(share=None, home_weight=None, probe_seconds=1.0)
    return apply_layout(container, _spread_layout(container, [t for t in texts if t], args), progress=_Dots())


def run_gather(args: argparse.Namespace) -> int:
    container = Container(args.model)
    return _apply(container, gather_layout(container), args)


def _apply(container: Container, layout: Layout, args: argparse.Namespace) -> int:
    dots = _Dots()
    result = apply_layout(container, layout, progress=dots)
    dots.end()
    parts = current_parts(Container(container.path))
    if args.json:
        print(json.dumps({**result, "parts_detail": _parts_json(parts, container.layout.record_bytes)}))
    else:
        print(describe(parts, container.layout.record_bytes))
    return 0


class _Dots:
    """A dot on stderr every 64 records copied: long spreads show they move."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, records: int) -> None:
        self.n += records
        if self.n % 64 == 0:
            print(".", end="", file=sys.stderr, flush=True)

    def end(self) -> None:
        if self.n >= 64:
            print(file=sys.stderr)


def run_parts(args: argparse.Namespace) -> int:
    container = Container(args.model)
    parts = current_parts(container)
    if args.json:
        print(json.dumps(_parts_json(parts, container.layout.record_bytes)))
    else:
        print(describe(parts, container.layout.record_bytes))
    return 0


def _parts_json(parts: Parts, record_bytes: int) -> list[dict[str, Any]]:
    primaries = parts.primary_counts()
    held = [sum(p in where for _, where in parts.records()) for p in range(len(parts.dirs))]
    return [
        {
            "dir": str(d),
            "weight": parts.weights[p],
            "primary_records": primaries[p],
            "records": held[p],
            "bytes": held[p] * record_bytes,
        }
        for p, d in enumerate(parts.dirs)
    ]


def run_mirror(args: argparse.Namespace) -> int:
    container = Container(args.model)
    if args.action == "verify":
        problems = list(copy_problems(container))
        for problem in problems:
            print(problem, file=sys.stderr)
        mirrored = current_parts(container).mirrored
        print(f"{args.model}: {mirrored} mirrored records, {'ok' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    if not args.history:
        raise SpreadFlagError(f"mirror {args.action} needs --history (the usage counts that say what is hot)")
    history = UsageHistory.load(args.history, container.n_experts, container_fingerprint(container))
    parts = _mirror_parts(container, args)
    max_bytes = int(parse_weight(args.max_bytes, "--max-bytes")) if args.max_bytes else None
    if not 0 <= args.margin < 1:
        raise SpreadFlagError(f"--margin {args.margin}: must be in [0, 1)")
    plan = plan_mirror(container, history.counts, parts.weights, max_bytes, parts, args.margin)
    _print_plan(plan, parts, args.json)
    if args.action == "stage":
        result = apply_layout(container, mirror_layout(parts, plan), progress=_Dots())
        print(json.dumps(result) if args.json else f"staged: {result['records_copied']} copies written")
    return 0


def _mirror_parts(container: Container, args: argparse.Namespace) -> Parts:
    """The container's parts, plus the --to directory (measured unless weighted) if it is new; weights of
    existing parts are the manifest's (measured when spread); a whole container's own is measured."""
    parts = current_parts(container)
    dirs, weights = list(parts.dirs), list(parts.weights)
    if args.home_weight or len(dirs) == 1:
        weights[HOME] = _home_weight(container, args)
    if args.to:
        directory, weight = parse_target(args.to)
        directory = directory.absolute()
        if directory not in dirs:
            dirs.append(directory)
            weights.append(weight if weight is not None else measured(directory, container, args))
        elif weight is not None:
            weights[dirs.index(directory)] = weight
    if len(dirs) < 2:
        raise SpreadFlagError("a mirror needs a second device: spread the container first or give --to DIR")
    return Parts(parts.home, tuple(dirs), tuple(weights), parts.copies)


def _print_plan(plan: MirrorPlan, parts: Parts, as_json: bool) -> None:
    before, after = plan.seconds_per_token(plan.load_before), plan.seconds_per_token(plan.load_after)
    by_part: dict[int, int] = {}
    for _, part in plan.copies:
        by_part[part] = by_part.get(part, 0) + 1
    summary = {
        "copies": len(plan.copies),
        "bytes": plan.bytes,
        "to": {str(parts.dirs[p]): n for p, n in by_part.items()},
        "history_tokens": round(plan.tokens, 1),
        "disk_s_per_token_before": before,
        "disk_s_per_token_after": after,
        "expected_gain": round(plan.gain, 3),
        "bytes_per_token_before": dict(zip(map(str, parts.dirs), plan.bytes_per_token(plan.load_before), strict=True)),
        "bytes_per_token_after": dict(zip(map(str, parts.dirs), plan.bytes_per_token(plan.load_after), strict=True)),
    }
    if as_json:
        print(json.dumps(summary))
        return
    print(f"copy {len(plan.copies)} hottest records ({plan.bytes / 2**30:.2f} GiB) to {summary['to']}")
    for p, directory in enumerate(parts.dirs):
        b, a = plan.load_before[p] * plan.record_bytes, plan.load_after[p] * plan.record_bytes
        print(f"  {directory}: {b / 1e6:.1f} -> {a / 1e6:.1f} MB per token at 0% hits, weight {parts.weights[p]:.3g}")
    print(f"expected disk time per token {before * 1e3:.2f} -> {after * 1e3:.2f} ms ({plan.gain:.2f}x)")
