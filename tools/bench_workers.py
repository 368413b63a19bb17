"""Routed experts over worker processes, measured in one run each (issues #19 and #43).

    python tools/bench_workers.py compare CONTAINER [--ram 50%] [--workers 2] [--tokens 48] [--rounds 3]
    python tools/bench_workers.py failover CONTAINER [--fault kill|stop] [--worker-timeout 2] [--tokens 200]
    sudo python tools/bench_workers.py shares CONTAINER --slow-read 40MB [--tokens 48]     # root: cgroup v1
    python tools/make_stress_model.py HF --layers 4 && colibri-stream convert HF CONTAINER   # the stress model

compare   decode tok/s and network bytes per token: 2 local workers vs one process with the same total
          RAM for experts, alternating `colibri-stream run --json` rounds (the tokens must match).
failover  one generation over 2 local workers; at a quarter of it a worker is killed (or stopped past
          --worker-timeout), then started again with its own command line once its loss is reported:
          tok/s before / during (lost) / after (rejoined), the time from the fault to the next token,
          and the tokens against an uninterrupted run over the same workers.
shares    heterogeneous workers started by hand: worker 1 with a large RAM budget on this disk, worker 2
          with a small one on a loop device whose reads a blkio cgroup (v1) throttles to --slow-read;
          shares by what they measured (RAM slots, then disk speed) vs equal shares (--expert-map), tok/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

PROMPT = [11, 7, 3, 5, 8, 13, 2, 9]


def run(container: str, args: list[str], kv_dir: str) -> dict:
    command = [sys.executable, "-m", "colibri_stream", "run", container, "--ids", ",".join(map(str, PROMPT))]
    command += ["--json", "--kv-dir", kv_dir, *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def summary(result: dict) -> dict:
    stats = result["stats"]
    out = {k: stats[k] for k in ("decode_tok_per_s", "ttft_s", "hit_rate", "misses", "expert_bytes_read")}
    if "network" in stats:
        out["network"] = stats["network"]
        keys = ("rank", "experts_held", "ram_slots", "disk_bytes_per_s", "misses", "expert_bytes_read", "io_wait_s")
        out["workers"] = [{k: w[k] for k in keys} for w in stats["workers"]]
    return out


# ------------------------------------------------------------------------------------------ compare
def compare(args: argparse.Namespace) -> dict:
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as kv_dir:
        for _ in range(args.rounds):
            flags = ["--max-new-tokens", str(args.tokens), "--ram", args.ram]
            results = {
                "one_process": run(args.container, flags, kv_dir),
                f"{args.workers}_workers": run(args.container, [*flags, "--local-workers", str(args.workers)], kv_dir),
            }
            if len({tuple(r["ids"]) for r in results.values()}) != 1:
                raise SystemExit("the contenders generated different tokens: placement must never change them")
            for name, result in results.items():
                if name not in best or result["stats"]["decode_tok_per_s"] > best[name]["decode_tok_per_s"]:
                    best[name] = summary(result)
    one, many = best["one_process"], best[f"{args.workers}_workers"]
    return {
        "container": args.container,
        "ram": args.ram,
        "decode_tokens": args.tokens,
        "rounds": args.rounds,
        "contenders": best,
        "workers_vs_one_process": round(many["decode_tok_per_s"] / one["decode_tok_per_s"], 3),
    }


# ----------------------------------------------------------------------------------------- failover
class Events(logging.Handler):
    """The coordinator's loss / rejoin lines, with the perf_counter time each was logged."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[tuple[float, str]] = []
        self.lost = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((time.perf_counter(), record.getMessage()))
        if "until it rejoins" in record.getMessage():
            self.lost.set()

    def first(self, text: str) -> float | None:
        return next((t for t, line in self.seen if text in line), None)


def rate(stamps: list[float]) -> float | None:
    return round((len(stamps) - 1) / (stamps[-1] - stamps[0]), 3) if len(stamps) > 1 else None


