"""Several disks as one, measured on one physical disk: two loop devices (image files on this disk, ext4),
each throttled by the blkio cgroup (v1: ``blkio.throttle.read_bps_device``), hold the same container
whole, spread over both, and whole plus a mirrored hot set. Run as root.

    python tools/bench_disks.py --model /path/stress.cstream [--rate 200MB] [--tokens 12] [--ram 25%]

What it measures (the table at the end; --json FILE keeps every number):
  raw      random expert-record reads through the store's own read path (ExpertReader + ReadQueue for a
           whole container, storage.tiers.spread_reads for a spread one), ``--raw-reads`` records, O_DIRECT,
           ``--threads`` readers per device: MB/s
  decode   decode tok/s of the same prompt at ``--ram`` and at 100% (every layout must give the same
           tokens), and the bytes each device read per decoded token
Every expert read is O_DIRECT, so no run is served by the page cache of an earlier one; the page cache is
not dropped (the machine is shared). The load average is printed: other agents share the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CGROUP = Path("/sys/fs/cgroup/blkio/colibri-bench-disks")
PROMPT = [5, 9, 17, 33, 65, 129, 257, 300, 11, 23, 42, 77]
HISTORY_PROMPT = [300, 257, 129, 65, 33, 17, 9, 5, 8, 99, 123, 7]


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


# ----------------------------------------------------------------------------------------- devices
@contextlib.contextmanager
def throttled_devices(workdir: Path, size: int, rates: tuple[int, int], keep: bool) -> Iterator[list[Path]]:
    """Two ext4 loop devices mounted under ``workdir``, reads from this process (and its children)
    throttled to ``rates``."""
    workdir.mkdir(parents=True, exist_ok=True)
    loops, mounts = [], []
    try:
        for name in ("disk0", "disk1"):
            image, mount = workdir / f"{name}.img", workdir / name
            with open(image, "wb") as f:
                f.truncate(size)
            sh("mkfs.ext4", "-q", "-F", str(image))
            loop = sh("losetup", "--find", "--show", str(image))
            loops.append(loop)
            mount.mkdir(exist_ok=True)
            sh("mount", loop, str(mount))
            mounts.append(mount)
        CGROUP.mkdir(exist_ok=True)
        for loop, rate in zip(loops, rates, strict=True):
            rdev = os.stat(loop).st_rdev
            (CGROUP / "blkio.throttle.read_bps_device").write_text(f"{os.major(rdev)}:{os.minor(rdev)} {rate}\n")
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))  # threads started later inherit it
        yield mounts
    finally:
        with contextlib.suppress(OSError):
            (CGROUP.parent / "cgroup.procs").write_text(str(os.getpid()))
        for mount in mounts:
            subprocess.run(["umount", str(mount)], check=False)
        for loop in loops:
            subprocess.run(["losetup", "-d", loop], check=False)
        with contextlib.suppress(OSError):
            CGROUP.rmdir()
        if not keep:
            for name in ("disk0", "disk1"):
                (workdir / f"{name}.img").unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------- runs
def raw_reads(path: Path, n: int, threads: int, seed: int = 0) -> dict[str, Any]:
    """``n`` random records read at once through the store's read path; MB/s over the wall time."""
    from storage.container.reader import Container, ExpertReader
    from storage.files.buffers import aligned_empty
    from storage.files.page_cache import Bypass
    from storage.tiers.read_queue import ReadQueue
    from storage.tiers.spread_reads import SpreadReads

    container = Container(path)
    rng = random.Random(seed)
    keys = [(rng.choice(container.moe_layers), rng.randrange(container.n_experts)) for _ in range(n)]
    size = container.layout.record_bytes
    slots = [aligned_empty(size) for _ in range(min(n, 64))]
    start = time.perf_counter()
    if container.parts is None:
        reader, queue = ExpertReader(container, Bypass.O_DIRECT, verify=False), ReadQueue(threads)
        futures = [
            queue.submit(lambda k=k, i=i: reader.read_into(*k, slots[i % len(slots)])) for i, k in enumerate(keys)
        ]
        for future in futures:
            future.result()
        queue.shutdown()
        devices: list[dict[str, Any]] = []
    else:
        spread = SpreadReads(container, container.parts, threads, direct=True, verify=False)
        futures = [spread.submit(k, slots[i % len(slots)]) for i, k in enumerate(keys)]
        for future in futures:
            future.result()
        spread.shutdown()
        devices = [d.as_dict() for d in spread.stats()]
    wall = time.perf_counter() - start
    return {"records": n, "mb_per_s": round(n * size / wall / 1e6, 1), "wall_s": round(wall, 3), "devices": devices}


