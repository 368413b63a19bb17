"""The per-conversation KV log: an append-only file of fixed-size, checksummed records.

    header (4096 bytes): magic "COLIKV\\x00\\x01", u32 header JSON length, the JSON (format version,
                         model fingerprint, geometry, and the "state" the values depend on beyond the
                         model, e.g. the compute dtype), u32 crc32c of the JSON; zero pad
    record i (record_bytes each, at 4096 + i * record_bytes):
                         u32 token id | payload (in the record dtype) | u32 crc32c(position i, token, payload)

The payload's geometry comes in two kinds, told apart by the header's format version
(storage/kv/geometry.py):
    2 (KVGeometry, MLA models): per layer latent + roped key, then per DSA full layer the indexer key;
    3 (RowsGeometry, DeepSeek-V4's full rows): per layer, that layer's rows in order (``layer_rows``).
A log is written in the version its geometry needs, so an MLA log stays version 2: byte for byte what
builds before version 3 wrote, and what they still read. Version 4 (DeepSeek-V4's lean session log) is
not a log of records: storage/kv/lean_log.py writes it, sharing this file's header, lock and open rules
(LockedLog).

The position is folded into each record's checksum, so a record copied or shifted to another place
fails. Opening scans the records and keeps the longest valid prefix (point-in-time recovery: a torn
or corrupted record and everything after it are cut off, never half-used). A file of another model,
geometry or state is refused before anything is touched, naming the field that differs. A symbolic
link is never followed and a file without our magic is never written, cut (not even by a reset) or
deleted: a log cannot reach outside its directory. An exclusive flock guards each file: a second
process gets a clear error instead of interleaving appends.

Memory is bounded whatever the file holds: the open-time scan and every read go through chunks of at
most ``CHUNK_BYTES`` (a log with gigabytes of garbage appended, or a sparse 100 GiB file, opens in a
few MB), and a turn reads only the records it reuses.

Storage sees the payload as bytes of a known width; which floats go where is the app's business.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar, Self

import numpy as np

from storage.errors import CorruptDataError, FormatError, IncompatibleStateError, read_errors, write_errors
from storage.files.checksum import crc32c
from storage.files.safe_read import NotRegularFileError, check_regular_mode, open_regular
from storage.kv.geometry import (  # the geometries are re-exported: storage.kv.log is where callers find them
    GEOMETRY_OF_VERSION as GEOMETRY_OF_VERSION,
)
from storage.kv.geometry import MAX_ROW_WIDTH as MAX_ROW_WIDTH
from storage.kv.geometry import RECORD_DTYPES as RECORD_DTYPES
from storage.kv.geometry import AnyGeometry, KVGeometry, RowsGeometry, log_geometry_of_header
from storage.kv.geometry import Geometry as Geometry
from storage.kv.geometry import geometry_of_header as geometry_of_header

MAGIC = b"COLIKV\x00\x01"
HEADER_BYTES = 4096
CHUNK_BYTES = 8 << 20  # the most one scan or read step holds (whole records, at least one)
_TOKEN = struct.Struct("<I")
_CRC = struct.Struct("<I")
_POSITION = struct.Struct("<Q")


class StateMismatchError(IncompatibleStateError):
    """A log written under other conditions: ``field`` ("fingerprint", "format_version", "geometry.<name>"
    or "state.<name>") was ``stored`` in the file and is ``current`` now. The app turns it into advice."""

    def __init__(self, message: str, field: str, stored: Any, current: Any):
        super().__init__(message)
        self.field, self.stored, self.current = field, stored, current


def _record_crc(position: int, body: bytes | memoryview | np.ndarray) -> int:
    return crc32c(body, crc32c(_POSITION.pack(position)))


def encode_header(fingerprint: str, geometry: AnyGeometry, state: dict[str, str] | None = None) -> bytes:
    meta = json.dumps(
        {
            "format_version": geometry.FORMAT_VERSION,
            "fingerprint": fingerprint,
            "geometry": asdict(geometry),
            "state": dict(state or {}),
        },
        sort_keys=True,
    ).encode()
    header = MAGIC + _TOKEN.pack(len(meta)) + meta + _CRC.pack(crc32c(meta))
    if len(header) > HEADER_BYTES:
        raise FormatError(f"KV header metadata too large ({len(header)} bytes)")
    return header.ljust(HEADER_BYTES, b"\x00")


def decode_header(data: bytes, path: Path) -> dict[str, Any]:
    if len(data) < len(MAGIC) + _TOKEN.size or data[: len(MAGIC)] != MAGIC:
        raise FormatError(f"{path}: not a colibri-stream KV log (bad magic or shorter than a header)")
    (length,) = _TOKEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _TOKEN.size
    if len(data) < HEADER_BYTES or start + length + _CRC.size > HEADER_BYTES:
        raise FormatError(f"{path}: KV log header is truncated")
    meta = data[start : start + length]
    (stored,) = _CRC.unpack_from(data, start + length)
    if crc32c(meta) != stored:
        raise CorruptDataError(f"{path}: KV log header checksum mismatch")
    try:
        header = json.loads(meta)
    except ValueError as exc:  # a valid checksum over invalid JSON: written by something else
        raise FormatError(f"{path}: KV log header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: KV log header is not a JSON object")
    version = header.get("format_version")
    if type(version) is not int or version not in GEOMETRY_OF_VERSION:
        raise FormatError(
            f"{path}: KV log format version {version!r} is not supported "
            f"(this build reads and writes versions {sorted(GEOMETRY_OF_VERSION)})"
        )
    return header


def read_header(path: str | Path) -> tuple[str, AnyGeometry]:
    """(fingerprint, geometry) from a KV log's header, without locking or scanning it."""
    fingerprint, geometry, _ = read_header_state(path)
    return fingerprint, geometry


