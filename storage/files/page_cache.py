"""Reading past the page cache: the one place that picks how, for this platform and for one file.

    o_direct   open with O_DIRECT (Linux): the kernel reads into the aligned buffer and caches nothing
    f_nocache  a plain open, then fcntl(fd, F_NOCACHE, 1) (macOS, which has no O_DIRECT)
    none       a plain buffered read: the page cache keeps what was read (--buffered; a filesystem that
               refuses O_DIRECT, such as tmpfs; an OS with neither; COLIBRI_STREAM_IO_FEATURES)

The RAM slots are the cache the user budgeted for; the page cache holding the same bytes again would take
memory beyond the budget. Records are 4 KiB multiples at offset 0 read into 4 KiB-aligned buffers
(storage/files/buffers.py), which O_DIRECT requires and F_NOCACHE takes as they are. Dropping a file's
cached pages (posix_fadvise DONTNEED) is here too: the fallback where a read cannot bypass the cache.
"""

from __future__ import annotations

import enum
import fcntl
import os
from pathlib import Path

from storage.files.buffers import PAGE, aligned_empty
from storage.files.io_features import Feature, enabled, feature_states, nocache_command


class Bypass(enum.StrEnum):
    O_DIRECT = "o_direct"
    F_NOCACHE = "f_nocache"
    NONE = "none"

    @property
    def flag(self) -> str:
        """The OS's name for it, for messages ("O_DIRECT", "F_NOCACHE", "none")."""
        return self.value if self is Bypass.NONE else self.value.upper()


def platform_bypass() -> Bypass:
    """This OS's way past the page cache, where COLIBRI_STREAM_IO_FEATURES leaves it on."""
    if enabled(Feature.O_DIRECT):
        return Bypass.O_DIRECT
    if enabled(Feature.F_NOCACHE):
        return Bypass.F_NOCACHE
    return Bypass.NONE


def open_file(path: Path | str, flags: int, bypass: Bypass, mode: int = 0o777) -> int:
    """``path`` opened with ``flags`` (``mode`` where it is created), its I/O going past the page cache the way
    ``bypass`` says."""
    if bypass is Bypass.O_DIRECT:
        return os.open(path, flags | os.O_DIRECT, mode)
    fd = os.open(path, flags, mode)
    if bypass is Bypass.F_NOCACHE:
        try:
            set_nocache(fd)
        except OSError:
            os.close(fd)
            raise
    return fd


def set_nocache(fd: int) -> None:
    """F_NOCACHE on ``fd``: its reads and writes leave nothing in the cache (macOS)."""
    command = nocache_command()
    if command is None:
        raise OSError(f"fcntl has no F_NOCACHE here ({os.uname().sysname})")
    fcntl.fcntl(fd, command, 1)


def bypass_refusal(file: Path) -> str | None:
    """Why reads of ``file`` cannot go past the page cache here (None: ``platform_bypass()`` works on it).
    One aligned read decides: tmpfs and some network filesystems refuse O_DIRECT, some only at the read."""
    bypass = platform_bypass()
    if bypass is Bypass.NONE:
        states = feature_states()
        return f"no page-cache bypass here (o_direct {states[Feature.O_DIRECT]}, f_nocache {states[Feature.F_NOCACHE]})"
    buffer = aligned_empty(PAGE)
    try:
        fd = open_file(file, os.O_RDONLY, bypass)
        try:
            os.preadv(fd, [memoryview(buffer)], 0)  # type: ignore[arg-type]  # numpy: a Buffer only on >= 3.12
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{bypass.flag} unsupported on this filesystem ({exc.strerror or exc})"
    return None


def file_bypass(file: Path) -> Bypass:
    """How reads of ``file`` go past the page cache: the platform's way where a read with it works, else none."""
    return platform_bypass() if bypass_refusal(file) is None else Bypass.NONE


def write_bypass() -> Bypass:
    """How writes of whole files go past the cache: F_NOCACHE where it is the platform's way; never O_DIRECT,
    which needs an aligned source and aligned lengths."""
    return Bypass.F_NOCACHE if platform_bypass() is Bypass.F_NOCACHE else Bypass.NONE


def drop_cached(fd: int) -> bool:
    """The page cache's copy of ``fd``'s file dropped (posix_fadvise DONTNEED), so the next buffered read comes
    from the device; False where fadvise is absent or switched off (the next read may be a cached one)."""
    if not enabled(Feature.FADVISE):
        return False
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return True
