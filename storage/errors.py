"""Typed errors at the storage boundary; the CLI prints each as one line."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class StorageError(Exception):
    """Base of every error storage raises on bad input."""


class FormatError(StorageError):
    """A file or store that is not in the expected format (structure, metadata, version, shapes)."""


class CorruptDataError(StorageError):
    """Bytes that fail their checksum or are shorter than the metadata says."""


class IncompatibleStateError(StorageError):
    """State written for another model, source or geometry."""


class SettingError(StorageError, ValueError):
    """An environment setting storage reads (COLIBRI_STREAM_IO_FEATURES) with a value it does not take; the
    message names the variable and what it takes."""


class BudgetError(StorageError):
    """A memory budget that cannot work: below the minimum, above the machine, or exhausted."""


class DiskFullError(StorageError):
    """A write refused for lack of space (ENOSPC, EDQUOT); the message names the path and its free bytes."""


class DiskWriteError(StorageError):
    """A write, cut or fsync the device or its filesystem failed (EIO; EROFS once the filesystem has gone
    read-only, as ext4 does after a failed journal write; EFBIG past its largest file); the message names
    the path."""


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# What each device-side errno means to the user: the write did not reach the disk, and why.
DEVICE_ERRNOS = {
    errno.EIO: "EIO: the device failed the write",
    errno.EROFS: "EROFS: the filesystem is read-only, e.g. remounted so after a device error",
    errno.EFBIG: "EFBIG: past the largest file this filesystem holds",
}


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (its nearest existing parent's
    if it does not exist yet); None if even that cannot be asked."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        status = os.statvfs(where)
    except OSError:
        return None
    return status.f_bavail * status.f_frsize


def disk_error(path: str | Path, exc: OSError, what: str) -> StorageError | None:
    """The typed error for writing ``what`` at ``path`` when it failed with ``exc``: DiskFullError for a
    full disk or quota, DiskWriteError for a device or read-only filesystem; None for anything else (a bug
    or a bad path)."""
    if exc.errno in DISK_FULL_ERRNOS:
        free = free_bytes(path)
        left = "unknown" if free is None else f"{free:,} bytes"
        return DiskFullError(f"{path}: no space left writing {what} ({left} free there)")
    if exc.errno in DEVICE_ERRNOS:
        return DiskWriteError(f"{path}: I/O error writing {what} ({DEVICE_ERRNOS[exc.errno]})")
    return None


@contextmanager
def write_errors(path: str | Path, what: str) -> Iterator[None]:
    """Turn a full disk or a device error inside the block into its typed error; other OSErrors pass."""
    try:
        yield
    except OSError as exc:
        typed = disk_error(path, exc, what)
        if typed is None:
            raise
        raise typed from exc


@contextmanager
def read_errors(path: str | Path, what: str) -> Iterator[None]:
    """Turn a device's read error (EIO) inside the block into a CorruptDataError naming the path, as a
    short read is; other OSErrors pass."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.EIO:
            raise
        raise CorruptDataError(f"{path}: I/O error reading {what} (EIO: the device failed the read)") from exc
