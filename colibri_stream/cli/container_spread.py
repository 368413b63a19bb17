"""`colibri-stream container spread|gather|mirror|parts`: one container over several disks.

The work is storage's (storage/container/reader/: spread.py, mirror.py, parts.py); this module turns flags
into a layout, measures the devices' weights when none are given (storage/container/probe.py), and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibri_stream.checkpoint.fingerprint import container_fingerprint
from colibri_stream.cli.help import help_options
from storage.container.mirror import MARGIN, MirrorPlan, copy_problems, mirror_layout, plan_mirror
from storage.container.parts import HOME, PartError, Parts
from storage.container.probe import probe_directory
from storage.container.reader import Container
from storage.container.spread import (
    Layout,
    apply_layout,
    current_parts,
    describe,
    gather_layout,
    layout_lock,
    spread_layout,
)
from storage.errors import StorageError
from storage.tiers.history import UsageHistory

EPILOG = """\
examples:
  colibri-stream container spread dsv3.cstream --to /mnt/ssd2/dsv3              # weights measured
  colibri-stream container spread dsv3.cstream --to /mnt/ssd2/dsv3 --share 40%  # 40% of records move
  colibri-stream container spread dsv3.cstream --to /mnt/ssd2/dsv3:1            # half the records move
  colibri-stream container spread dsv3.cstream --to /mnt/a:3 --to /mnt/b:1      # home:a:b = 1:3:1
  colibri-stream container spread dsv3.cstream --to /mnt/a:2GB --home-weight 1GB # speeds given
  colibri-stream container mirror plan dsv3.cstream --history hist.json --to /mnt/ssd2/hot
  colibri-stream container mirror stage dsv3.cstream --history hist.json --to /mnt/ssd2/hot
  colibri-stream container mirror verify dsv3.cstream
  colibri-stream container gather dsv3.cstream                                  # all back home
  colibri-stream container parts dsv3.cstream
Weights: a speed with a unit (2GB = 2 GB/s of random reads) or a plain number N, meaning N times the
container directory's own weight (DIR:1 gets as many records as the container directory keeps). A weight
left out is measured (a speed). So every weight is in one unit; a plain --home-weight (a ratio) with a
--to weight that is a speed or measured is refused. A --to directory whose weight gets it no record is an
error. One spread, gather or mirror stage at a time per container (spread.lock in its directory).
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
    spread.add_argument(
        "--to",
        action="append",
        required=True,
        metavar="DIR[:WEIGHT]",
        help="a part directory; WEIGHT: a speed (2GB) or N times the container directory's weight (default: measured)",
    )
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
    parser.add_argument(
        "--home-weight", help="the container directory's weight: a speed (2GB) or a plain ratio (default: measured)"
    )


# ------------------------------------------------------------------------------------- flags
@dataclass(frozen=True)
class Weight:
    """A part directory's weight: ``speed`` (bytes/s: a unit given, or measured), else a plain number (a
    --to directory's: a multiple of the container directory's weight; --home-weight's: a ratio)."""

    value: float
    speed: bool


def parse_target(text: str) -> tuple[Path, Weight | None]:
    """DIR or DIR:WEIGHT (a number, or bytes/s like 3GB)."""
    directory, sep, weight = text.rpartition(":")
    if not sep or not directory:
        return Path(text), None
    return Path(directory), parse_weight(weight, f"--to {text}")


_UNITS = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def parse_weight(text: str, flag: str) -> Weight:
    """A speed when a unit is written (3G, 3GB, 800MB/s, 1000B), else a plain number."""
    value, body = parse_amount(text, flag), text.strip().upper().removesuffix("/S")
    return Weight(value, speed=body.endswith("B") or body[-1] in "KMGT")


