"""`colibri-stream plan`: what lands where, computed from metadata before anything loads."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from colibri_stream.cli.help import help_options
from colibri_stream.cli.options import add_dtype_argument, add_store_arguments, store_options
from colibri_stream.config import store_config
from colibri_stream.placement import check_fits, describe, plan
from storage.container import Container

PLAN_EPILOG = """\
examples:
  colibri-stream plan MODEL.cstream --ram 25%
  colibri-stream plan MODEL.cstream --budget budgets/workstation-128g-24gvram.toml --dtype bfloat16 --json
exit status: 0 when the budget fits, 1 when it is below one token's experts or beyond this machine
(the placement is printed first, then the reason), 2 on bad flags."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="show where dense weights, experts and KV will live, before loading",
        description="Compute the placement (dense, KV at max context, expert slots per tier, disk bytes per token "
        "at 0% hits, expected peak RSS) from a container's metadata and a budget, without loading anything.",
        **help_options(PLAN_EPILOG),
    )
    parser.add_argument("path", help="container directory")
    add_dtype_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the placement as one JSON object")
    add_store_arguments(parser)
    parser.set_defaults(handler=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    container = Container(args.path)
    placement = plan(container, store_config(store_options(args), container, args.dtype), args.dtype)
    print(json.dumps(asdict(placement)) if args.json else describe(placement))
    check_fits(placement)
    return 0
