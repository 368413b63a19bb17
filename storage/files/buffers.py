"""Aligned host buffers: np.empty/bytearray start 16 bytes off a 64-byte boundary, which made reads
much slower (docs/benchmarks-log.md, "Figures behind the code"), and O_DIRECT needs 4 KiB alignment of the
destination."""

from __future__ import annotations

import numpy as np

PAGE = 4096


def aligned_empty(nbytes: int, alignment: int = PAGE) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` whose data pointer is a multiple of ``alignment``."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes]


def is_aligned(buffer: np.ndarray, alignment: int) -> bool:
    return buffer.ctypes.data % alignment == 0