def generate(runtime, tokens: int, on_token) -> list[int]:  # noqa: ANN001 (a Runtime; imported late)
    from colibri_stream.runtime.turn import TurnOptions, run_turn

    return run_turn(runtime, PROMPT, TurnOptions(max_new_tokens=tokens, on_token=on_token)).ids


def failover(args: argparse.Namespace) -> dict:
    from colibri_stream.experts.cluster.group import ClusterOptions
    from colibri_stream.planning.budget import StoreOptions
    from colibri_stream.runtime.turn import RuntimeOptions, load_runtime

    events = Events()
    logging.getLogger("colibri_stream.experts.cluster.coordinator").addHandler(events)
    cluster = ClusterOptions(local_workers=args.workers, timeout_s=args.worker_timeout)
    restarted: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as kv_dir:
        options = RuntimeOptions(store=StoreOptions(ram=args.ram), kv_dir=Path(kv_dir), text=False, cluster=cluster)
        runtime = load_runtime(args.container, options)
        try:
            uninterrupted = generate(runtime, args.tokens, None)
            stamps: list[float] = []
            fault: dict[str, float] = {}
            workers = [p for p in psutil.Process().children() if "--rank" in p.cmdline()]
            victim = workers[-1]

            def on_token(_: int) -> None:
                stamps.append(time.perf_counter())
                if len(stamps) == args.tokens // 4:
                    threading.Thread(target=strike, daemon=True).start()

            def strike() -> None:
                command = victim.cmdline()
                fault["at"] = time.perf_counter()
                victim.send_signal(signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
                if events.lost.wait(args.worker_timeout + 60):
                    restarted.append(subprocess.Popen(command, stdin=subprocess.DEVNULL))
                    fault["restarted"] = time.perf_counter()

            ids = generate(runtime, args.tokens, on_token)
            report = runtime.loaded.experts.report()
        finally:
            runtime.close()
            for process in restarted:
                process.kill()
                process.wait()
    at, rejoined = fault["at"], events.first("rejoined after")
    lost = events.first("until it rejoins")
    before = [t for t in stamps if t < at]
    during = [t for t in stamps if t >= at and (rejoined is None or t < rejoined)]
    after = [t for t in stamps if rejoined is not None and t >= rejoined]
    return {
        "container": args.container,
        "fault": args.fault,
        "worker_timeout_s": args.worker_timeout,
        "tokens": args.tokens,
        "tokens_identical_to_uninterrupted": ids == uninterrupted,
        "tok_per_s": {"before": rate(before), "during_lost": rate(during), "after_rejoined": rate(after)},
        "tokens_per_phase": {"before": len(before), "during_lost": len(during), "after_rejoined": len(after)},
        "timeline_s": {
            "fault_to_loss_reported": None if lost is None else round(lost - at, 3),
            "fault_to_next_token": round(during[0] - at, 3) if during else None,
            "fault_to_restart": round(fault["restarted"] - at, 3) if "restarted" in fault else None,
            "fault_to_rejoined": None if rejoined is None else round(rejoined - at, 3),
        },
        "workers": [{k: w[k] for k in ("rank", "state", "failovers", "seconds_lost")} for w in report["workers"]],
        "coordinator_share": report["coordinator_share"],
        "network": report["network"],
    }


# ------------------------------------------------------------------------------------------ shares
CGROUP = Path("/sys/fs/cgroup/blkio/colibri-bench-slow")


@contextmanager
def slow_disk(container: str, read_bps: int, root: Path):
    """The container copied onto a loop device (ext4) whose reads the blkio cgroup throttles -> (its path
    there, the cgroup's procs file)."""
    size = sum(f.stat().st_size for f in Path(container).rglob("*") if f.is_file())
    image, mount = root / "slow.img", root / "slow"
    mount.mkdir()
    subprocess.run(["truncate", "-s", str(size + (600 << 20)), image], check=True)
    device = subprocess.run(["losetup", "-f", "--show", image], capture_output=True, text=True, check=True)
    loop = device.stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", loop], check=True)
        subprocess.run(["mount", loop, mount], check=True)
        try:
            copy = mount / "container"
            shutil.copytree(container, copy)
            numbers = os.stat(loop).st_rdev
            CGROUP.mkdir(exist_ok=True)
            rule = f"{os.major(numbers)}:{os.minor(numbers)} {read_bps}"
            (CGROUP / "blkio.throttle.read_bps_device").write_text(rule)
            try:
                yield copy, CGROUP / "cgroup.procs"
            finally:
                CGROUP.rmdir()
        finally:
            subprocess.run(["umount", mount], check=True)
    finally:
        subprocess.run(["losetup", "-d", loop], check=True)


def by_hand(container: str, flags: list[str], worker_flags: list[list[str]], kv_dir: str, procs: Path) -> dict:
    """A run with workers started by hand: worker 1 on ``container``, worker 2 inside the cgroup."""
    from colibri_stream.experts.cluster.local import free_port

    port, world = free_port(), len(worker_flags) + 1
    common = ["--world-size", str(world), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    workers = []
    for rank, extra in enumerate(worker_flags, start=1):
        command = [sys.executable, "-m", "colibri_stream", "worker", *extra, "--rank", str(rank), *common]
        if rank == 2:  # into the throttled cgroup before it measures its disk
            command = ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *command]
        workers.append(subprocess.Popen(command, stdin=subprocess.DEVNULL))
    try:
        return run(container, [*flags, *common], kv_dir)
    finally:
        for worker in workers:
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


def shares(args: argparse.Namespace) -> dict:
    from colibri_stream.planning.budget import parse_size
    from storage.container.reader import Container

    read_bps = parse_size(args.slow_read, 0, "--slow-read")
    n_experts = Container(args.container).n_experts
    flags = ["--max-new-tokens", str(args.tokens), "--ram", "100%"]
    out: dict = {"container": args.container, "slow_read_bytes_per_s": read_bps, "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as tmp, slow_disk(args.container, read_bps, Path(tmp)) as (slow, procs):
        fast = ["--ram", args.big_ram, "--direct", args.container]
        throttled = ["--ram", args.small_ram, "--direct", str(slow)]
        equal = Path(tmp) / "equal.json"
        equal.write_text(json.dumps({"1": list(range(0, n_experts, 2)), "2": list(range(1, n_experts, 2))}))
        for name, extra in (("measured_shares", []), ("equal_shares", ["--expert-map", str(equal)])):
            result = by_hand(args.container, flags + extra, [fast, throttled], tmp, procs)
            out[name] = summary(result)
            out[name]["ids"] = result["ids"]
    out["tokens_identical"] = out["measured_shares"].pop("ids") == out["equal_shares"].pop("ids")
    measured, equal_ = out["measured_shares"]["decode_tok_per_s"], out["equal_shares"]["decode_tok_per_s"]
    out["measured_vs_equal"] = round(measured / equal_, 3) if equal_ else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    for mode in ("compare", "failover", "shares"):
        sub = modes.add_parser(mode)
        sub.add_argument("container")
        sub.add_argument("--ram", default="50%", help="RAM for experts, in total (default 50%% of their bytes)")
        sub.add_argument("--workers", type=int, default=2)
        sub.add_argument("--tokens", type=int, default=200 if mode == "failover" else 48)
        sub.add_argument("--rounds", type=int, default=3)
        sub.add_argument("--fault", choices=("kill", "stop"), default="kill")
        sub.add_argument("--worker-timeout", type=float, default=2.0)
        sub.add_argument("--slow-read", default="40MB", help="shares: worker 2's disk read limit per second")
        sub.add_argument("--big-ram", default="60%", help="shares: worker 1's RAM budget")
        sub.add_argument("--small-ram", default="10%", help="shares: worker 2's RAM budget")
    args = parser.parse_args()
    report = {"compare": compare, "failover": failover, "shares": shares}[args.mode](args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
