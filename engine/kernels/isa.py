"""Which SIMD loops the C kernels take: the CPU's best, or one level down where COLIBRI_STREAM_ISA caps them.

x86: AVX-512 (and VNNI, and AMX for a prompt's tile products) or AVX2, ``COLIBRI_STREAM_ISA=avx2`` holding them to
AVX2, ``=avx512`` to AVX-512 without AMX. aarch64: NEON with the
dot-product instructions or plain NEON, ``=neon`` holding them to plain NEON (``dotprod``: no cap, as ``best``).
The cap lets one host measure a lesser one. C reads the variable once, at load; ``check_isa_env`` runs first
(engine/__init__.py) so a misspelt value, or another architecture's name, is refused, not read as no cap.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping

ISA_ENV = "COLIBRI_STREAM_ISA"
X86_CAPS = ("best", "avx2", "avx512")
ARM_CAPS = ("best", "neon", "dotprod")
# _kernels.SIMD_LEVEL's values, per architecture
X86_LEVELS = ("plain C", "AVX2", "AVX-512")
ARM_LEVELS = ("plain C", "NEON", "NEON dot-product")


def is_arm(machine: str | None = None) -> bool:
    return (platform.machine() if machine is None else machine).lower() in ("aarch64", "arm64")


def isa_caps(machine: str | None = None) -> tuple[str, ...]:
    return ARM_CAPS if is_arm(machine) else X86_CAPS


def check_isa_env(environ: Mapping[str, str] = os.environ, machine: str | None = None) -> None:
    value, caps = environ.get(ISA_ENV), isa_caps(machine)
    if value is not None and value not in caps:
        raise ValueError(f"{ISA_ENV}={value!r}: expected one of {', '.join(caps)} (or unset)")


def describe_isa(
    level: int, cap: int, vnni: bool, arm_features: int, machine: str | None = None, amx: bool = False
) -> str:
    """The kernels' loops in words from the extension's constants (SIMD_LEVEL, ISA_CAP, Q8_VNNI, ARM_FEATURES,
    Q8_AMX)."""
    arm = is_arm(machine)
    words = (ARM_LEVELS if arm else X86_LEVELS)[level] + (" VNNI" if vnni else "") + (", AMX tiles" if amx else "")
    if arm and arm_features & 2:  # SMMLA would sum other lanes than the x86 loops: docs/kernels.md "ARM (NEON)"
        words += " (i8mm present, not used)"
    return f"{words} (capped by {ISA_ENV}={isa_caps(machine)[1]})" if cap < 2 else words


def kernel_isa() -> str:
    """The loops the kernels take here, in words (`doctor`)."""
    from engine.kernels.native import _kernels

    if _kernels is None:  # pragma: no cover - machines without a compiler, or a stale build
        return "no C extension: torch ops only"
    return describe_isa(
        _kernels.SIMD_LEVEL, _kernels.ISA_CAP, bool(_kernels.Q8_VNNI), _kernels.ARM_FEATURES, amx=bool(_kernels.Q8_AMX)
    )
