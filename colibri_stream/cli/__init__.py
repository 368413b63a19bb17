"""The ``colibri-stream`` command line: one module per sub-command, each turning its flags into the
library's dataclasses. Nothing imports this package (only ``python -m colibri_stream``)."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from colibri_stream import __version__
from colibri_stream.cli import bench, chat, container, demo, doctor, kv, plan, pull, run, serve, worker
from colibri_stream.errors import USER_ERRORS
from colibri_stream.runtime.memory import return_large_frees_to_the_os

DESCRIPTION = """\
Run huge Mixture-of-Experts language models (DeepSeek-V3/R1, Kimi-K2, DeepSeek-V3.2, GLM-5,
DeepSeek-V4) on a machine that cannot hold them: the dense part stays resident, routed experts
stream from disk as int4 into a RAM cache and a VRAM budget, and each conversation's compressed KV state lives in a
file so a chat resumes after a restart without re-prefill."""

EXIT_USER_ERROR = 1  # bad input: a path, config, budget, session, request; one line on stderr
EXIT_BAD_FLAGS = 2  # argparse's own status for unknown or malformed flags
EXIT_INTERNAL_ERROR = 3  # anything else is a bug: the traceback is printed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri-stream",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run.add_parser(commands)
    demo.add_parser(commands)
    container.add_parsers(commands)
    plan.add_parser(commands)
    pull.add_parser(commands)
    kv.add_parser(commands)
    bench.add_parser(commands)
    serve.add_parser(commands)
    chat.add_parser(commands)
    doctor.add_parser(commands)
    worker.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return_large_frees_to_the_os()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_FLAGS
    try:
        return args.handler(args)
    except USER_ERRORS as exc:
        print(f"colibri-stream {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception:
        traceback.print_exc()
        print(f"colibri-stream {args.command}: internal error (a bug; the traceback is above)", file=sys.stderr)
        return EXIT_INTERNAL_ERROR
