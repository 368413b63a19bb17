"""Which SIMD loops the C kernels take: the CPU's best, or AVX2 where COLIBRI_STREAM_ISA=avx2 caps them.

The cap lets one host measure what a host without AVX-512 gets: every quantised and bf16 kernel has AVX2
loops beside its AVX-512 ones (tests hold them to the same bits), and with the cap the extension takes
those (torch's own ops follow ATEN_CPU_CAPABILITY=avx2; docs/benchmarks-log.md). The C side reads the variable
once, when the extension loads (engine/csrc/nibble.c isa_cap); ``check_isa_env`` runs first, from
engine/__init__.py, so a misspelt value is refused rather than read as no cap.
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
    return f"{words} (capped by {ISA_ENV}=avx2)" if ISA_CAP < 2 else words  # the cap the extension read
