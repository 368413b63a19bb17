"""A directory's read bandwidth for what the store does: random, expert-record-sized O_DIRECT reads from
several threads at once (the weight a spread gives each device, and `plan`'s per-device bandwidth).

A probe file is written in the directory (fsynced; up to ``PROBE_BYTES``, less on a slow disk), then
read at random 4 KiB-aligned offsets, ``record_bytes`` per read, for ``seconds``, by ``threads``
readers. O_DIRECT (F_NOCACHE on macOS) where the filesystem allows (the page cache holds the fresh file),
else buffered after dropping the file's cached pages where posix_fadvise can. The file is removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.files.buffers import PAGE, aligned_empty
from storage.files.page_cache import Bypass, drop_cached, file_bypass, open_file, set_nocache, write_bypass

PROBE_BYTES = 256 << 20
WRITE_SECONDS = 1.5
CHUNK = 8 << 20


@dataclass(frozen=True)
class DeviceSpeed:
    directory: Path
    bytes_per_s: float
    method: str  # open_for_reads': "O_DIRECT" | "F_NOCACHE" | "buffered" | "buffered, cached"


def probe_directory(directory: Path, record_bytes: int, seconds: float = 1.0, threads: int = 4) -> DeviceSpeed:
    directory.mkdir(parents=True, exist_ok=True)
    record = max(PAGE, -(-record_bytes // PAGE) * PAGE)
    with probe_file(directory, WRITE_SECONDS, at_least=4 * record) as (path, size):
        fd, method = open_for_reads(path)
        try:
            rate = _random_reads(fd, size, record, seconds, threads)
        finally:
            os.close(fd)
    return DeviceSpeed(directory, rate, method)


@contextlib.contextmanager
def probe_file(directory: Path, seconds: float, at_least: int = 0) -> Iterator[tuple[Path, int]]:
    """A temporary file in ``directory`` synced to its device: up to PROBE_BYTES, at least ``at_least``
    bytes, written for at most ``seconds`` beyond that (less on a slow disk); removed afterwards."""
    fd, name = tempfile.mkstemp(prefix=".colibri-probe-", dir=directory)
    if write_bypass() is Bypass.F_NOCACHE:  # macOS: the written pages are not kept for the reads to hit
        set_nocache(fd)
    chunk = aligned_empty(CHUNK)
    chunk[:] = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8)
    written, start = 0, time.perf_counter()
    try:
        while written < PROBE_BYTES and (written < at_least or time.perf_counter() - start < seconds):
            written += os.write(fd, chunk)  # type: ignore[arg-type]  # numpy: a Buffer only on >= 3.12
        os.fsync(fd)
        os.close(fd)
        yield Path(name), written
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
        os.unlink(name)


def open_for_reads(path: Path) -> tuple[int, str]:
    """``path`` opened past the page cache: O_DIRECT (F_NOCACHE on macOS) where a read succeeds, else buffered
    after dropping the file's cached pages where fadvise can; the descriptor and which it is ("O_DIRECT",
    "F_NOCACHE", "buffered", or "buffered, cached": nothing could drop the fresh file's pages, so the rate
    is the page cache's)."""
    bypass = file_bypass(path)
    fd = open_file(path, os.O_RDONLY, bypass)
    if bypass is not Bypass.NONE:
        return fd, bypass.flag
    return fd, "buffered" if drop_cached(fd) else "buffered, cached"


def _random_reads(fd: int, size: int, record: int, seconds: float, threads: int) -> float:
    slots = max(1, (size - record) // PAGE)
    done = [0] * threads
    deadline = time.perf_counter() + seconds

    def reader(i: int) -> None:
        rng = np.random.default_rng(i)
        view = memoryview(aligned_empty(record))  # type: ignore[arg-type]
        while True:  # one read at least: a thread that starts past the deadline (a busy machine) still counts
            done[i] += os.preadv(fd, [view], int(rng.integers(0, slots)) * PAGE)
            if time.perf_counter() >= deadline:
                break

    start = time.perf_counter()
    workers = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(done) / max(time.perf_counter() - start, 1e-9)
