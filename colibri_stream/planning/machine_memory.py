"""The memory this process may use: the machine's (psutil), capped by the memory cgroup it runs in.

A container (`docker run --memory`, a systemd slice, the bench's limits) caps a process below what
/proc/meminfo shows: MemAvailable there is the host's. `--ram auto` sized from it plans expert slots
the kernel then kills the process for, and `plan` says "fits" for a run that cannot. Here both cgroup
versions are read at every level from the process's group up to the mount root, the tightest level
wins, and the page cache a group could drop (its inactive file pages) counts as available, as
MemAvailable counts it. Where a container shows its own group at the mount root (no cgroup
namespace path on disk), that root is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from storage.files.io_features import Feature, enabled

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
UNLIMITED_FROM = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1
# a level's limit, usage and reclaimable page cache (a key of its memory.stat), per cgroup version
V1_NAMES = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
V2_NAMES = ("memory.max", "memory.current", "inactive_file")


@dataclass(frozen=True)
class MemoryCap:
    """The tightest memory cgroup level above this process."""

    limit_bytes: int
    available_bytes: int  # limit - usage + inactive file pages, at that level
    source: str  # the limit's file, for messages


@dataclass(frozen=True)
class MemoryHere:
    total_bytes: int  # the machine's RAM, or the cgroup limit where lower
    available_bytes: int  # MemAvailable, or the cgroup's headroom where lower
    cap: MemoryCap | None  # the cgroup level that set them, when one does


def memory_here() -> MemoryHere:
    """The machine's memory (psutil: every OS), capped by the cgroup where cgroups and /proc are on
    (storage/files/io_features.py: the process's group is found in /proc/self/cgroup); without them, the
    machine's alone, as on macOS."""
    memory = psutil.virtual_memory()
    cap = cgroup_cap() if enabled(Feature.CGROUPS) and enabled(Feature.PROC) else None
    if cap is None:
        return MemoryHere(memory.total, memory.available, None)
    return MemoryHere(min(memory.total, cap.limit_bytes), min(memory.available, cap.available_bytes), cap)


def cgroup_cap(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> MemoryCap | None:
    """The tightest limited level of this process's memory cgroup, or None (no limit, no cgroup fs)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    levels = _levels(lines, root)
    caps = [cap for cap in map(_level_cap, levels) if cap is not None]
    return min(caps, key=lambda cap: cap.available_bytes, default=None)


def _levels(lines: list[str], root: Path) -> list[tuple[Path, bool]]:
    """(directory, is v2) from the process's group up to the mount root: v1's memory controller where
    mounted, else the unified (v2) hierarchy."""
    entries = [parts for parts in (line.split(":", 2) for line in lines) if len(parts) == 3]
    for _, controllers, path in entries:
        if "memory" in controllers.split(","):
            return [(d, False) for d in _up_from(root / "memory", path)]
    for hierarchy, controllers, path in entries:
        if hierarchy == "0" and controllers == "":
            return [(d, True) for d in _up_from(root, path)]
    return []


def _up_from(mount: Path, relative: str) -> list[Path]:
    group = mount / relative.strip().lstrip("/")
    while group != mount and not group.is_dir():  # a container's own group, shown at the mount root
        group = group.parent
    levels = [group]
    while levels[-1] != mount:
        levels.append(levels[-1].parent)
    return levels


def _level_cap(level: tuple[Path, bool]) -> MemoryCap | None:
    group, v2 = level
    names = V2_NAMES if v2 else V1_NAMES
    limit_file = group / names[0]
    limit = _read_int(limit_file)
    usage = _read_int(group / names[1])
    if limit is None or limit >= UNLIMITED_FROM or usage is None:
        return None
    reclaimable = _stat(group / "memory.stat").get(names[2], 0)
    return MemoryCap(limit, max(0, limit - usage + reclaimable), str(limit_file))


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None where the file is missing, unreadable or says "max"."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.split() for line in lines)
    return {pair[0]: int(pair[1]) for pair in pairs if len(pair) == 2 and pair[1].isdigit()}
