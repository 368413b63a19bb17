"""Whether a loaded model reads ahead during decode: the kernels' idle helper thread reading the next
layer's weights and guessed experts into the CPU caches while Python runs (engine/kernels/read_ahead.py).

It pays only where those bytes stay in the last-level cache until the kernels read them, beside the
current layer's. On the stress model (int8 activations, experts in RAM, 2 threads), where one request
names ~31 MB (a layer's dense part and six guessed experts), it saved time per token on a host with a
480 MB L3 and cost time on an AMD EPYC with 32 MB of L3 per core complex, even reading the dense part
alone (docs/kernels.md, "Read-ahead into the caches").
So a model reads ahead when the cache holds one request CACHE_SHARE times over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.core.interfaces import Model

CACHE_SHARE = 4
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(caches: Path = CPU_CACHES) -> int | None:
    """The size of the highest-level cache the first CPU uses (the L3 of its core complex, not the sum
    over the socket that sysconf reports on some AMD machines); None where sysfs does not say."""
    best: tuple[int, int] | None = None
    for index in caches.glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = _size_bytes((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, size)
    return None if best is None else best[1]


def _size_bytes(text: str) -> int:
    """sysfs cache sizes: "32768K", "1M", or plain bytes."""
    text = text.strip().upper()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def choose_read_ahead(model: Model[Any], experts_per_token: int, expert_bytes: int, cache_bytes: int | None) -> bool:
    """Sets ``model.read_ahead`` for this machine's cache (None: unknown, no read-ahead) and returns it;
    never for a model that does not read ahead."""
    request = model.read_ahead_bytes(experts_per_token, expert_bytes)
    model.read_ahead = request is not None and cache_bytes is not None and cache_bytes >= CACHE_SHARE * request
    return model.read_ahead
