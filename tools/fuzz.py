"""Fuzz every input surface for N minutes and report what breaks the property (docs/fuzzing.md).

    python tools/fuzz.py --minutes 30                      # every surface, round robin
    python tools/fuzz.py --minutes 5 --surface kvlog http  # some surfaces
    python tools/fuzz.py --minutes 10 --seed 7 --out fuzz-findings

Prints cases per surface and each distinct BAD finding (smallest mutation seen), confirms each in a
fresh interpreter, and writes its inputs + repro.json under --out. Exit status 1 when anything is BAD.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from colibri_stream.devtools.fuzz.http_surface import ServedModel, fuzz_http
from colibri_stream.devtools.fuzz.runner import format_report, open_run
from colibri_stream.devtools.fuzz.surfaces import SURFACES

ALL = [*SURFACES, "http"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--surface", nargs="+", choices=ALL, default=ALL)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--out", type=Path, default=Path("fuzz-findings"))
    parser.add_argument("--no-confirm", action="store_true", help="skip the fresh-interpreter rerun of findings")
    parser.add_argument("--keep", action="store_true", help="keep the run's work directory")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the worker child (finally)
    root = Path(tempfile.mkdtemp(prefix="colibri-fuzz-"))
    print(f"seed {args.seed}; work directory {root}", flush=True)
    fuzzer = open_run(root)
    served = ServedModel(fuzzer.base / "ckpt", root / "http") if "http" in args.surface else None
    files = [s for s in args.surface if s != "http"]
    deadline = time.monotonic() + args.minutes * 60
    round_ = 0
    try:
        while time.monotonic() < deadline:
            for name in files:
                if time.monotonic() < deadline:
                    fuzzer.fuzz(name, 10, seed=args.seed * 1000 + round_)
            if served is not None and time.monotonic() < deadline:
                fuzz_http(served, fuzzer.report, 10, seed=args.seed * 1000 + round_)
            round_ += 1
            print(f"round {round_}: {sum(sum(c.values()) for c in fuzzer.report.counts.values())} cases, "
                  f"{len(fuzzer.report.bad())} distinct BAD", flush=True)  # fmt: skip
    except BaseException:
        fuzzer.worker.stop()  # with its process group: a case's own processes too
        raise
    finally:
        if served is not None:
            served.stop()
    print(format_report(fuzzer.report), flush=True)  # before the repros: a failure there loses nothing
    fuzzer.confirm_and_save(args.out, confirm=not args.no_confirm)
    fuzzer.worker.stop()
    print(f"repros in {args.out}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if fuzzer.report.bad() else 0


if __name__ == "__main__":
    sys.exit(main())
