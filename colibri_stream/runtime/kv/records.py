"""Between a cache and the bytes the KV files hold: a position's record payload (the rows of a record log
and of a prefix block) and the series of a lean log, in the record dtype; and ``RestoredPrefix``, what a
turn starts from. The lowest room of colibri_stream/runtime/kv/: the others read and write through it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from colibri_stream.checkpoint.dtypes import bf16_bits, dtype_bytes, from_stored
from engine.config.args import ModelArgs
from engine.core.interfaces import Cache
from engine.families import family_of
from storage.kv.geometry import Geometry


@dataclass(frozen=True)
class RestoredPrefix:
    """A turn's start: ``cache`` holds the prompt's first ``reused_tokens`` positions (0: a new cache), read
    in ``kv_load_s``; ``prefix_ram`` + ``prefix_disk`` of them came from the prefix cache's tiers, the
    rest from the session (its log, or the pool's memory)."""

    cache: Cache
    reused_tokens: int
    kv_load_s: float = 0.0
    prefix_ram: int = 0
    prefix_disk: int = 0

    def sources(self, computed: int) -> dict[str, int]:
        """Where the turn's prompt positions came from (the stats' ``prompt_sources``), ``computed``: its
        prefill."""
        session = self.reused_tokens - self.prefix_ram - self.prefix_disk
        return {
            "session": session,
            "prefix_ram": self.prefix_ram,
            "prefix_disk": self.prefix_disk,
            "computed": computed,
        }


def as_bytes(t: torch.Tensor, dtype: str) -> np.ndarray:
    """[n, d] tensor -> [n, d * itemsize] uint8 in the record dtype."""
    if dtype == "bfloat16":
        return bf16_bits(t).view(np.uint8)
    return t.to(torch.float32).contiguous().numpy().view(np.uint8)


def from_bytes(b: np.ndarray, dtype: str, width: int) -> torch.Tensor:
    """[n, width * itemsize] uint8 -> float32 [n, width]."""
    raw = np.ascontiguousarray(b)
    values = from_stored(raw.view(np.uint16), dtype) if dtype == "bfloat16" else torch.from_numpy(raw.view(np.float32))
    return values.view(-1, width).float()


def cache_payloads(cache: Cache, start: int, end: int, geometry: Geometry) -> np.ndarray:
    """Positions start..end of batch row 0 as record payloads [n, payload_bytes] uint8 (CacheLog.rows)."""
    return np.concatenate([as_bytes(rows, geometry.dtype) for rows in cache.log_view().rows(start, end)], axis=1)


def cache_from_payloads(payloads: np.ndarray, geometry: Geometry, args: ModelArgs, dtype: torch.dtype) -> Cache:
    """The cache holding the positions whose record payloads [n, payload_bytes] are ``payloads``."""
    log = family_of(args).kv_log
    item, offset, rows = dtype_bytes(geometry.dtype), 0, []
    for width in log.log_row_widths():
        rows.append(from_bytes(payloads[:, offset : offset + width * item], geometry.dtype, width)[None])
        offset += width * item
    return log.cache_from_log(rows, dtype)