def read_header_state(path: str | Path) -> tuple[str, AnyGeometry, dict[str, str]]:
    """(fingerprint, geometry, state) from a KV log's header, without locking or scanning it."""
    path = Path(path)
    with (
        os.fdopen(open_regular(path, "KV log", follow_symlinks=False), "rb") as f,
        read_errors(path, "the KV log header"),
    ):
        header = decode_header(f.read(HEADER_BYTES), path)
    geometry = log_geometry_of_header(header, path)
    state = header.get("state")
    if not isinstance(state, dict):
        raise FormatError(f"{path}: KV log header 'state' is {state!r}, expected an object")
    return str(header.get("fingerprint")), geometry, state


class NotALogError(FormatError):
    """A file at a log's path that is not a KV log of ours (no magic): never written, cut or deleted."""


def is_ours(first_bytes: bytes) -> bool:
    """Whether a file starting with ``first_bytes`` (at least len(MAGIC) of them when it has them) is a
    KV log of ours: empty, our magic (a corrupt header or records behind it included), or a prefix of
    the magic (a header torn while it was being created)."""
    return first_bytes[: len(MAGIC)] == MAGIC[: len(first_bytes)]


def check_ours(fd: int, path: Path) -> None:
    """NotALogError unless the open file is one of ours (see ``is_ours``)."""
    if not is_ours(os.pread(fd, len(MAGIC), 0)):
        raise NotALogError(f"{path}: not a colibri-stream KV log (bad magic); left untouched")


def _open_log(path: Path) -> int:
    """The log's descriptor, created if missing. Only a regular file: a directory, FIFO or device planted
    at the path (``/dev/zero`` reads as endless zeros and refuses fsync) is refused before any write, and
    a symbolic link is refused, never followed (a log must not write outside its directory)."""
    if os.path.lexists(path):
        check_regular_mode(path, path.lstat().st_mode, "KV log")
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link planted after the lstat
            raise NotRegularFileError(f"{path}: KV log is a symbolic link, not a regular file") from None
        raise
    try:
        check_regular_mode(path, os.fstat(fd).st_mode, "KV log")  # the file opened, if it was swapped
    except BaseException:
        os.close(fd)
        raise
    return fd


def count_valid_records(data: bytes | memoryview, record_bytes: int, first: int = 0) -> int:
    """How many records from the start of ``data`` are whole and valid, the first being record ``first``
    of the log (positions are folded into the checksums)."""
    view = memoryview(data)
    n = len(view) // record_bytes
    for i in range(n):
        record = view[i * record_bytes : (i + 1) * record_bytes]
        (stored,) = _CRC.unpack_from(record, record_bytes - _CRC.size)
        if _record_crc(first + i, record[: record_bytes - _CRC.size]) != stored:
            return i
    return n


