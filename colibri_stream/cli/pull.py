"""`colibri-stream pull REPO_ID`: download from the Hugging Face Hub and convert shard by shard."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from colibri_stream.cli.help import help_options
from colibri_stream.cli.options import add_dtype_argument, add_store_arguments, add_target_arguments, store_options
from colibri_stream.cli.plan import PLAN_RAM
from colibri_stream.convert.converter import ConvertOptions
from colibri_stream.convert.pull import Pull, PullOptions
from colibri_stream.convert.pull_http import Deadlines
from colibri_stream.convert.pull_ids import check_repo_id, check_revision
from colibri_stream.convert.pull_space import SKIP_FLAG
from storage.files.safe_read import check_output_dir

EXIT_INTERRUPTED = 130

PULL_EPILOG = """\
examples:
  colibri-stream pull deepseek-ai/DeepSeek-V3 --out ~/models/dsv3.cstream   # ~380 GB of disk, not ~1.07 TB
  colibri-stream pull moonshotai/Kimi-K2-Instruct --plan-only               # the verdict, before any weight
  colibri-stream pull org/model --revision 0123abcd --out m.cstream --download-dir /mnt/scratch --in-flight 3
  HF_TOKEN=hf_... colibri-stream pull org/gated-model --out m.cstream       # gated or private repos
The Hub is huggingface_hub's: HF_ENDPOINT, HF_TOKEN (or `hf auth login`), HF_HUB_OFFLINE (refused: pull
needs the network). Peak disk: the container plus --in-flight shards (default 2), checked against the free
space of --out's and --download-dir's filesystems before anything is downloaded. Bounded by the Hub's
listing: no file grows past its listed size (config and tokenizer files: 64 MiB at most), a request with
no byte for --stall-timeout seconds ends, and so does a file slower than --min-rate. Interrupted (Ctrl-C,
kill, network error, full disk)? Run the same command again: it continues, and the container is
byte-identical to an uninterrupted pull and to `colibri-stream convert` of the same files.
exit status: 0 when the container is complete (or --plan-only printed a verdict that fits), 1 on a user
error (a refused repo id, repo or config, "does not fit" without --force, not enough disk, a download that
keeps failing its checksum, a Hub that sends more than it lists or stalls), 2 on bad flags, 130 on Ctrl-C
(run it again to continue)."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "pull",
        help="download a model from the Hugging Face Hub and convert it, shard by shard, resumable",
        description=(
            "Fetch config.json and the tokenizer first and print plan's verdict for this machine; then "
            "download the safetensors shards a few at a time, check each against the Hub's sha256, convert "
            "it into the container and delete it. Needs the container's disk plus a couple of shards."
        ),
        **help_options(PULL_EPILOG),
    )
    parser.add_argument("repo_id", help="Hub repo, e.g. deepseek-ai/DeepSeek-V3")
    parser.add_argument("--revision", help="branch, tag or commit (default: main; a resumed pull keeps its commit)")
    parser.add_argument("--out", help="container directory to create or resume (default: ./<name>.cstream)")
    parser.add_argument("--download-dir", help="where shards are downloaded (default: OUT.download)")
    parser.add_argument("--in-flight", type=int, default=2, help="shards on disk at once (default 2)")
    parser.add_argument("--keep-download", action="store_true", help="keep the downloaded checkpoint")
    parser.add_argument("--plan-only", action="store_true", help="print the verdict and stop before any weight")
    parser.add_argument("--force", action="store_true", help='pull even when the verdict is "does not fit"')
    parser.add_argument(SKIP_FLAG, action="store_true", help="skip the free-space check (its estimate may be off)")
    defaults = Deadlines()
    parser.add_argument(
        "--stall-timeout",
        type=_positive,
        default=defaults.stall_s,
        metavar="SECONDS",
        help=f"end a download when no byte comes for this long (default {defaults.stall_s:g}; run again to continue)",
    )
    parser.add_argument(
        "--min-rate",
        type=_rate,
        default=defaults.min_rate,
        metavar="BYTES_PER_S",
        help="end a file slower than this: N bytes get --stall-timeout + N / rate seconds "
        f"(default {defaults.min_rate / 1000:g}k; suffixes k, M, G)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line: plan, shards, result")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_dtype_argument(parser)
    target = parser.add_argument_group("the container to write (as convert)")
    add_target_arguments(target)
    add_store_arguments(parser, ram_default=PLAN_RAM)
    parser.set_defaults(handler=run_pull)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0")
    return value


def _rate(text: str) -> float:
    """Bytes per second: a number with an optional k, M or G (decimal)."""
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(text[-1:].lower(), 1.0)
    return _positive(text[:-1] if scale != 1.0 else text) * scale


def run_pull(args: argparse.Namespace) -> int:
    check_repo_id(args.repo_id)
    if args.revision is not None:
        check_revision(args.revision)
    out = Path(args.out or f"{args.repo_id.rsplit('/', 1)[-1]}.cstream")
    check_output_dir(out, "the destination container")
    store = store_options(args).with_ram(PLAN_RAM)  # as `plan`: what this machine has
    options = PullOptions(
        repo_id=args.repo_id,
        out=out,
        revision=args.revision,
        download_dir=Path(args.download_dir) if args.download_dir else None,
        target=ConvertOptions(experts=args.experts, group_size=args.group_size, dense=args.dense, mtp=not args.no_mtp),
        in_flight=args.in_flight,
        keep_download=args.keep_download,
        force=args.force,
        plan_only=args.plan_only,
        space_check=not args.no_space_check,
        store=store,
        dtype=args.dtype,
        progress=not (args.no_progress or args.json),
        deadlines=Deadlines(stall_s=args.stall_timeout, min_rate=args.min_rate),
    )
    report = _json_line if args.json else _human_line
    try:
        result = Pull(options, report).run()
    except KeyboardInterrupt:
        print(f"colibri-stream pull: interrupted; run the same command again to continue ({out})", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.json:
        _json_line({"event": "result", **result})
    elif "run" in result:
        print(f"{result['path']}: {result['status']}; run it: {result['run']}")
    return 0


def _json_line(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def _human_line(event: dict[str, Any]) -> None:
    kind = event["event"]
    if kind == "plan":
        print(
            f"{event['repo']}@{event['commit'][:12]}: {event['model']}; "
            f"container ~{event['container_bytes'] / 1e9:.2f} GB "
            f"from {event['download_bytes'] / 1e9:.2f} GB in {event['shards']} shards; peak disk "
            f"~{event['peak_disk_bytes'] / 1e9:.2f} GB\nverdict: {event['verdict']}",
            flush=True,
        )
    elif kind == "warning":
        print(f"colibri-stream pull: {event['message']}", file=sys.stderr, flush=True)
