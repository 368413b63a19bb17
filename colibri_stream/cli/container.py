"""`colibri-stream convert` and `colibri-stream verify`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from colibri_stream.cli import container_spread
from colibri_stream.cli.help import help_options
from colibri_stream.cli.options import add_target_arguments
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.convert.hf_source import COPIED_FILES
from colibri_stream.convert.pull_space import (
    SKIP_FLAG,
    Need,
    check_free_space,
    complete_container,
    container_bytes,
    tree_bytes,
)
from colibri_stream.planning.geometry import container_problems, model_geometry
from storage.files.safe_read import check_output_dir

CONVERT_EPILOG = """\
examples:
  colibri-stream convert ~/hf/DeepSeek-V3 ~/models/dsv3.cstream              # int4 experts, bf16 dense
  colibri-stream convert ~/hf/Kimi-K2-Thinking k2t.cstream                   # its int4 g32 experts as shipped
  colibri-stream convert ~/hf/Kimi-K2 kimi.cstream --experts int8 --group-size 128
  colibri-stream convert tiny-hf tiny.cstream --experts f32 --dense f32      # lossless, for exactness tests
  colibri-stream convert ~/hf/GLM-5 glm5.cstream --no-mtp                    # without the MTP layer (no drafting)
exit status: 0 when the container is complete, 1 on a user error (unreadable source, mismatched resume),
2 on bad flags. Interrupted? Run the same command again: it resumes."""

VERIFY_EPILOG = """\
examples:
  colibri-stream verify ~/models/dsv3.cstream
exit status: 0 when every check passes, 1 when a problem was found (each printed on stderr),
2 on bad flags."""


def add_parsers(commands: argparse._SubParsersAction) -> None:
    convert = commands.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint into an expert container",
        description=(
            "Convert a Hugging Face checkpoint (bf16/f16/f32, FP8 e4m3 with 128x128 block scales, or routed "
            "experts quantised by compressed-tensors: pack-quantized int4, mxfp4) into the "
            "zarr v3 container colibri-stream streams experts from. Streams tensor by tensor (peak memory about "
            "one layer), and resumes where it stopped if interrupted: rerun the same command."
        ),
        **help_options(CONVERT_EPILOG),
    )
    convert.add_argument("src", help="Hugging Face checkpoint directory")
    convert.add_argument("dst", help="container directory to create (or to resume)")
    add_target_arguments(convert)
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")
    convert.add_argument(
        "--spread",
        metavar="DIR[:WEIGHT],...",
        help="then spread the expert records over these directories too (as `container spread --to`; WEIGHT: "
        "a speed like 2GB, or N times the container directory's measured weight)",
    )
    convert.add_argument(
        SKIP_FLAG, action="store_true", help="skip the free-space check (the container's size is an estimate)"
    )
    convert.set_defaults(handler=run_convert)

    verify = commands.add_parser(
        "verify",
        help="check a container's structure, shapes and every checksum",
        description="Read every array and expert record of a container and check it; one line per problem.",
        **help_options(VERIFY_EPILOG),
    )
    verify.add_argument("path", help="container directory")
    verify.set_defaults(handler=run_verify)
    container_spread.add_parser(commands)


def run_convert(args: argparse.Namespace) -> int:
    options = ConvertOptions(experts=args.experts, group_size=args.group_size, dense=args.dense, mtp=not args.no_mtp)
    check_output_dir(args.dst, "the destination container")
    if not (args.no_space_check or complete_container(Path(args.dst))):  # `plan`'s size, less what is written
        side = [(Path(args.src) / name).stat().st_size for name in COPIED_FILES if (Path(args.src) / name).is_file()]
        estimate = container_bytes(model_geometry(args.src, options), options.quant_group_size, side)
        check_free_space(
            [Need(Path(args.dst), max(0, estimate - tree_bytes(Path(args.dst))), "the container, estimated")]
        )
    report = Converter(args.src, args.dst, options, progress=not args.no_progress).run()
    if args.spread:  # a step after the conversion, resumable on its own: rerunning convert redoes it
        report["spread"] = container_spread.spread_container(args.dst, args.spread.split(","))
    print(json.dumps(report))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    problems = container_problems(args.path)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{args.path}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0
