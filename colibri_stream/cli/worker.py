"""`colibri-stream worker`: hold a share of a container's routed experts for a coordinator (run, chat or
serve started with --world-size/--master-addr/--master-port)."""

from __future__ import annotations

import argparse

from colibri_stream.cli.help import help_options
from colibri_stream.cli.options import add_store_arguments, positive_seconds, store_options
from colibri_stream.errors import ColibriError
from colibri_stream.experts.cluster.auth import KEY_ENV, KEY_FILE_HINT
from colibri_stream.experts.cluster.group import DEFAULT_CONNECT_TIMEOUT_S
from colibri_stream.experts.cluster.worker import WorkerOptions, run_worker
from colibri_stream.planning.budget import parse_size

WORKER_EPILOG = """\
examples:
  # machine A (coordinator: dense part, KV state, routers), then machines B and C:
  colibri-stream chat MODEL.cstream --world-size 3 --master-addr 10.0.0.1 --master-port 29500
  colibri-stream worker MODEL.cstream --rank 1 --world-size 3 --master-addr 10.0.0.1 --master-port 29500 --ram 48GiB
  colibri-stream worker MODEL.cstream --rank 2 --world-size 3 --master-addr 10.0.0.1 --master-port 29500 --ram 24GiB
  # one machine, to try it: colibri-stream run MODEL.cstream --ids 1,2,3 --local-workers 2
Each worker needs the same container (same model, same conversion) on its own disk, and the
coordinator's cluster key (a copy of its key file, mode 0600: --cluster-key-file, or COLIBRI_CLUSTER_KEY).
Shares follow the workers' RAM budgets and measured disk speeds (or --expert-map on the coordinator).
exit status: 0 when the coordinator ends the session, 1 on a user error or when the coordinator is gone,
2 on bad flags."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "worker",
        help="hold a share of the routed experts for a coordinator on another process or machine",
        description=(
            "Join a coordinator's group and hold a share of every MoE layer's routed experts: its own RAM/VRAM "
            "budget, eviction policy, usage history and prefetch; answers one request per MoE layer."
        ),
        **help_options(WORKER_EPILOG),
    )
    parser.add_argument("path", help="the converted container (the coordinator's model)")
    parser.add_argument("--rank", type=int, required=True, help="this worker's rank, 1 .. world size - 1")
    parser.add_argument("--world-size", type=int, required=True, help="coordinator + workers")
    parser.add_argument("--master-addr", required=True, help="the coordinator's address")
    parser.add_argument("--master-port", type=int, required=True, help="the coordinator's port")
    parser.add_argument(
        "--disk-speed",
        help="this disk's read speed per second (e.g. 2GB; 0: unknown, weighted like the others); "
        "default: measured at start with a 256 MiB probe file beside the container",
    )
    parser.add_argument(
        "--connect-timeout",
        type=positive_seconds,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        metavar="S",
        help=f"give up if the coordinator is not there within S seconds (default {DEFAULT_CONNECT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--cluster-key-file",
        metavar="FILE",
        help=f"the coordinator's cluster key (a copy of its key file; default: ${KEY_ENV}, else {KEY_FILE_HINT})",
    )
    add_store_arguments(parser)
    parser.set_defaults(handler=worker)


def worker(args: argparse.Namespace) -> int:
    if not 1 <= args.rank < args.world_size:
        raise ColibriError(f"--rank {args.rank}: workers are ranks 1 .. {args.world_size - 1} (0 is the coordinator)")
    disk = None if args.disk_speed is None else parse_size(args.disk_speed, 0, "--disk-speed")
    options = WorkerOptions(
        args.path,
        args.rank,
        args.world_size,
        args.master_addr,
        args.master_port,
        store_options(args),
        disk,
        args.connect_timeout,
        args.cluster_key_file,
    )
    return run_worker(options)
