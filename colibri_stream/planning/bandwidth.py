"""This machine's memory and disk read bandwidth, measured by two short probes (each under ~2 s), for
`plan`'s expected decode speed. Measured once per process and per filesystem.

    memory: copy of a 256 MiB numpy array, best of three; 2 x bytes / s (read + write traffic)
    disk:   a 256 MiB temporary file written beside the model, then read back with O_DIRECT (F_NOCACHE on
            macOS) where the filesystem allows (else buffered after fsync + fadvise DONTNEED where there is
            fadvise); bytes / s
    spread: per part directory of a spread container, random record-sized O_DIRECT reads
            (storage.container.probe), combined by each device's share of the reads
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.container.probe import open_for_reads, probe_directory, probe_file
from storage.container.reader import Container, is_container
from storage.files.buffers import aligned_empty

PROBE_BYTES = 256 * 2**20
CHUNK_BYTES = 8 * 2**20
PHASE_SECONDS = 0.9  # the disk probe stops writing, then reading, after this long


@dataclass(frozen=True)
class Bandwidth:
    memory_bytes_per_s: float
    disk_bytes_per_s: float
    disk_method: str  # how the probe read (storage.container.probe.open_for_reads), or "given" when injected


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
    with probe_file(directory, PHASE_SECONDS) as (path, size):
        fd, method = open_for_reads(path)
        try:
            return _timed_read(fd, size), method
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


@dataclass(frozen=True)
class DeviceShare:
    """One device of a spread container: its measured random-read speed and the share of expert reads
    it serves at 0% hits (records whose primary copy is there; a mirrored record counts for each copy)."""

    directory: str
    bytes_per_s: float
    share: float


def device_shares(path: str | Path) -> list[DeviceShare]:
    """Per part directory of a spread container at ``path``; [] for anything else. Each device's speed
    is measured with random record-sized O_DIRECT reads (storage.container.probe), once per filesystem."""
    path = Path(path)
    if not is_container(path):
        return []
    container = Container(path)
    parts = container.parts
    if parts is None:
        return []
    served = [0.0] * len(parts.dirs)
    for _, where in parts.records():
        for part in where:
            served[part] += 1 / len(where)
    total = sum(served)
    return [
        DeviceShare(str(d), _random_read_cached(os.stat(d).st_dev, d, container.layout.record_bytes), s / total)
        for d, s in zip(parts.dirs, served, strict=True)
    ]


@functools.cache
def _random_read_cached(device: int, directory: Path, record_bytes: int) -> float:
    del device  # the cache key: one probe per filesystem
    return probe_directory(directory, record_bytes).bytes_per_s


def combined_disk_bandwidth(shares: list[DeviceShare]) -> float:
    """Bytes/s the devices deliver together when each serves its share: the sum of their speeds when the
    shares match the speeds, less when one device has more than its share (decode waits for it)."""
    return min(d.bytes_per_s / d.share for d in shares if d.share > 0)