def encode_records(tokens: np.ndarray, payloads: np.ndarray, first: int, record_bytes: int) -> np.ndarray:
    """Records for positions first.. as uint8 [n, record_bytes]: token | payload | crc (position folded in)."""
    n = len(tokens)
    records = np.empty((n, record_bytes), dtype=np.uint8)
    records[:, : _TOKEN.size] = np.asarray(tokens, dtype="<u4").reshape(n, 1).view(np.uint8)
    records[:, _TOKEN.size : -_CRC.size] = payloads
    for i in range(n):
        crc = _record_crc(first + i, records[i, : -_CRC.size])
        records[i, -_CRC.size :] = np.frombuffer(_CRC.pack(crc), dtype=np.uint8)
    return records


def decode_records(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token ids [n] uint32, payloads [n, payload_bytes] uint8) of records uint8 [n, record_bytes]."""
    tokens = raw[:, : _TOKEN.size].copy().view("<u4").reshape(len(raw))
    return tokens, raw[:, _TOKEN.size : raw.shape[1] - _CRC.size]


def remove_log(path: str | Path) -> None:
    """Delete a log, whatever its header holds (a corrupt one included), unless another process has it
    open: the lock needs only the file, not a valid header. A file without our magic, a symbolic link
    or anything but a regular file is refused and left in place."""
    path = Path(path)
    fd = open_regular(path, "KV log", os.O_RDWR, follow_symlinks=False)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise IncompatibleStateError(f"{path}: session is in use by another process") from None
        check_ours(fd, path)
        opened, named = os.fstat(fd), path.lstat()
        if (opened.st_dev, opened.st_ino) != (named.st_dev, named.st_ino):  # swapped since the open
            raise NotALogError(f"{path}: replaced while being removed; left untouched")
        path.unlink()
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset``: a nearly full disk takes part of a write and refuses the rest,
    and a short count taken for success would acknowledge records that are not in the file."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[written:], offset + written


def _cut_back(fd: int, size: int) -> None:
    """Drop what a failed append left past ``size``; if even that fails, the tail is unacknowledged and
    the next open's recovery scan drops whatever of it is torn."""
    try:
        os.ftruncate(fd, size)
    except OSError:
        pass


def _unlink_if_same(path: Path, fd: int) -> None:
    """Remove ``path`` if it is still the file open as ``fd`` (never another one swapped in meanwhile)."""
    try:
        if os.path.samestat(os.lstat(path), os.fstat(fd)):
            path.unlink()
    except OSError:
        pass


# Called with each named point of an append ("before_write", "mid_record", "before_fsync", "after_fsync"):
# the crash tests pass a hook that SIGKILLs the process there.
FaultHook = Callable[[str], None]


