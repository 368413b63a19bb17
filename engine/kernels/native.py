"""The C extension (engine/csrc/, built as engine.kernels._kernels), imported once for every wrapper.

A build is whole or absent: its ``ABI_VERSION`` names one set of entry points and signatures
(engine/kernels/_kernels.pyi), so a wrapper asks ``_kernels is not None``, never whether one function
exists. A build whose version differs (a stale .so beside newer sources) counts as absent: the torch
paths run, with the same results within float rounding, and a warning says why.
"""

from __future__ import annotations

import warnings

ABI_VERSION = 4  # kernels.c's ABI_VERSION: raise both together when an entry point or signature changes

try:  # built at install time where a compiler is there
    from engine.kernels import _kernels
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    _kernels = None  # type: ignore[assignment]  # no C extension: every wrapper checks for None first
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