def decode(path: Path, ram: str, tokens: int, threads: int, history: Path | None = None) -> dict[str, Any]:
    """Decode tok/s of PROMPT (cold store, no preload), bytes per device per decoded token."""
    from colibri_stream.planning.budget import parse_size
    from colibri_stream.runtime.generate import generate
    from colibri_stream.runtime.loader import load_container
    from storage.container.reader import Container
    from storage.tiers.config import StoreConfig

    container = Container(path)
    ram_bytes = parse_size(ram, container.expert_bytes, "--ram")
    config = StoreConfig(ram_bytes=ram_bytes, threads=threads, preload=False, history_path=history)
    loaded = load_container(path, store=config)
    store = loaded.experts
    marks: list[float] = []
    first: list[Any] = []

    def on_token(token: int) -> None:
        marks.append(time.perf_counter())
        if len(marks) == 1:
            first.append((store.device_stats(), store.snapshot()))  # type: ignore[union-attr]

    try:
        prompt = HISTORY_PROMPT if history is not None else PROMPT
        ids = generate(loaded.model, prompt, tokens, store, on_token=on_token).ids
        if history is not None:
            store.end_turn()
        devices_then, stats_then = first[0]
        devices_now, stats_now = store.device_stats(), store.snapshot()  # type: ignore[union-attr]
    finally:
        store.close()
    steps = len(marks) - 1
    seconds = marks[-1] - marks[0]
    phase = stats_now.minus(stats_then)
    per_device = [
        {
            "device": now.device,
            "bytes_per_token": round(now.minus(then).bytes / steps),
            "mb_per_s_busy": now.minus(then).as_dict()["mb_per_s"],
        }
        for now, then in zip(devices_now, devices_then, strict=True)
    ]
    return {
        "ram": ram,
        "ids": ids,
        "decode_tokens": steps,
        "decode_tok_per_s": round(steps / seconds, 3),
        "bytes_per_token": round(phase.expert_bytes_read / steps),
        "io_wait_s": round(phase.io_wait_s, 3),
        "devices": per_device,
    }


def parts_bytes(path: Path) -> tuple[int, list[float]]:
    """Expert bytes stored over every device (mirror copies count twice), and the parts' weights."""
    from storage.container.reader import Container
    from storage.container.spread import current_parts

    container = Container(path)
    parts = current_parts(container)
    stored = sum(len(where) for _, where in parts.records()) * container.layout.record_bytes
    return stored, list(parts.weights)