def parse_amount(text: str, flag: str) -> float:
    """A number, or bytes (per second) like 3GB or 800MB/s."""
    body = text.strip().upper().removesuffix("/S").removesuffix("B")
    unit = body[-1:] if body[-1:] in _UNITS else ""
    try:
        value = float(body[: len(body) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise SpreadFlagError(f"{flag}: weight {text!r} is not a number or a speed like 3GB") from None
    if not value > 0 or value == float("inf"):
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


def resolve_weight(
    directory: Path, weight: Weight | None, home: Weight, container: Container, args: argparse.Namespace
) -> float:
    """A --to directory's weight in the container directory's unit: a plain number times ``home``; a
    speed (given or measured) as it is, when ``home`` is a speed too."""
    if weight is not None and not weight.speed:
        return weight.value * home.value
    if not home.speed:
        what = "is a speed" if weight is not None else "would be measured (a speed)"
        raise SpreadFlagError(
            f"{directory}: its weight {what} while --home-weight {home.value:g} is a plain ratio: give every "
            "weight as a speed (2GB) or every --to weight as a plain number"
        )
    return weight.value if weight is not None else measured(directory, container, args)


def measured(directory: Path, container: Container, args: argparse.Namespace) -> float:
    try:
        speed = probe_directory(directory, container.layout.record_bytes, args.probe_seconds)
    except OSError as exc:
        raise PartError(f"{directory}: cannot probe its read speed ({exc.strerror or exc})") from None
    print(f"{directory}: {speed.bytes_per_s / 1e6:.0f} MB/s random {speed.method} reads", file=sys.stderr)
    return speed.bytes_per_s


def _home_weight(container: Container, args: argparse.Namespace) -> Weight:
    if args.home_weight:
        return parse_weight(args.home_weight, "--home-weight")
    return Weight(measured(container.path, container, args), speed=True)


# ------------------------------------------------------------------------------------ commands
def run_spread(args: argparse.Namespace) -> int:
    container = Container(args.model)
    with layout_lock(container.path):  # before measuring: a second spread is refused at once
        layout = _spread_layout(container, [t for flag in args.to for t in flag.split(",") if t], args)
        return _apply(container, layout, args)


def _spread_layout(container: Container, texts: list[str], args: argparse.Namespace) -> Layout:
    targets = [parse_target(text) for text in texts]
    if args.share:
        return _shared_layout(container, targets, parse_share(args.share), args)
    home = _home_weight(container, args)
    weights = [(d, resolve_weight(d, w, home, container, args)) for d, w in targets]
    return spread_layout(container, weights, home.value)


def _shared_layout(
    container: Container, targets: list[tuple[Path, Weight | None]], share: float, args: argparse.Namespace
) -> Layout:
    """--share: the --to directories take that share of the records, split among them by their weights,
    which must then be of one kind (all plain numbers, or all speeds given or measured)."""
    if len({w is not None and not w.speed for _, w in targets}) > 1:
        raise SpreadFlagError("--share: give every --to directory a plain weight, or none a plain one")
    values = [w.value if w is not None else measured(d, container, args) for d, w in targets]
    home = (1 - share) / share * sum(values)
    return spread_layout(container, list(zip([d for d, _ in targets], values, strict=True)), home)


def spread_container(path: str, texts: list[str]) -> dict[str, int]:
    """`convert --spread`: the conversion's container spread as `container spread --to` would."""
    container = Container(path)
    args = argparse.Namespace(share=None, home_weight=None, probe_seconds=1.0)
    with layout_lock(container.path):
        layout = _spread_layout(container, [t for t in texts if t], args)
        return apply_layout(container, layout, progress=_Dots())


def run_gather(args: argparse.Namespace) -> int:
    container = Container(args.model)
    with layout_lock(container.path):
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
    with layout_lock(container.path) if args.action == "stage" else nullcontext():
        parts = _mirror_parts(container, args)
        max_bytes = int(parse_amount(args.max_bytes, "--max-bytes")) if args.max_bytes else None
        if not 0 <= args.margin < 1:
            raise SpreadFlagError(f"--margin {args.margin}: must be in [0, 1)")
        plan = plan_mirror(container, history.counts, parts.weights, max_bytes, parts, args.margin)
        _print_plan(plan, parts, args.json)
        if args.action == "stage":
            result = apply_layout(container, mirror_layout(parts, plan), progress=_Dots())
            print(json.dumps(result) if args.json else f"staged: {result['records_copied']} copies written")
    return 0


def _mirror_parts(container: Container, args: argparse.Namespace) -> Parts:
    """The container's parts, plus the --to directory if it is new; weights of existing parts are the
    manifest's (measured when spread); a whole container's own is measured, and a plain --to weight is a
    multiple of the container directory's, as for spread."""
    parts = current_parts(container)
    dirs, weights = list(parts.dirs), list(parts.weights)
    home = Weight(weights[HOME], speed=True)
    if args.home_weight or len(dirs) == 1:
        home = _home_weight(container, args)
        weights[HOME] = home.value
    if args.to:
        directory, weight = parse_target(args.to)
        directory = directory.absolute()
        if directory not in dirs:
            dirs.append(directory)
            weights.append(resolve_weight(directory, weight, home, container, args))
        elif weight is not None:
            weights[dirs.index(directory)] = resolve_weight(directory, weight, home, container, args)
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
