"""Measured memory and I/O: peak RSS from the kernel, peaks (USS, anonymous RSS) sampled by a thread."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from storage.files.io_features import Feature, enabled

STATUS = Path("/proc/self/status")
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20


def return_large_frees_to_the_os() -> bool:
    """Fix glibc's mmap threshold at 1 MiB.

    By default glibc raises the threshold to the size of each freed mmapped block (up to 32 MiB), so
    after the first few dequantised expert matrices (MBs each) are freed, later ones come from the
    heap and stay mapped: hundreds of MB of USS retained during generation beyond the expert slots
    (docs/benchmarks-log.md, "Figures behind the code"). A fixed threshold keeps large temporaries in mmaps
    that go back at free. Returns False where libc has no mallopt (not glibc)."""
    mallopt = glibc_function("mallopt")
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def return_freed_heap_to_the_os() -> bool:
    """glibc's malloc_trim(0): give back the heap pages that freed allocations below the mmap threshold
    left behind, e.g. the old small tensors once the dense part moved into its huge-page arena
    (runtime/huge_pages.py; docs/benchmarks-log.md, "The dense part on huge pages"). Returns False where libc
    has no malloc_trim (not glibc)."""
    trim = glibc_function("malloc_trim")
    return bool(trim is not None and trim(0))


def glibc_function(name: str) -> Callable[..., int] | None:
    """The C library's function ``name``, or None where it has none (mallopt and malloc_trim are glibc's)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    function: Callable[..., int] | None = getattr(ctypes.CDLL(libc_name), name, None)  # reflection: glibc only
    return function


def peak_rss_bytes() -> int:
    """This process image's peak resident set: VmHWM. Not ru_maxrss, which on Linux also keeps the peak
    of the image exec replaced: a child spawned by a 700 MB process reports 700 MB before doing anything
    (a test's pytest parent, a bench suite)."""
    if enabled(Feature.PROC):
        with contextlib.suppress(OSError):
            for line in STATUS.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    # without /proc: the kernel's peak, in bytes on macOS and KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def disk_reads_counted() -> bool:
    """Whether this OS counts a process's block-device bytes: Linux does (/proc/self/io, or getrusage's
    ru_inblock/ru_oublock in 512-byte units without /proc); macOS does not (psutil has no io_counters there)."""
    return sys.platform.startswith("linux")


def disk_read_bytes() -> int:
    """Bytes this process has caused to be read from block devices (page-cache hits excluded). Only where
    ``disk_reads_counted()``."""
    if enabled(Feature.PROC):
        return psutil.Process().io_counters().read_bytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_inblock * 512  # Linux: read_bytes >> 9


def disk_write_bytes() -> int:
    """Bytes this process has caused to be written to block devices. Only where ``disk_reads_counted()``."""
    if enabled(Feature.PROC):
        return psutil.Process().io_counters().write_bytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_oublock * 512  # Linux: write_bytes >> 9


ROLLUP = Path("/proc/self/smaps_rollup")
_PRIVATE = (b"Private_Clean:", b"Private_Dirty:", b"Private_Hugetlb:")


def uss_bytes() -> int:
    """Memory only this process holds (USS). From smaps_rollup where the kernel has it: psutil parses the
    whole of /proc/self/smaps in Python, mostly holding the GIL the model's thread needs (the kernel's
    walk of the pages remains either way; docs/benchmarks-log.md, "Figures behind the code")."""
    try:
        if not enabled(Feature.PROC):
            raise FileNotFoundError(ROLLUP)
        lines = ROLLUP.read_bytes().splitlines()
    except OSError:  # no /proc (macOS), or a kernel without smaps_rollup: psutil's way for this OS
        return psutil.Process().memory_full_info().uss
    return sum(int(line.split()[1]) * 1024 for line in lines if line.startswith(_PRIVATE))


