"""`colibri-stream plan`: will it fit, and how fast? Computed from metadata before anything loads, and
before anything is downloaded: a container, a checkpoint directory or a bare config.json."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from colibri_stream.cli.help import help_options
from colibri_stream.cli.options import (
    add_activations_argument,
    add_context_argument,
    add_dtype_argument,
    add_store_arguments,
    add_target_arguments,
    store_options,
    target_options,
)
from colibri_stream.planning.bandwidth import Bandwidth, DeviceShare, combined_disk_bandwidth, device_shares, measure
from colibri_stream.planning.budget import parse_size, store_plan
from colibri_stream.planning.geometry import model_geometry
from colibri_stream.planning.placement import check_fits, describe, expected_speed, verdict

PLAN_RAM = "auto"  # without --ram or --budget: what this machine has available for expert slots
PLAN_EPILOG = """\
examples:
  colibri-stream plan config.json                      # before the download: DeepSeek-V3's config.json is enough
  colibri-stream plan config.json --context 32768 --ram 16GiB   # KV and activations for 32k tokens, not 163,840
  colibri-stream plan HF_DIR --ram 48GiB --vram 24GiB  # as `convert` would write it (--experts int4 --group-size 64)
  colibri-stream plan config.json --no-mtp             # without the multi-token-prediction layer DeepSeek-V3 ships
  colibri-stream plan MODEL.cstream --ram 25%
  colibri-stream plan MODEL.cstream --budget budgets/workstation-128g-24gvram.toml --dtype bfloat16 --json

PATH is a container, a Hugging Face checkpoint directory, or a config.json (the file, or a directory
holding it); for the last two every number is computed from the config, for the container
--experts/--group-size/--dense/--no-mtp would write: the multi-token-prediction layer a DeepSeek-V3/R1 or
GLM-5 config ships (num_nextn_predict_layers; a checkpoint: the one its shards hold) is counted in the
dense and expert bytes unless --no-mtp, and one line says what it adds. KV and prefill activations are
sized for --context tokens (default: the budget file's [kv] context, else the model's
max_position_embeddings, the most it may be).
Without --ram or --budget the RAM tier is `--ram auto`: what is available (MemAvailable, or the
memory cgroup's headroom where lower: a container's --memory limit) after dense weights, KV and
activations at that context, less 10%. A budget beyond a cgroup's limit is refused naming the limit.

The last line is the verdict: "fits" (every expert cached), "fits with N% of experts cached", or
"does not fit: <why, with the numbers>". Expected decode tok/s, from this machine's measured memory
bandwidth (a 256 MiB copy) and disk bandwidth (a 256 MiB O_DIRECT read beside PATH):
  low  = 1 / (disk bytes per token at 0% hits / disk bandwidth + bytes touched / memory bandwidth)
  high = 1 / (bytes touched / memory bandwidth)
  bytes touched per token = dense weights read per token + top-k expert records per MoE layer
exit status: 0 when it fits, 1 when it does not (below the floor of one token's experts, or beyond
this machine: the report is printed first, then the reason), 2 on bad flags."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="will it fit? dense, experts, KV, slots per tier and expected tok/s, before loading or downloading",
        description="Compute the placement (dense, KV at the context, expert slots per tier, disk bytes per token "
        "at 0% hits, expected peak RSS and decode tok/s) from a container's metadata or a config.json and a "
        "budget, without loading anything.",
        **help_options(PLAN_EPILOG),
    )
    parser.add_argument("path", help="container, Hugging Face checkpoint directory, or config.json")
    add_dtype_argument(parser)
    add_activations_argument(parser)
    add_context_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the placement as one JSON object")
    target = parser.add_argument_group("the container a conversion would write (checkpoints and config.json)")
    add_target_arguments(target)
    speed = parser.add_argument_group("bandwidths (default: measured here)")
    speed.add_argument("--memory-bandwidth", help="memory bandwidth per second instead of the probe, e.g. 40GB")
    speed.add_argument("--disk-bandwidth", help="disk read bandwidth per second instead of the probe, e.g. 3GB")
    add_store_arguments(parser, ram_default=PLAN_RAM)
    parser.set_defaults(handler=run_plan)


def bandwidth(args: argparse.Namespace, devices: list[DeviceShare] | None = None) -> Bandwidth:
    if devices and args.disk_bandwidth is None:  # a spread container: its devices read at once
        memory = parse_size(args.memory_bandwidth, 0, "--memory-bandwidth") if args.memory_bandwidth else None
        spread = combined_disk_bandwidth(devices)
        return Bandwidth(memory or measure(args.path).memory_bytes_per_s, spread, f"{len(devices)} devices")
    measured = None
    if args.memory_bandwidth is None or args.disk_bandwidth is None:
        measured = measure(args.path)
    memory = parse_size(args.memory_bandwidth, 0, "--memory-bandwidth") if args.memory_bandwidth else None
    disk = parse_size(args.disk_bandwidth, 0, "--disk-bandwidth") if args.disk_bandwidth else None
    # measured is None only when both bandwidths are given
    return Bandwidth(
        memory or measured.memory_bytes_per_s,  # type: ignore[union-attr]
        disk or measured.disk_bytes_per_s,  # type: ignore[union-attr]
        "given" if disk else measured.disk_method,  # type: ignore[union-attr]
    )


def run_plan(args: argparse.Namespace) -> int:
    geometry = model_geometry(Path(args.path), target_options(args))
    options = store_options(args).with_ram(PLAN_RAM)
    placement = store_plan(options, geometry, args.dtype, args.activations != "float32")[1]
    devices = device_shares(args.path)
    speed = expected_speed(placement, bandwidth(args, devices))
    per_device = [
        {**dataclasses.asdict(d), "bytes_per_token_at_zero_hits": d.share * placement.bytes_per_token_at_zero_hits}
        for d in devices
    ]
    if args.json:
        result = verdict(placement)
        report = {**dataclasses.asdict(placement), "speed": dataclasses.asdict(speed), "devices": per_device}
        print(json.dumps({**report, "fits": result.fits, "verdict": result.line}))
    else:
        for d in per_device:
            print(
                f"device {d['directory']}: {d['bytes_per_s'] / 1e6:.0f} MB/s random reads, "
                f"{d['bytes_per_token_at_zero_hits'] / 1e6:.2f} MB per token at 0% hits"
            )
        print(describe(placement, speed))
    check_fits(placement)
    return 0
