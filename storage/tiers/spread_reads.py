"""Expert reads over several devices at once: one read queue per part directory of a spread container.

Each read goes to the device that should deliver it first: a record with one copy to its device; a
mirrored one to the copy whose device has the fewest bytes in flight for its speed ((in-flight bytes +
record) / weight, weights from the parts manifest: measured bandwidths). Every device has its own
``ReadQueue`` (``threads`` readers each, demand before prefetch), so all devices are busy at once.

A copy that fails its read or checksum is counted as that device's fallback and the next copy is read
(never a wrong token); a record whose every copy fails is one CorruptDataError naming each device.
Counters per device (reads, bytes, busy time, service time, fallbacks) are measured here.

Only a spread container pays for this: a whole one is read by the tiered store's single queue as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from storage.container.parts import Parts
from storage.container.reader import Container, read_record_file
from storage.errors import CorruptDataError
from storage.files.checksum import crc32c
from storage.files.page_cache import Bypass, file_bypass
from storage.tiers.read_queue import ReadQueue
from storage.tiers.stats import DeviceStats

Key = tuple[int, int]


class _Device:
    """One part directory: its queue, what is in flight on it, and its counters."""

    def __init__(self, name: str, part: int, threads: int, weight: float, bypass: Bypass):
        self.name, self.weight, self.bypass = name, weight, bypass
        self.queue = ReadQueue(threads, name=f"expert-io-d{part}")
        self.in_flight = 0  # bytes queued or being read here (guarded by SpreadReads' lock)
        self.lock = threading.Lock()
        self.running = 0
        self.busy_since = 0.0
        self.stats = DeviceStats(name)

    def begin(self) -> float:
        now = time.perf_counter()
        with self.lock:
            if self.running == 0:
                self.busy_since = now
            self.running += 1
        return now

    def end(self, start: float, nbytes: int, ok: bool) -> None:
        now = time.perf_counter()
        with self.lock:
            self.running -= 1
            busy = now - self.busy_since if self.running == 0 else 0.0
            if self.running == 0:
                self.busy_since = now
            s = self.stats
            self.stats = DeviceStats(
                s.device,
                s.reads + ok,
                s.bytes + (nbytes if ok else 0),
                s.busy_s + busy,
                s.service_s + now - start,
                s.fallbacks + (not ok),
            )


class SpreadReads:
    """submit / promote / cancel / shutdown over one ReadQueue per device (see the module doc)."""

    def __init__(
        self,
        container: Container,
        parts: Parts,
        threads: int,
        direct: bool,
        verify: bool = True,
        on_read: Callable[[float], None] = lambda seconds: None,
    ):
        self.container = container
        self.on_read = on_read  # the store's counters: called with the read's seconds once a record landed
        self.parts = parts
        self.size = container.layout.record_bytes
        self.verify = verify
        self._lock = threading.Lock()
        self._owner: dict[Future[None], _Device] = {}
        self._verified: set[tuple[int, int, int]] = set()  # (layer, expert, part): each copy checked once
        self.devices = [
            _Device(parts.device_name(p), p, threads, parts.weights[p], self._bypass(p) if direct else Bypass.NONE)
            for p in range(len(parts.dirs))
        ]

    def _bypass(self, part: int) -> Bypass:
        """How reads on one device pass the page cache, from a read of one of its records."""
        for key, where in self.parts.records():
            if part in where:
                return file_bypass(self.container.expert_copies(*key)[where.index(part)][1])
        return Bypass.NONE

    @property
    def bypass(self) -> Bypass:
        """The devices' way past the page cache where they share one, else none (one device reads cached)."""
        modes = {d.bypass for d in self.devices}
        return modes.pop() if len(modes) == 1 else Bypass.NONE

    def submit(self, key: Key, slot: np.ndarray, demand: bool = True) -> Future[None]:
        copies = self.container.expert_copies(*key)
        with self._lock:
            first = min(range(len(copies)), key=lambda i: self._eta(copies[i][0]))
            device = self.devices[copies[first][0]]
            device.in_flight += self.size
        order = copies[first:] + copies[:first]
        future = device.queue.submit(lambda: self._read(key, order, slot), demand)
        with self._lock:
            self._owner[future] = device
        future.add_done_callback(self._done)
        return future

    def _eta(self, part: int) -> float:
        device = self.devices[part]
        return (device.in_flight + self.size) / device.weight

    def _done(self, future: Future[None]) -> None:
        with self._lock:
            device = self._owner.pop(future, None)
            if device is not None:
                device.in_flight -= self.size

    def promote(self, future: Future[None]) -> None:
        device = self._owner.get(future)
        if device is not None:
            device.queue.promote(future)

    def cancel(self, future: Future[None]) -> bool:
        device = self._owner.get(future)
        return device.queue.cancel(future) if device is not None else False

    def shutdown(self) -> None:
        for device in self.devices:
            device.queue.shutdown()

    def stats(self) -> tuple[DeviceStats, ...]:
        return tuple(device.stats for device in self.devices)

    def _read(self, key: Key, copies: tuple[tuple[int, Path], ...], slot: np.ndarray) -> None:
        errors, began = [], time.perf_counter()
        for part, path in copies:
            device = self.devices[part]
            start = device.begin()
            ok = False
            try:
                data = read_record_file(path, key[0], key[1], slot, self.size, device.bypass)
                self._check(key, part, path, data)
                ok = True
                self.on_read(time.perf_counter() - began)
                return
            except CorruptDataError as exc:
                errors.append(f"{exc} (device {device.name})")
            finally:
                device.end(start, self.size, ok)
        if len(errors) == 1:
            raise CorruptDataError(errors[0])
        raise CorruptDataError(f"layer {key[0]} expert {key[1]}: every copy failed: " + "; ".join(errors))

    def _check(self, key: Key, part: int, path: Path, data: memoryview) -> None:
        if not self.verify or (*key, part) in self._verified:
            return
        if crc32c(data) != self.container.expert_checksum(*key):
            raise CorruptDataError(f"layer {key[0]} expert {key[1]}: checksum mismatch in {path}")
        with self._lock:
            self._verified.add((*key, part))
