"""kill -9 a `colibri-stream pull` at N random moments, then let it finish; check the container against
`convert` of the same files downloaded whole (cmp of every file) and count the bytes downloaded.

    python tools/pull_kill_loop.py --kills 10 --seed 1

Serves a tiny sharded FP8 DeepSeek-V3 (colibri_stream/devtools/hub_fixture.py) from the fake Hub
(colibri_stream/devtools/fake_hub.py) on 127.0.0.1, throttled so kills land mid-download and
mid-conversion. Prints one JSON object: per kill the shards converted so far, the total body bytes the Hub
sent for weight files against one uninterrupted pass, and whether the container is byte-identical.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools.fake_hub import LAST_MODIFIED, SCALED_CHUNK_CLI, FakeHub, FakeRepo, Faults
from colibri_stream.devtools.hub_fixture import build_sharded_fp8_checkpoint

REPO = "org/tiny-model"


def _identical(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    other = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    return files == other and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files)


def _converted(out: Path) -> int:
    try:
        return len(json.loads((out / ".pull" / "journal.json").read_text())["converted"])
    except (OSError, ValueError, KeyError):
        return 0


def _weight_bytes(hub: FakeHub) -> int:
    return sum(e.body_bytes for e in hub.log if e.method == "GET" and e.path.endswith(".safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--bytes-per-s", type=float, default=40_000)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="pull-kill-"))
    checkpoint = build_sharded_fp8_checkpoint(root)
    repo = FakeRepo.from_dir(checkpoint)
    whole = root / "whole"
    shutil.copytree(checkpoint, whole)
    from datetime import datetime

    stamp = int(datetime.fromisoformat(LAST_MODIFIED.replace("Z", "+00:00")).timestamp() * 1e9)
    for file in whole.iterdir():
        os.utime(file, ns=(stamp, stamp))
    Converter(whole, root / "ref.cstream", ConvertOptions(), progress=False).run()
    env = {**os.environ, "HF_HOME": str(root / "hf-home")}
    out = root / "out.cstream"
    command = [sys.executable, "-c", SCALED_CHUNK_CLI, "pull", REPO, "--out", str(out), "--json", "--no-progress"]
    with FakeHub({REPO: FakeRepo.from_dir(checkpoint)}) as one:  # one uninterrupted pass, for the count
        subprocess.run(
            [*command[:-3], str(root / "one.cstream"), "--json"],
            env={**env, "HF_ENDPOINT": one.url},
            check=True,
            capture_output=True,
        )
        one_pass = _weight_bytes(one)
    kills = []
    with FakeHub({REPO: repo}, Faults(bytes_per_s=args.bytes_per_s)) as hub:
        env["HF_ENDPOINT"] = hub.url
        for _ in range(args.kills):
            if (out / "zarr.json").exists() and not (out / ".pull").exists():
                break  # finished between kills: slow the Hub down (--bytes-per-s) for more kills
            seen = len(hub.log)
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while len(hub.log) == seen and process.poll() is None:
                time.sleep(0.01)
            delay = rng.uniform(0.2, 4.0)
            time.sleep(delay)
            process.send_signal(signal.SIGKILL)
            process.wait()
            kills.append({"after_s": round(delay, 2), "shards_converted": _converted(out), "sent": _weight_bytes(hub)})
        hub.faults.bytes_per_s = None
        final = subprocess.run(command, env=env, capture_output=True, text=True)
        total = _weight_bytes(hub)
    report = {
        "kills": kills,
        "final_exit": final.returncode,
        "weight_bytes_one_pass": one_pass,
        "weight_bytes_total": total,
        "ratio": round(total / one_pass, 3),
        "byte_identical": final.returncode == 0 and _identical(out, root / "ref.cstream"),
    }
    print(json.dumps(report, indent=1))
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
