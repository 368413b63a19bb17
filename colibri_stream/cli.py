"""The ``colibri-stream`` command line: one sub-command per user job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from colibri_stream import (
    __version__,
    cli_bench,
    cli_chat,
    cli_container,
    cli_demo,
    cli_doctor,
    cli_kv,
    cli_run,
    cli_serve,
    plan,
)
from colibri_stream.bench_system import ContenderFailed
from colibri_stream.budget import BudgetFileError
from colibri_stream.checkpoint import CheckpointError
from colibri_stream.memory import return_large_frees_to_the_os
from colibri_stream.text import TokenizerMissingError
from engine.args import ConfigError
from engine.weights import WeightNameError
from storage.errors import StorageError

DESCRIPTION = """\
Run huge Mixture-of-Experts language models (DeepSeek-V3/R1, Kimi-K2, DeepSeek-V3.2, GLM-5) on a
machine that cannot hold them: the dense part stays resident, routed experts stream from disk as
int4 into a RAM cache and a VRAM budget, and each conversation's compressed KV state lives in a
file so a chat resumes after a restart without re-prefill."""

# Errors about the user's input: printed as one line, exit status 1, no traceback.
USER_ERRORS = (
    CheckpointError,
    ConfigError,
    WeightNameError,
    TokenizerMissingError,
    StorageError,
    BudgetFileError,
    ContenderFailed,
    ValueError,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri-stream",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    cli_run.add_parser(commands)
    cli_demo.add_parser(commands)
    cli_container.add_parsers(commands)
    plan.add_parser(commands, cli_run.add_store_arguments)
    cli_kv.add_parser(commands)
    cli_bench.add_parser(commands)
    cli_serve.add_parser(commands)
    cli_chat.add_parser(commands)
    cli_doctor.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return_large_frees_to_the_os()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.handler(args)
    except USER_ERRORS as exc:
        print(f"colibri-stream {args.command}: error: {exc}", file=sys.stderr)
        return 1
