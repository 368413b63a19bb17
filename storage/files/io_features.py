"""The platform features the I/O and memory code uses where the OS has them, and the knob that turns them off.

    o_direct   os.O_DIRECT: expert reads past the page cache (Linux; the filesystem must take it)
    f_nocache  fcntl F_NOCACHE: the same on macOS, which has no O_DIRECT
    fadvise    os.posix_fadvise: drop a file's cached pages (Linux; not macOS)
    cgroups    /sys/fs/cgroup: a container's memory limit below the machine's RAM (Linux)
    proc       /proc/self: peak RSS, USS and anonymous RSS read cheaply (Linux)

Each has a fallback where it is used (docs/storage.md, "Platform features and their fallbacks"). The knob
COLIBRI_STREAM_IO_FEATURES=-o_direct,-fadvise,-cgroups,-proc turns the named ones off where the OS has them,
so a Linux host runs the paths macOS takes (the tests do); nothing turns on a feature the OS lacks. A
misspelt value is refused (SettingError naming the knob), never read as "no change". The knob is read each
time a choice is made (opening a store, sizing a budget), never cached, so a test may set it.
"""

from __future__ import annotations

import enum
import fcntl
import os
import sys
from collections.abc import Mapping

from storage.errors import SettingError

IO_FEATURES_ENV = "COLIBRI_STREAM_IO_FEATURES"


class Feature(enum.StrEnum):
    O_DIRECT = "o_direct"
    F_NOCACHE = "f_nocache"
    FADVISE = "fadvise"
    CGROUPS = "cgroups"
    PROC = "proc"


def switched_off(environ: Mapping[str, str] = os.environ) -> frozenset[Feature]:
    """The features the knob turns off: a comma-separated list of ``-name``."""
    off = set()
    for item in environ.get(IO_FEATURES_ENV, "").split(","):
        item = item.strip()
        if not item:
            continue
        if not item.startswith("-") or item[1:] not in {f.value for f in Feature}:
            names = ", ".join(f"-{f}" for f in Feature)
            raise SettingError(f"{IO_FEATURES_ENV}: {item!r}: expected a comma-separated list of {names} (or unset)")
        off.add(Feature(item[1:]))
    return frozenset(off)


def offered(feature: Feature) -> bool:
    """Whether this OS has ``feature`` at all, whatever the knob says."""
    if feature is Feature.O_DIRECT:
        return hasattr(os, "O_DIRECT")  # reflection: an OS constant, Linux only among the targets
    if feature is Feature.F_NOCACHE:
        return nocache_command() is not None
    if feature is Feature.FADVISE:
        return hasattr(os, "posix_fadvise")  # reflection: not on macOS
    return sys.platform.startswith("linux")  # cgroups and /proc/self: files, read where they exist


def nocache_command() -> int | None:
    """fcntl's F_NOCACHE command number; None where the OS has none (everywhere but macOS)."""
    command: int | None = getattr(fcntl, "F_NOCACHE", None)  # reflection: an OS constant, macOS only
    return command


def enabled(feature: Feature, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the code may use ``feature`` here: the OS has it and the knob leaves it on."""
    return offered(feature) and feature not in switched_off(environ)


def feature_states(environ: Mapping[str, str] = os.environ) -> dict[Feature, str]:
    """Each feature in words, for `doctor`: "on", "off (COLIBRI_STREAM_IO_FEATURES)" or "absent"."""
    off = switched_off(environ)
    return {f: "absent" if not offered(f) else f"off ({IO_FEATURES_ENV})" if f in off else "on" for f in Feature}