class LockedLog(ABC):
    """A log file opened exclusively, its header checked (or written): what KVLog and the lean log
    (storage/kv/lean_log.py) share. ``length`` is its count of valid positions.

    ``state`` names what the stored values depend on besides the model and geometry (the app's choice,
    e.g. {"compute_dtype": "bfloat16"}); a log written under another state is refused. ``fresh``
    starts the log over whatever the file held (a corrupt header, another model): a reset."""

    GEOMETRIES: ClassVar[tuple[type, ...]]  # the geometries this kind of log writes

    def __init__(
        self,
        path: str | Path,
        fingerprint: str,
        geometry: AnyGeometry,
        fault: FaultHook | None = None,
        *,
        state: dict[str, str] | None = None,
        fresh: bool = False,
    ):
        if not isinstance(geometry, self.GEOMETRIES):  # a lean geometry is storage/kv/lean_log.py's
            raise TypeError(f"{type(self).__name__} does not write {type(geometry).__name__} logs")
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.geometry = geometry
        self.state = dict(state or {})
        self._fresh = fresh
        self._fault = fault or (lambda point: None)
        with write_errors(self.path, "the KV log"):  # a full directory refuses the new entry itself
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = _open_log(self.path)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise IncompatibleStateError(f"{self.path}: session is in use by another process") from None
        try:
            with read_errors(self.path, "the KV log"):  # a device failing reads: typed, like a short read
                self.recovered_from_bytes = self._open_or_create()
        except BaseException:
            self.close()
            raise

    # -------------------------------------------------------------------------------- open/scan
    def _open_or_create(self) -> int:
        """Check the header and scan the records; returns the file's size before any tail was cut."""
        size = os.fstat(self._fd).st_size
        check_ours(self._fd, self.path)  # before anything is written or cut: --reset included
        if size == 0 or self._fresh:
            self._write_header()
            self._start_empty()
            return size
        self._check_header(decode_header(os.pread(self._fd, HEADER_BYTES, 0), self.path))
        valid_end = self._recover(size)
        if size != valid_end:  # cut the torn or corrupted tail so appends continue a valid file
            # A device that fails the cut fails the open: the valid prefix stays as it was, the tail unused.
            with write_errors(self.path, "the KV log's recovery cut (dropping its torn tail)"):
                os.ftruncate(self._fd, valid_end)
                os.fsync(self._fd)
        return size

    @abstractmethod
    def _start_empty(self) -> None:
        """Set the state of a log that holds no position yet."""

    @abstractmethod
    def _recover(self, size: int) -> int:
        """Scan a file of ``size`` bytes after the header: set the state from its valid prefix, return where
        that prefix ends (the rest is cut)."""

    def sync(self) -> None:
        with write_errors(self.path, "the KV log (fsync)"):
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the flock
            self._fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_header(self) -> None:
        """Start the file over with this log's header; if that cannot be written (a full disk), the file is
        removed and the error raised: a header-less log is never left behind for `kv ls` to call corrupt."""
        header = encode_header(self.fingerprint, self.geometry, self.state)
        try:
            with write_errors(self.path, "the KV log header"):
                os.ftruncate(self._fd, 0)
                _pwrite_all(self._fd, header, 0)
                os.fsync(self._fd)
        except BaseException:
            _unlink_if_same(self.path, self._fd)
            raise

    def _check_header(self, header: dict[str, Any]) -> None:
        """Refuse a log of another model, geometry or state, naming the first field that differs."""
        stored_fingerprint = header.get("fingerprint")
        if stored_fingerprint != self.fingerprint:
            raise StateMismatchError(
                f"{self.path}: KV log of another model (fingerprint mismatch: the log's is {stored_fingerprint!r}, "
                f"this model's {self.fingerprint!r})",
                "fingerprint",
                stored_fingerprint,
                self.fingerprint,
            )
        stored_version = header.get("format_version")
        if stored_version != self.geometry.FORMAT_VERSION:  # another kind of geometry: MLA or rows
            raise StateMismatchError(
                f"{self.path}: KV log format version is {stored_version!r}, this run's geometry is written "
                f"in version {self.geometry.FORMAT_VERSION}",
                "format_version",
                stored_version,
                self.geometry.FORMAT_VERSION,
            )
        stored_geometry = header.get("geometry")
        current_geometry = json.loads(json.dumps(asdict(self.geometry)))
        if not isinstance(stored_geometry, dict):
            raise FormatError(f"{self.path}: KV log header 'geometry' is {stored_geometry!r}, expected an object")
        stored_state = header.get("state")
        if not isinstance(stored_state, dict):
            raise FormatError(f"{self.path}: KV log header 'state' is {stored_state!r}, expected an object")
        for scope, stored, current in (
            ("geometry", stored_geometry, current_geometry),
            ("state", stored_state, self.state),
        ):
            for key in sorted(set(stored) | set(current)):
                if stored.get(key) != current.get(key):
                    raise StateMismatchError(
                        f"{self.path}: KV log {scope} {key} is {stored.get(key)!r}, this run's is {current.get(key)!r}",
                        f"{scope}.{key}",
                        stored.get(key),
                        current.get(key),
                    )


