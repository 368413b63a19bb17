"""crc32c (Castagnoli) over any buffer, hardware-accelerated, no copy (the `crc32c` package)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import crc32c as _crc32c

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Buffer


def crc32c(data: Buffer | np.ndarray, value: int = 0) -> int:
    """crc32c of a bytes-like object (bytes, memoryview, contiguous numpy array), extending ``value``."""
    return _crc32c.crc32c(data, value)  # type: ignore[arg-type]  # numpy types ndarray as a Buffer only for Python >= 3.12
