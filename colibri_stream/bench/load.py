"""`loaded_vs_idle`: our decode beside one competing CPU-bound process, over the same decode idle.

A desktop or a shared server is rarely idle. The bench runs ours (100% budget, page cache warm) idle,
then beside a busy loop it starts (`python -c "while True: pass"`, outside the memory limit, killed
after), then idle again; the idle figure is the better of the two idle runs, so drift during the
section counts against the ratio, never for it. tools/bench_load.py sweeps threads and OpenMP waiting
policies the same way.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import Protocol

BUSY_LOOP = [sys.executable, "-c", "while True: pass"]


class Competitor(Protocol):
    def kill(self) -> None: ...
    def wait(self) -> object: ...


def busy_loop() -> Competitor:
    return subprocess.Popen(BUSY_LOOP, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def loaded_vs_idle(
    run: Callable[[], dict],
    start_competitor: Callable[[], Competitor] = busy_loop,
    settle_s: float = 0.5,
) -> dict:
    """``run`` measures one decode and returns its row (``decode_tok_per_s``); idle, loaded, idle."""
    before = run()
    competitor = start_competitor()
    try:
        time.sleep(settle_s)  # the competitor is running flat out before the measured process starts
        loaded = run()
    finally:
        competitor.kill()
        competitor.wait()
    after = run()
    idle = max(before["decode_tok_per_s"], after["decode_tok_per_s"])
    return {
        "competitor": f"python -c {BUSY_LOOP[2]!r}",
        "idle_tok_per_s": [before["decode_tok_per_s"], after["decode_tok_per_s"]],
        "loaded_tok_per_s": loaded["decode_tok_per_s"],
        "loaded_ttft_s": loaded["ttft_s"],
        "idle_ttft_s": min(before["ttft_s"], after["ttft_s"]),
        "same_tokens": before["ids"] == loaded["ids"] == after["ids"],
        "loaded_vs_idle": round(loaded["decode_tok_per_s"] / idle, 3) if idle > 0 else 0.0,
        "rows": [before, loaded, after],
    }