def anon_rss_bytes() -> int:
    """Resident anonymous memory (RssAnon): RSS without the mmapped files a cgroup may reclaim. Without /proc
    (macOS), USS: memory only this process holds, which also counts private file pages, so at least RssAnon
    less shared anonymous pages and possibly more."""
    if enabled(Feature.PROC):
        with contextlib.suppress(OSError):
            for line in STATUS.read_text().splitlines():
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024  # kB
    return psutil.Process().memory_full_info().uss


# USS is sampled this often during a turn: each sample costs the kernel a walk of the process's pages
# (milliseconds with a model loaded: docs/benchmarks-log.md, "Figures behind the code"), so sampling much
# more often would take a noticeable share of a core from decode.
USS_INTERVAL_S = 0.25


class PeakSampler:
    """Samples ``measure()`` every ``interval`` seconds while active; ``peak`` is the maximum seen."""

    def __init__(self, measure: Callable[[], int] = uss_bytes, interval: float = 0.05):
        self.measure, self.interval = measure, interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.measure())
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.measure())


class PeakWatch:
    """One overlapping interval of a SharedPeakSampler: ``peak`` is the highest value sampled while open."""

    def __init__(self, sampler: SharedPeakSampler):
        self.sampler, self.peak, self.samples, self.open = sampler, 0, 0, True

    def take(self, value: int) -> None:
        self.peak = max(self.peak, value)
        self.samples += 1

    def stop(self) -> None:
        if self.open:
            self.open = False
            self.sampler.unwatch(self)


class SharedPeakSampler:
    """One sampling thread for many overlapping watches (the server's concurrent turns), instead of a
    thread per turn each paying for its own samples. The thread runs while a watch is open and samples as
    soon as one opens, then every ``interval``.

    A watch's last sample is the thread's, not taken when it stops: a turn stops its watch on the server's
    model thread, and a sample there (the kernel's walk of every page: ~5 ms with the demo model loaded,
    more with more memory) held up every other request's next step, once per finished request (4 requests
    of 32 tokens at a time on the demo: ~45 ms after their last step). Only a watch the thread never
    sampled (a turn shorter than the thread's first sample) is measured when it stops.

    A watch opened within ``fresh`` seconds (default: the interval) of the thread's last sample starts from
    that sample, as a watch sampled on opening would (both see the process before the turn's work): a
    server with a steady stream of short requests asked for a walk of the pages per request: py-spy found
    the sampling thread running in 14% of all samples beside the model's thread and the kernels' helper
    (demo model, 4 clients of 32 tokens); without those walks 4 concurrent clients got 1.08-1.10x the
    throughput (tools/bench_serve.py's requests, the two rules alternated in one server)."""

    def __init__(
        self, measure: Callable[[], int] = uss_bytes, interval: float = USS_INTERVAL_S, fresh: float | None = None
    ):
        self.measure, self.interval = measure, interval
        self.fresh = interval if fresh is None else fresh
        self._lock = threading.Lock()
        self._watches: set[PeakWatch] = set()
        self._thread: threading.Thread | None = None
        self._opened = threading.Event()  # a new watch: sample now (or the last one closed: end)
        self._last: tuple[float, int] | None = None  # (time.monotonic(), value) of the thread's newest sample

    def watch(self) -> PeakWatch:
        watch = PeakWatch(self)
        with self._lock:
            self._watches.add(watch)
            running, last = self._thread is not None, self._last
            if not running:  # a new thread samples first thing
                self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)
                self._thread.start()
        if running and last is not None and time.monotonic() - last[0] < self.fresh:
            watch.take(last[1])
        elif running:
            self._opened.set()
        return watch

    def unwatch(self, watch: PeakWatch) -> None:
        with self._lock:
            self._watches.discard(watch)
            if not self._watches:
                self._opened.set()  # the thread ends now, not after its wait
        if watch.samples == 0:
            watch.take(self.measure())

    def _run(self) -> None:
        while True:
            self._opened.clear()  # before the snapshot: a watch opened after it wakes the wait below
            with self._lock:
                if not self._watches:
                    self._thread = None
                    return
                watches = list(self._watches)
            value = self.measure()
            self._last = (time.monotonic(), value)
            for watch in watches:
                watch.take(value)
            self._opened.wait(self.interval)
