"""Which SIMD loops the C kernels take: the CPU's best, or AVX2 where COLIBRI_STREAM_ISA=avx2 caps them.

The cap lets one host measure a host without AVX-512. C reads the variable once, at load;
``check_isa_env`` runs first (engine/__init__.py) so a misspelt value is refused, not read as no cap.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ISA_ENV = "COLIBRI_STREAM_ISA"
ISA_CAPS = ("best", "avx2")
LEVEL_NAMES = ("plain C", "AVX2", "AVX-512")  # _kernels.SIMD_LEVEL's values


def check_isa_env(environ: Mapping[str, str] = os.environ) -> None:
    value = environ.get(ISA_ENV)
    if value is not None and value not in ISA_CAPS:
        raise ValueError(f"{ISA_ENV}={value!r}: expected one of {', '.join(ISA_CAPS)} (or unset)")


def kernel_isa() -> str:
    """The loops the kernels take here, in words (`doctor`)."""
    try:
        from engine.kernels._kernels import ISA_CAP, Q8_VNNI, SIMD_LEVEL
    except ImportError:  # pragma: no cover - machines without a compiler
        return "no C extension: torch ops only"
    words = LEVEL_NAMES[SIMD_LEVEL] + (" VNNI" if Q8_VNNI else "")
    return f"{words} (capped by {ISA_ENV}=avx2)" if ISA_CAP < 2 else words
