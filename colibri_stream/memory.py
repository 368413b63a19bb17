"""Measured memory: peak RSS from the kernel, peak USS sampled by a background thread."""

from __future__ import annotations

import resource
import threading

import psutil


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def uss_bytes() -> int:
    return psutil.Process().memory_full_info().uss


class USSSampler:
    """Samples this process's USS every ``interval`` seconds while active; ``peak`` is the maximum seen."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="uss-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, uss_bytes())
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> USSSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, uss_bytes())