def cli(*args: str) -> None:
    """`colibri-stream container ...` in a child (in the throttling cgroup too); its weights on stderr."""
    subprocess.run([sys.executable, "-m", "colibri_stream", "container", *args], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", required=True, help="a container (e.g. the stress model, tools/make_stress_model.py + convert)"
    )
    parser.add_argument("--workdir", default="/var/tmp/colibri-bench-disks")
    parser.add_argument("--rate", default="200MB", help="read limit per device, bytes/s (default 200MB)")
    parser.add_argument("--rate-b", help="read limit of the second device (default: --rate)")
    parser.add_argument(
        "--given-weights", action="store_true", help="weights from the rates instead of the spread's own probe"
    )
    parser.add_argument("--ram", default="25%")
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=4, help="reader threads per device")
    parser.add_argument("--raw-reads", type=int, default=300)
    parser.add_argument("--history-tokens", type=int, default=32, help="tokens of the earlier run (history)")
    parser.add_argument("--margin", default="0.2", help="mirror plan margin (container mirror --margin)")
    parser.add_argument("--skip-full", action="store_true", help="no 100%% budget runs")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--keep", action="store_true", help="keep the disk images")
    args = parser.parse_args()
    from colibri_stream.planning.budget import parse_size

    rate = parse_size(args.rate, 0, "--rate")
    rate_b = parse_size(args.rate_b, 0, "--rate-b") if args.rate_b else rate
    model = Path(args.model)
    size = int(sum(f.stat().st_size for f in model.rglob("*") if f.is_file()) * 1.5) + (512 << 20)
    load = os.getloadavg()
    results: dict[str, Any] = {"rates": [rate, rate_b], "load_before": load, "model": str(model), "ram": args.ram}
    # DIR:WEIGHT and --home-weight from the rates, or nothing: `container spread` measures each device
    # (as speeds, "B": a plain number for --to would mean a multiple of the home directory's weight)
    weight_a = ["--home-weight", f"{rate}B"] if args.given_weights else []
    weight_b = f":{rate_b}B" if args.given_weights else ""
    with throttled_devices(Path(args.workdir), size, (rate, rate_b), args.keep) as (a, b):
        whole = a / "model.cstream"
        shutil.copytree(model, whole)
        history = Path(args.workdir) / "history.json"
        history.unlink(missing_ok=True)
        # the earlier run whose routing the mirror learns from (another prompt)
        results["history_run"] = decode(whole, "100%", args.history_tokens, args.threads, history)
        rows = {}
        hot = ["--history", str(history), "--margin", str(args.margin)]
        for layout in ("whole", "spread", "spread+mirror", "whole+mirror"):
            if layout == "spread":
                cli("spread", str(whole), "--to", f"{b / 'part'}{weight_b}", *weight_a)
            if layout == "spread+mirror":  # hot records of each device copied to the other
                cli("mirror", "stage", str(whole), *hot)
            if layout == "whole+mirror":  # everything on disk0, the hot set also on disk1
                cli("gather", str(whole))
                cli("mirror", "stage", str(whole), *hot, "--to", f"{b / 'hot'}{weight_b}", *weight_a)
            stored, weights = parts_bytes(whole)
            results.setdefault("total_bytes", {})[layout] = stored
            results.setdefault("weights", {})[layout] = weights
            row: dict[str, Any] = {"raw": raw_reads(whole, args.raw_reads, args.threads)}
            row["decode"] = decode(whole, args.ram, args.tokens, args.threads)
            if not args.skip_full:
                row["decode_full"] = decode(whole, "100%", args.tokens, args.threads)
            rows[layout] = row
            print(layout, json.dumps({k: v for k, v in row.items()}, default=str)[:600], file=sys.stderr)
        results["layouts"] = rows
    results["load_after"] = os.getloadavg()
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def print_table(results: dict[str, Any]) -> None:
    rows = results["layouts"]
    base = rows["whole"]
    same = all(r["decode"]["ids"] == base["decode"]["ids"] for r in rows.values())
    print(
        f"\nthrottle {results['rates'][0] / 1e6:.0f} / {results['rates'][1] / 1e6:.0f} MB/s (disk0 / disk1); "
        f"load avg before {results['load_before']}, after {results['load_after']}; "
        f"tokens identical across layouts: {same}"
    )
    print(
        f"| layout | expert GB stored | raw read MB/s | x | decode tok/s at {results['ram']} | x | "
        "decode tok/s at 100% | bytes/token per device |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        raw, dec = row["raw"]["mb_per_s"], row["decode"]["decode_tok_per_s"]
        full = row.get("decode_full", {}).get("decode_tok_per_s", "-")
        per_device = ", ".join(f"{d['bytes_per_token'] / 1e6:.1f} MB" for d in row["decode"]["devices"]) or (
            f"{row['decode']['bytes_per_token'] / 1e6:.1f} MB (one device)"
        )
        stored = results["total_bytes"][name] / 1e9
        print(
            f"| {name} | {stored:.2f} | {raw} | {raw / base['raw']['mb_per_s']:.2f} | {dec} | "
            f"{dec / base['decode']['decode_tok_per_s']:.2f} | {full} | {per_device} |"
        )


if __name__ == "__main__":
    main()
