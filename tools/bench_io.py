"""Cold expert-record reads, side by side in one run: raw `dd iflag=direct`, our reader on a thread
pool (buffered and O_DIRECT), one thread, and aiofiles. The page cache is dropped before each
contender (needs root; otherwise the numbers are warm and say so). aiofiles is the contender the
thread pool was chosen over (docs/storage.md), not a dependency: `pip install aiofiles` to run this.

    python tools/bench_io.py CONTAINER [--records 64] [--threads 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import aiofiles

from colibri_stream.bench.system import drop_page_cache
from storage.container.reader import Container, ExpertReader
from storage.files.buffers import aligned_empty
from storage.files.page_cache import Bypass


def timed(fn) -> float:
    drop_page_cache()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("container")
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    container = Container(args.container)
    layer = container.moe_layers[len(container.moe_layers) // 2]
    keys = [(layer, e) for e in range(min(args.records, container.n_experts))]
    size = container.layout.record_bytes
    buffers = [aligned_empty(size) for _ in keys]
    paths = [str(container.expert_path(*k)) for k in keys]

    def dd() -> None:
        for path in paths:
            subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct", "status=none"], check=True)

    def pool(direct: bool) -> None:
        reader = ExpertReader(container, Bypass.O_DIRECT if direct else Bypass.NONE, verify=False)
        with ThreadPoolExecutor(args.threads) as executor:
            list(executor.map(lambda kb: reader.read_into(*kb[0], kb[1]), zip(keys, buffers, strict=True)))

    def one_thread() -> None:
        reader = ExpertReader(container, verify=False)
        for key, buffer in zip(keys, buffers, strict=True):
            reader.read_into(*key, buffer)

    async def with_aiofiles() -> None:
        async def read(path: str, buffer) -> None:
            async with aiofiles.open(path, "rb", buffering=0) as f:
                await f.readinto(memoryview(buffer))

        await asyncio.gather(*(read(p, b) for p, b in zip(paths, buffers, strict=True)))

    contenders = {
        "dd_iflag_direct": dd,
        "thread_pool_odirect": lambda: pool(True),
        "thread_pool_buffered": lambda: pool(False),
        "one_thread_buffered": one_thread,
        "aiofiles_buffered": lambda: asyncio.run(with_aiofiles()),
    }
    total = len(keys) * size
    cold = drop_page_cache()
    result = {"records": len(keys), "record_bytes": size, "page_cache_dropped": cold}
    for name, fn in contenders.items():
        result[f"{name}_MBps"] = round(total / timed(fn) / 1e6, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
