"""crc32c (Castagnoli) over any buffer, hardware-accelerated, no copy (the `crc32c` package)."""

from __future__ import annotations

import crc32c as _crc32c


def crc32c(data, value: int = 0) -> int:
    """crc32c of a bytes-like object (bytes, memoryview, contiguous numpy array), extending ``value``."""
    return _crc32c.crc32c(data, value)