class KVLog(LockedLog):
    """One conversation slot's log of fixed-size records (KVGeometry or RowsGeometry), opened exclusively;
    ``length`` is its count of valid records."""

    geometry: Geometry

    GEOMETRIES = (KVGeometry, RowsGeometry)

    def _start_empty(self) -> None:
        self.length = 0

    def _recover(self, size: int) -> int:
        self._start_empty()
        self.length = self._scan(size)
        return HEADER_BYTES + self.length * self.geometry.record_bytes

    def _chunk_records(self) -> int:
        return max(1, CHUNK_BYTES // self.geometry.record_bytes)

    def _scan(self, size: int) -> int:
        """Valid records from the start, read a chunk at a time and stopping at the first bad one: a file
        of any size costs one chunk of memory, and garbage costs one chunk of reading."""
        record_bytes = self.geometry.record_bytes
        whole = max(0, size - HEADER_BYTES) // record_bytes
        valid = 0
        while valid < whole:
            n = min(self._chunk_records(), whole - valid)
            data = os.pread(self._fd, n * record_bytes, HEADER_BYTES + valid * record_bytes)
            good = count_valid_records(data, record_bytes, first=valid)
            valid += good
            if good < n:
                break
        return valid

    def _read_records(self, start: int, count: int) -> np.ndarray:
        """Records start..start+count as uint8 [count, record_bytes], read in chunks into one array."""
        with read_errors(self.path, f"KV log records {start}..{start + count - 1}"):
            return self._read_records_unchecked(start, count)

    def _read_records_unchecked(self, start: int, count: int) -> np.ndarray:
        size = self.geometry.record_bytes
        out = np.empty((count, size), dtype=np.uint8)
        flat = memoryview(out.reshape(-1))  # type: ignore[arg-type]  # numpy: ndarray is a Buffer only on >= 3.12
        for first in range(0, count, self._chunk_records()):
            n = min(self._chunk_records(), count - first)
            target = flat[first * size : (first + n) * size]
            got = os.preadv(self._fd, [target], HEADER_BYTES + (start + first) * size)
            if got != len(target):
                raise CorruptDataError(
                    f"{self.path}: short read at record {start + first} ({got} of {len(target)} bytes)"
                )
        return out

    # ------------------------------------------------------------------------------------ verbs
    def read(self, count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(token ids [n] uint32, payloads [n, payload_bytes] uint8) of the first ``count`` records."""
        count = self.length if count is None else min(count, self.length)
        return decode_records(self._read_records(0, count))

    def common_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading records hold exactly ``token_ids``' first tokens, read a chunk at a time (the
        payloads are not kept: a long log and a short prompt cost one chunk)."""
        limit = min(self.length, len(token_ids))
        common = 0
        while common < limit:
            n = min(self._chunk_records(), limit - common)
            stored = self._read_records(common, n)[:, : _TOKEN.size].copy().view("<u4").reshape(n)
            wanted = np.asarray(token_ids[common : common + n], dtype=np.int64)
            differs = np.flatnonzero(stored.astype(np.int64) != wanted)
            if len(differs):
                return common + int(differs[0])
            common += n
        return common

    def append(self, tokens: np.ndarray, payloads: np.ndarray, sync: bool = True) -> None:
        """Append records for positions length.. (tokens [n], payloads [n, payload_bytes] uint8)."""
        n = len(tokens)
        if payloads.shape != (n, self.geometry.payload_bytes) or payloads.dtype != np.uint8:
            raise ValueError(
                f"payloads must be uint8[{n}, {self.geometry.payload_bytes}], got {payloads.dtype}{payloads.shape}"
            )
        records = encode_records(tokens, payloads, self.length, self.geometry.record_bytes)
        offset = HEADER_BYTES + self.length * self.geometry.record_bytes
        try:
            with write_errors(self.path, f"{n} KV log record(s)"):
                self._write_records(records.tobytes(), offset, sync)
        except BaseException:  # a full disk, a device error: the log stays at its last acknowledged record
            _cut_back(self._fd, offset)
            raise
        self.length += n
        self._fault("after_fsync")

    def _write_records(self, data: bytes, offset: int, sync: bool) -> None:
        self._fault("before_write")
        # Two writes with the "mid_record" fault point between them: a kill there leaves a torn record.
        split = max(0, len(data) - self.geometry.record_bytes // 2)
        _pwrite_all(self._fd, data[:split], offset)
        self._fault("mid_record")
        _pwrite_all(self._fd, data[split:], offset + split)
        self._fault("before_fsync")
        if sync:
            os.fsync(self._fd)

    def truncate(self, length: int) -> None:
        """Forget records from ``length`` on (the conversation diverged there). A device that fails the cut
        raises DiskWriteError (DiskFullError) naming the file; the log then holds the records the file
        still has, from ``length`` to its old length, each a whole valid record of the old conversation
        (a reopen's scan sees the same: the next turn matches them by token id like any other)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a log of {self.length} records to {length}")
        try:
            with write_errors(self.path, f"a cut-back of the KV log to record {length}"):
                os.ftruncate(self._fd, HEADER_BYTES + length * self.geometry.record_bytes)
                os.fsync(self._fd)
        except BaseException:
            self.length = min(self.length, self._records_in_file())
            raise
        self.length = length

    def _records_in_file(self) -> int:
        """Whole records the file holds now (all valid: only ever written whole, then fsynced)."""
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            return self.length
        return max(0, size - HEADER_BYTES) // self.geometry.record_bytes
