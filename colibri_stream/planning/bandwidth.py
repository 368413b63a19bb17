"""This machine's memory and disk read bandwidth, measured by two short probes (each under ~2 s), for
`plan`'s expected decode speed. Measured once per process and per filesystem.

    memory: copy of a 256 MiB numpy array, best of three; 2 x bytes / s (read + write traffic)
    disk:   a 256 MiB temporary file written beside the model, then read back with O_DIRECT where the
            filesystem allows (else buffered after fsync + fadvise DONTNEED); bytes / s
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.buffers import aligned_empty

PROBE_BYTES = 256 * 2**20
CHUNK_BYTES = 8 * 2**20
PHASE_SECONDS = 0.9  # the disk probe stops writing, then reading, after this long


@dataclass(frozen=True)
class Bandwidth:
    memory_bytes_per_s: float
    disk_bytes_per_s: float
    disk_method: str  # "O_DIRECT", "buffered", or "given" when injected


def memory_bandwidth(n_bytes: int = PROBE_BYTES) -> float:
    """Copy bandwidth in bytes/s (read + write): the best of three copies; the first one also faults the
    target's pages in, so in practice the best is one of the other two."""
    source = np.ones(n_bytes // 8, dtype=np.float64)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * n_bytes / best


def disk_bandwidth(directory: Path) -> tuple[float, str]:
    """Read bandwidth of ``directory``'s filesystem in bytes/s, and how it was read."""
    with _probe_file(directory) as (path, size):
        direct = _open_direct(path)
        if direct is not None:
            try:
                return _timed_read(direct, size), "O_DIRECT"
            except OSError:  # refused at read time: some filesystems accept only the open
                pass
            finally:
                os.close(direct)
        _drop_cache(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            return _timed_read(fd, size), "buffered"
        finally:
            os.close(fd)


@functools.cache
def _disk_bandwidth_cached(device: int, directory: Path) -> tuple[float, str]:
    del device  # the cache key: one probe per filesystem
    return disk_bandwidth(directory)


def measure(path: str | Path) -> Bandwidth:
    """Both probes; the disk one on the filesystem of ``path`` (its directory), else the working directory."""
    directory = _writable_directory(Path(path))
    disk, method = _disk_bandwidth_cached(os.stat(directory).st_dev, directory)
    return Bandwidth(_memory_bandwidth_cached(), disk, method)


@functools.cache
def _memory_bandwidth_cached() -> float:
    return memory_bandwidth()


def _writable_directory(path: Path) -> Path:
    start = path if path.is_dir() else path.parent
    for candidate in (start, Path.cwd(), Path(tempfile.gettempdir())):
        if candidate.is_dir() and os.access(candidate, os.W_OK):
            return candidate
    raise OSError(f"no writable directory near {path} to probe the disk")


@contextlib.contextmanager
def _probe_file(directory: Path) -> Iterator[tuple[Path, int]]:
    """A temporary file of up to PROBE_BYTES (less when the disk is slow), synced to the device."""
    fd, name = tempfile.mkstemp(prefix=".colibri-probe-", dir=directory)
    chunk = aligned_empty(CHUNK_BYTES, 4096)
    chunk[:] = np.random.default_rng(0).integers(0, 255, CHUNK_BYTES, dtype=np.uint8)
    written, start = 0, time.perf_counter()
    try:
        while written < PROBE_BYTES and (time.perf_counter() - start) < PHASE_SECONDS:
            written += os.write(fd, chunk)  # type: ignore[arg-type]  # numpy: a Buffer only on >= 3.12
        os.fsync(fd)
        os.close(fd)
        yield Path(name), written
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
        os.unlink(name)


def _open_direct(path: Path) -> int | None:
    flag = getattr(os, "O_DIRECT", 0)  # reflection: Linux only
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):  # reflection: not on macOS
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed_read(fd: int, size: int) -> float:
    buffer = aligned_empty(CHUNK_BYTES, 4096)
    view = memoryview(buffer)  # type: ignore[arg-type]  # numpy: a Buffer only on >= 3.12
    done, start = 0, time.perf_counter()
    while done < size and (time.perf_counter() - start) < PHASE_SECONDS:
        n = os.preadv(fd, [view], done)
        if n <= 0:
            break
        done += n
    return done / max(time.perf_counter() - start, 1e-9)
