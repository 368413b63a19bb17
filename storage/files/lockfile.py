"""An advisory lock file: one process at a time holds it, and it says which process that is.

``flock`` on a small file beside what it guards: the kernel drops the lock when its holder dies (even
by SIGKILL), so a stale lock of a dead process is simply taken over; the holder writes its pid into
the file so a refused process can name it. The descriptor is close-on-exec (a worker started with
exec never inherits the lock) and the path is opened without following a symbolic link.

A lock file may be removed by a holder (a deleted session): a process that opened the old file just
before is left holding a lock on a name that no longer exists, so after locking, the file open is
compared with the file at the path, and on a difference the lock is taken again on the new one.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from storage.errors import IncompatibleStateError
from storage.files.safe_read import NotRegularFileError, check_regular_mode

PID_BYTES = 32  # more than any pid's digits


class LockHeldError(IncompatibleStateError):
    """The lock is held by another open file: ``pid`` names its process when the file says (else None)."""

    def __init__(self, path: Path, pid: int | None):
        holder = f"pid {pid}" if pid is not None else "another process"
        super().__init__(f"{path}: locked by {holder}")
        self.path, self.pid = path, pid


def acquire(path: str | Path) -> int:
    """A descriptor holding the exclusive lock on ``path`` (created if missing), with this process's pid
    written in the file; LockHeldError when another holds it. Closing the descriptor releases it."""
    path = Path(path)
    while True:
        fd = _open_lock_file(path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockHeldError(path, holder_pid(fd)) from None
            if _still_named(fd, path):
                _write_pid(fd)
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed or replaced between the open and the lock: lock the file there now


def release(fd: int) -> None:
    os.close(fd)  # closing the last descriptor of the open file drops the flock


def holder_pid(fd: int) -> int | None:
    """The pid the lock's holder wrote, or None (not written yet, or not a pid)."""
    text = os.pread(fd, PID_BYTES, 0).strip()
    return int(text) if text.isdigit() else None


def _open_lock_file(path: Path) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFileError(f"{path}: lock file is a symbolic link, not a regular file") from None
        raise
    try:
        check_regular_mode(path, os.fstat(fd).st_mode, "lock file")  # a FIFO or device planted there
    except BaseException:
        os.close(fd)
        raise
    return fd


def _still_named(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except FileNotFoundError:
        return False


def _write_pid(fd: int) -> None:
    """Best effort: a full disk may refuse even these bytes, and the lock holds without them."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
