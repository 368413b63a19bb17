"""Reading a small state or config file that may be hostile: regular files only, size-bounded,
decoded and parsed with every failure turned into a typed one-line error naming the file.

A path can be planted as a directory, a FIFO (opening it for reading would block until a writer
comes), ``/dev/zero`` (endless bytes) or a sparse file of terabytes. So the path is stat-ed before
it is opened, opened with O_NONBLOCK (a FIFO swapped in between cannot block), fstat-ed again (the
file actually opened must be regular too) and read only up to the caller's cap.

Errors are ``FormatError`` subclasses (the CLI prints them as one line); the library may re-raise
them as its own types (a budget file's as ``BudgetError``). A missing file is left to the caller
(``FileNotFoundError``): a missing history is an empty one, a missing budget file is an error.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from storage.errors import FormatError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),  # seen only where links are not followed (lstat)
)


class NotRegularFileError(FormatError):
    """A path that names a directory, FIFO, device or socket where a regular file was expected."""


class FileTooLargeError(FormatError):
    """A file over the size its reader accepts."""


def file_kind(mode: int) -> str:
    """'a directory', 'a FIFO', ... for a non-regular mode (what the error message says it is)."""
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def check_regular_mode(path: Path, mode: int, what: str) -> None:
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(f"{path}: {what} is {file_kind(mode)}, not a regular file")


def check_no_nul(path: Path, what: str) -> None:
    """A path read from a file (a budget's history, an index's shard name) may hold a NUL byte, which no
    file name can: refused in one line (the OS calls would raise ValueError)."""
    if "\0" in str(path):
        raise FormatError(f"{str(path)!r}: {what} cannot be there: the path holds a NUL byte")


def open_regular(path: str | Path, what: str, flags: int = os.O_RDONLY, *, follow_symlinks: bool = True) -> int:
    """A file descriptor on the regular file at ``path``; the caller closes it. With ``follow_symlinks``
    False a symbolic link there is refused, not followed (a state file that must stay in its directory)."""
    path = Path(path)
    check_no_nul(path, what)
    status = os.stat(path) if follow_symlinks else os.lstat(path)
    check_regular_mode(path, status.st_mode, what)  # before open: a FIFO would block it
    fd = _open_nonblocking(path, what, flags | (0 if follow_symlinks else os.O_NOFOLLOW))
    try:
        check_regular_mode(path, os.fstat(fd).st_mode, what)  # the file opened, if it was swapped
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_nonblocking(path: Path, what: str, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP and flags & os.O_NOFOLLOW:  # a link swapped in after the lstat
            raise NotRegularFileError(f"{path}: {what} is a symbolic link, not a regular file") from None
        raise


def read_bounded(path: str | Path, max_bytes: int, what: str, *, follow_symlinks: bool = True) -> bytes:
    """The whole regular file at ``path``, refused (before reading) when over ``max_bytes``."""
    path = Path(path)
    fd = open_regular(path, what, follow_symlinks=follow_symlinks)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise FileTooLargeError(f"{path}: {what} is {size} bytes, more than the {max_bytes} accepted")
        data = f.read(max_bytes + 1)  # a file growing while read is cut, not followed
    if len(data) > max_bytes:
        raise FileTooLargeError(f"{path}: {what} grew past the {max_bytes} bytes accepted while read")
    return data


def decode_utf8(data: bytes, path: str | Path, what: str, line: int | None = None) -> str:
    """``data`` as text, or a FormatError naming the file (and line) and the offset of the bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"{path}:{line}" if line is not None else str(path)
        raise FormatError(f"{where}: {what} is not UTF-8 (byte {data[exc.start]:#04x} at offset {exc.start})") from None


def parse_json(text: str | bytes, path: str | Path, what: str, line: int | None = None) -> Any:
    """JSON from ``text``; malformed, too deeply nested or out-of-range input is a FormatError naming
    the file, line and column."""
    where = f"{path}:{line}" if line is not None else str(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        row = exc.lineno if line is None else line
        raise FormatError(f"{path}:{row}: {what} is not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise FormatError(f"{where}: {what} nests JSON arrays or objects too deeply") from None
    except ValueError as exc:  # e.g. an integer of more digits than int() accepts
        raise FormatError(f"{where}: {what} holds an unreadable JSON value ({exc})") from None


def read_json(path: str | Path, max_bytes: int, what: str, *, follow_symlinks: bool = True) -> Any:
    """A bounded regular file parsed as UTF-8 JSON (any top-level type: the caller checks the shape)."""
    data = read_bounded(path, max_bytes, what, follow_symlinks=follow_symlinks)
    return parse_json(decode_utf8(data, path, what), path, what)


class OutputPathError(FormatError):
    """A path to be written that cannot be: its directory is missing or is a file, or opening it failed."""


def check_output_path(path: str | Path, what: str) -> None:
    """Before anything is computed for it: ``path`` is a regular file (overwritten) or does not exist yet
    in an existing directory. Checked up front so a run does not end, after its work, on a bad path."""
    path = Path(path)
    check_no_nul(path, what)
    try:
        status = os.stat(path)
    except FileNotFoundError:
        if not path.parent.is_dir():
            state = "is not a directory" if path.parent.exists() else "does not exist"
            raise OutputPathError(f"{path}: cannot write {what}: directory {path.parent} {state}") from None
        return
    except NotADirectoryError:
        raise OutputPathError(f"{path}: cannot write {what}: a parent of it is a file, not a directory") from None
    except OSError as exc:  # ELOOP (a link loop), EACCES, ...
        raise OutputPathError(f"{path}: cannot write {what} ({exc.strerror})") from None
    check_regular_mode(path, status.st_mode, what)


def open_for_writing(path: str | Path, what: str) -> int:
    """A descriptor on ``path`` created or truncated for writing, refused (one line) unless it is a regular
    file: opened O_NONBLOCK (a FIFO swapped in after the check cannot block) and fstat-ed before truncating."""
    path = Path(path)
    check_output_path(path, what)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:  # ENXIO: a FIFO without a reader; EACCES, EROFS, ...
        raise OutputPathError(f"{path}: cannot open {what} for writing ({exc.strerror})") from None
    try:
        check_regular_mode(path, os.fstat(fd).st_mode, what)
        os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_output_dir(path: str | Path, what: str) -> None:
    """``path`` is a directory, or can be made one: it does not exist and its nearest existing ancestor
    is a directory. A file (or FIFO, device) in the way is one OutputPathError naming it, before any work."""
    path = Path(path)
    check_no_nul(path, what)
    for ancestor in (path, *path.absolute().parents):
        where = "it" if ancestor == path else str(ancestor)
        try:
            mode = os.stat(ancestor).st_mode
        except (FileNotFoundError, NotADirectoryError):
            if os.path.lexists(ancestor):  # a dangling symbolic link: making the directory would fail on it
                raise OutputPathError(
                    f"{path}: {what} must be a directory, and {where} is a broken symbolic link"
                ) from None
            continue
        except OSError as exc:  # ELOOP (a link loop), EACCES, ...
            raise OutputPathError(f"{path}: {what} cannot be used as a directory ({exc.strerror})") from None
        if not stat.S_ISDIR(mode):
            kind = "a file" if stat.S_ISREG(mode) else file_kind(mode)
            raise OutputPathError(f"{path}: {what} must be a directory, and {where} is {kind}")
        return
