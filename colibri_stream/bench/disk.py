"""Section 1 of the bench: what the disk can do, and how much of it our cold expert reads get.

Raw contenders use the least code possible between the program and the device: O_DIRECT (no page
cache), file descriptors opened before the clock starts, ``preadv`` into 4 KiB-aligned buffers.
  - sequential: one large scratch file read front to back in 8 MiB blocks (the device's best case);
  - expert-sized random reads: whole container record files, a random sample read layer by layer
    (the order a cold prefill asks for them), with as many reads in flight as the store has threads.
Ours: the tiered store itself acquiring the same records cold (page cache dropped), each acquire
one layer's worth of experts, checksums on, as prefill does; O_DIRECT (the default) and buffered.
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from colibri_stream.bench.system import drop_page_cache
from storage.container.reader import Container
from storage.files.buffers import aligned_empty
from storage.tiers.config import StoreConfig
from storage.tiers.tiered import TieredExpertStore

BLOCK = 8 << 20
HUGE_PAGE = 2 << 20


def raw_sequential(scratch: Path, size: int) -> dict:
    """MB/s of one O_DIRECT pass over a ``size``-byte file written (and written back) first."""
    size -= size % BLOCK
    _write_scratch(scratch, size)
    drop_page_cache()
    buffer = aligned_empty(BLOCK)
    fd = os.open(scratch, os.O_RDONLY | os.O_DIRECT)
    try:
        start = time.perf_counter()
        done = 0
        while done < size:
            got = os.preadv(fd, [memoryview(buffer)], done)  # type: ignore[arg-type]  # numpy: a Buffer only on >= 3.12
            if got <= 0:
                break
            done += got
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        scratch.unlink()
    return {"bytes": done, "seconds": round(elapsed, 4), "MBps": round(done / elapsed / 1e6, 1)}


def _write_scratch(path: Path, size: int) -> None:
    block = os.urandom(BLOCK)  # incompressible, so no layer below can shortcut the reads
    with open(path, "wb") as f:
        for _ in range(size // BLOCK):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def disjoint_samples(container: Container, count: int, samples: int, seed: int = 0) -> list[list[tuple[int, int]]]:
    """``samples`` disjoint sets of ``count`` random records, each grouped by layer (each layer's
    experts in random order: the order the store's acquires use). Disjoint, so no contender reads
    records a previous one left in a cache below the guest's page cache (a VM host's, a drive's)."""
    keys = [(layer, e) for layer in container.moe_layers for e in range(container.n_experts)]
    random.Random(seed).shuffle(keys)
    count = min(count, len(keys) // samples)
    order = {layer: i for i, layer in enumerate(container.moe_layers)}
    return [sorted(keys[i * count : (i + 1) * count], key=lambda k: order[k[0]]) for i in range(samples)]


def raw_expert_reads(container: Container, keys: list[tuple[int, int]], threads: int) -> dict:
    """MB/s of whole-record O_DIRECT reads, ``threads`` in flight, descriptors opened and destination
    memory faulted in before the clock (first-touch faults during the DMA cost up to 3x here)."""
    size = container.layout.record_bytes
    fds = [os.open(container.expert_path(*key), os.O_RDONLY | os.O_DIRECT) for key in keys]
    block = aligned_empty(len(keys) * size, HUGE_PAGE)
    block.fill(0)
    drop_page_cache()

    def read(i: int) -> int:
        return os.preadv(fds[i], [memoryview(block[i * size : (i + 1) * size])], 0)  # type: ignore[arg-type]  # numpy: a Buffer only on >= 3.12

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            got = sum(pool.map(read, range(len(fds))))
        elapsed = time.perf_counter() - start
    finally:
        for fd in fds:
            os.close(fd)
    return _rate(got, elapsed, len(keys), threads)


def our_cold_reads(container: Container, keys: list[tuple[int, int]], threads: int, direct: bool) -> dict:
    """MB/s of the store serving ``keys`` cold, one acquire per layer (prefill's pattern), slots
    enough for one acquire, crc32c verified on first read."""
    by_layer: dict[int, list[int]] = {}
    for layer, expert in keys:
        by_layer.setdefault(layer, []).append(expert)
    widest = max(len(experts) for experts in by_layer.values())
    ram = max(widest, container.n_experts) * container.layout.record_bytes
    # no preload: the reads timed are the acquires', into slots faulted in beforehand
    config = StoreConfig(ram_bytes=ram, prefetch=False, direct=direct, threads=threads, preload=False)
    store = TieredExpertStore(container, config, materialize=lambda slot: slot)
    drop_page_cache()
    try:
        start = time.perf_counter()
        for layer, experts in by_layer.items():
            acquired = store.acquire(layer, experts)
            for expert in experts:
                acquired[expert]  # waits for that read
            store.release(layer, experts)
        elapsed = time.perf_counter() - start
    finally:
        store.close()
    read = store.stats.expert_bytes_read
    return {**_rate(read, elapsed, len(keys), threads), "direct": direct}


def _rate(nbytes: int, seconds: float, records: int, threads: int) -> dict:
    return {
        "records": records,
        "bytes": nbytes,
        "threads": threads,
        "seconds": round(seconds, 4),
        "MBps": round(nbytes / seconds / 1e6, 1),
    }


def disk_section(container: Container, scratch: Path, sequential_bytes: int, records: int, threads: int) -> dict:
    """Raw sequential, raw expert-sized random, and ours (buffered and O_DIRECT) on the same records."""
    raw_keys, direct_keys, buffered_keys = disjoint_samples(container, records, 3)
    result = {
        "raw_sequential_odirect": raw_sequential(scratch, sequential_bytes),
        "raw_expert_random_odirect": raw_expert_reads(container, raw_keys, threads),
        "ours_cold_odirect": our_cold_reads(container, direct_keys, threads, direct=True),
        "ours_cold_buffered": our_cold_reads(container, buffered_keys, threads, direct=False),
    }
    # The headline uses the store's default (O_DIRECT) reads: what a user gets without tuning.
    raw = result["raw_expert_random_odirect"]["MBps"]
    ours = result["ours_cold_odirect"]["MBps"]
    result["io_efficiency"] = round(ours / raw, 3)
    result["io_efficiency_buffered"] = round(result["ours_cold_buffered"]["MBps"] / raw, 3)
    result["io_efficiency_vs_sequential"] = round(ours / result["raw_sequential_odirect"]["MBps"], 3)
    return result
