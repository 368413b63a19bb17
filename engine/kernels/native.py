"""The C extension (engine/csrc/ as engine.kernels._kernels), imported once for every wrapper.

A build is whole or absent: wrappers ask ``_kernels is not None``, never for one function. A build of
another ``ABI_VERSION`` (a stale .so) counts as absent, with a warning; the torch paths then run.
"""

from __future__ import annotations

import warnings

ABI_VERSION = 8  # raise with kernels.c's when an entry point or signature changes

try:
    from engine.kernels import _kernels
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    _kernels = None  # type: ignore[assignment]
else:
    _found = _kernels.ABI_VERSION if hasattr(_kernels, "ABI_VERSION") else 0  # reflection: stale builds lack it
    if _found != ABI_VERSION:  # pragma: no cover - a stale build
        warnings.warn(
            f"engine.kernels._kernels is ABI {_found}, these sources expect {ABI_VERSION}: using the torch "
            "paths (rebuild with `pip install -e .`)",
            stacklevel=2,
        )
        _kernels = None  # type: ignore[assignment]

BUILT = _kernels is not None
"""Whether the C kernels run here (a whole build of this ABI)."""

__all__ = ["ABI_VERSION", "BUILT", "_kernels"]
