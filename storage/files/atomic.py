"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync the directory."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from storage.errors import write_errors


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` or leave it as it was. A full disk or a device error raises
    DiskFullError / DiskWriteError naming the path, and the partial temp file is removed (left behind, it
    would hold the space the next try needs)."""
    with replacing(path, "the file") as f:
        f.write(data)


@contextmanager
def replacing(path: str | Path, what: str, durable: bool = True) -> Iterator[BinaryIO]:
    """A file to write whose bytes replace ``path`` whole when the block ends, or never (an error, a full
    disk: DiskFullError / DiskWriteError naming ``what`` at ``path``, the temp file removed). ``durable``:
    fsynced with its directory (False for a cache, whose torn file is a checked miss after a power cut)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{_TEMP_MARK}{os.getpid()}")
    try:
        with write_errors(path, what):
            with os.fdopen(_create_temp(tmp), "wb") as f:
                yield f
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


_TEMP_MARK = ".tmp-"


def is_dead_writers_temp(path: Path) -> bool:
    """``path`` is a temp file of ``replacing`` whose process is gone (killed between the write and the
    rename): nobody will rename or remove it, so the writer's next run may."""
    name, mark, pid = path.name.rpartition(_TEMP_MARK)
    if not (name.startswith(".") and mark and pid.isdigit()) or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    return False


def _create_temp(tmp: Path) -> int:
    """A new file at ``tmp``: a leftover of a dead process with our pid is removed first (a link planted
    there is unlinked, never followed), and the file is created exclusively without following links, so
    the bytes meant for ``path``'s directory cannot be written anywhere else."""
    tmp.unlink(missing_ok=True)
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)  # as open()


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
