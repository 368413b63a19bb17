"""DeepSeek-V4's lean session log (format 4): entries per position, the window state in snapshots.

A V4 cache's state at position L is the compressed entries of every window closed before L (a few
values per position) plus a fixed-size window state: the sliding window's last W-1 K=V rows and each
compressor's open-window projections. Logging every row per position (format 3) costs ~28x the
in-memory state on V4-Flash; this log stores what each position adds and snapshots the window state:

    header (4096 bytes): storage/kv/log.py's, format version 4, geometry LeanGeometry (storage/kv/geometry.py)
    frames, one after another, each:
        u8[4] tag | u32 0 | u64 position | u64 count | payload | u32 crc32c(frame header, payload)
    "POS\\0" positions position..position+count-1: u32 token ids [count], then per entry series the rows of
             the windows those positions close (LeanGeometry.entry_counts), in the record dtype
    "SNP\\0" the window state at ``position`` (count 0): per window series the rows of positions
             max(0, (position // period - keep) * period) .. position-1 (LeanGeometry.window_rows)
    "BMK\\0" a bookmark: a SNP payload for an earlier position (the last turn's last prompt position),
             only after the end snapshot

Frames run in order: a POS frame starts where the one before ended, a SNP frame is at the current end.
An append writes the new positions' POS frames with a SNP frame at every multiple of ``snapshot_every``
they pass (kept for good) and one at their end (the end snapshot, replaced by the next append: the
log's fixed cost, like the windows in memory), then the bookmark the caller names (its state given
when inside the new positions, else carried over from the old tail; the next append replaces it too).
So the state at the end, at any kept snapshot or at the bookmark is restored exactly with nothing
re-prefilled; a cut-back to a position P restores the last of them at or before P and the caller
re-prefills the rest from the logged tokens (fewer than ``snapshot_every``, or since the bookmark). A
cut-back to the bookmark cuts the positions frame holding it and writes its state as the end snapshot.

Crash safety: an append overwrites the old end snapshot in place, writes and fsyncs. Opening scans the
frames, checking each one's size against the geometry and its checksum (the position is in the checked
frame header, so a frame moved elsewhere fails), and keeps the longest valid prefix: a torn frame and
everything after it are cut, a torn snapshot is never used (the state then restores from the last
whole one, its positions re-prefilled). The header, lock and foreign-file rules are storage/kv/log.py's.
Memory: the tokens (4 bytes a position) and one index entry per frame; checksums stream in chunks.
"""

from __future__ import annotations

import bisect
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.errors import CorruptDataError, read_errors, write_errors
from storage.files.checksum import crc32c
from storage.files.safe_read import open_regular
from storage.kv.geometry import FRAME_HEADER, LeanGeometry
from storage.kv.log import CHUNK_BYTES, HEADER_BYTES, LockedLog, _cut_back, _pwrite_all

POSITIONS, SNAPSHOT, BOOKMARK = b"POS\x00", b"SNP\x00", b"BMK\x00"
_CRC_BYTES = 4


@dataclass(frozen=True)
class Frame:
    tag: bytes
    position: int  # the first position (POS) or the snapshot's position (SNP)
    count: int  # positions covered (0 for a snapshot)
    offset: int  # where the frame starts in the file
    end: int  # where the next one starts


def _frame_bytes(tag: bytes, position: int, count: int, payload: bytes) -> bytes:
    head = FRAME_HEADER.pack(tag, 0, position, count)
    return head + payload + crc32c(payload, crc32c(head)).to_bytes(_CRC_BYTES, "little")


class LeanLog(LockedLog):
    """A lean session log (see the module doc), opened exclusively. ``length``: positions logged;
    ``snapshots``: the positions a state can be restored at (0, the empty state, always)."""

    GEOMETRIES = (LeanGeometry,)
    geometry: LeanGeometry

    def _start_empty(self) -> None:
        self.length = 0
        self._tokens = array("I")
        self._frames: list[Frame] = []
        self.snapshots: list[int] = [0]
        self._snapshot_frames: dict[int, Frame] = {}
        self.bookmark: Frame | None = None  # the window state at an earlier position, after the end one

    # -------------------------------------------------------------------------------- open/scan
    def _recover(self, size: int) -> int:
        self._start_empty()
        offset = HEADER_BYTES
        while (frame := self._valid_frame(offset, size)) is not None:
            self._index(frame)
            if frame.tag == POSITIONS:
                self._tokens.frombytes(os.pread(self._fd, 4 * frame.count, offset + FRAME_HEADER.size))
            offset = frame.end
        return offset

    def _payload_bytes(self, tag: bytes, position: int, count: int) -> int:
        if tag == POSITIONS:
            return self.geometry.positions_payload_bytes(position, count)
        return self.geometry.snapshot_payload_bytes(position)

    def _valid_frame(self, offset: int, size: int) -> Frame | None:
        """The frame at ``offset`` if it is whole, in sequence, of its geometry's size and checksum."""
        if offset + FRAME_HEADER.size > size:
            return None
        head = os.pread(self._fd, FRAME_HEADER.size, offset)
        tag, zero, position, count = FRAME_HEADER.unpack(head)
        in_sequence = zero == 0 and (position == self.length or (tag == BOOKMARK and 0 < position < self.length))
        sized = (tag == POSITIONS and 0 < count <= (size - offset) // 4) or (tag in (SNAPSHOT, BOOKMARK) and not count)
        if not (in_sequence and sized):
            return None
        payload = self._payload_bytes(tag, position, count)
        end = offset + FRAME_HEADER.size + payload + _CRC_BYTES
        if end > size:
            return None
        crc, at = crc32c(head), offset + FRAME_HEADER.size
        while at < end - _CRC_BYTES:  # a chunk at a time: a frame of any size costs one chunk of memory
            crc = crc32c(os.pread(self._fd, min(CHUNK_BYTES, end - _CRC_BYTES - at), at), crc)
            at += CHUNK_BYTES
        if crc != int.from_bytes(os.pread(self._fd, _CRC_BYTES, end - _CRC_BYTES), "little"):
            return None
        return Frame(tag, position, count, offset, end)

    def _index(self, frame: Frame) -> None:
        self._frames.append(frame)
        if frame.tag == POSITIONS:
            self.length += frame.count
            self.bookmark = None  # one is only ever written after the end snapshot
        elif frame.tag == BOOKMARK:
            self.bookmark = frame
        else:
            self._snapshot_frames[frame.position] = frame
            if frame.position != self.snapshots[-1]:
                self.snapshots.append(frame.position)

    # ------------------------------------------------------------------------------------ reads
    @property
    def frames(self) -> tuple[Frame, ...]:
        """The valid frames, in file order."""
        return tuple(self._frames)

    def tokens(self, count: int | None = None) -> np.ndarray:
        """The token ids [n] uint32 of the first ``count`` positions (all by default)."""
        count = self.length if count is None else min(count, self.length)
        return np.frombuffer(self._tokens, dtype=np.uint32, count=count).copy()

    def common_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading positions hold exactly ``token_ids``' first tokens."""
        n = min(self.length, len(token_ids))
        stored = np.frombuffer(self._tokens, dtype=np.uint32, count=n).astype(np.int64)
        differs = np.flatnonzero(stored != np.asarray(token_ids[:n], dtype=np.int64))
        return int(differs[0]) if len(differs) else n

    def restore_point(self, limit: int) -> int:
        """The last position at or before ``limit`` whose state is snapshotted or bookmarked (0: the empty
        state)."""
        point = self.snapshots[bisect.bisect_right(self.snapshots, limit) - 1]
        if self.bookmark is not None and point < self.bookmark.position <= limit:
            return self.bookmark.position
        return point

    def _read(self, frame: Frame) -> np.ndarray:
        size = frame.end - _CRC_BYTES - frame.offset - FRAME_HEADER.size
        out = np.empty(size, dtype=np.uint8)
        with read_errors(self.path, f"the KV log frame at byte {frame.offset}"):
            got = os.preadv(self._fd, [memoryview(out)], frame.offset + FRAME_HEADER.size)  # type: ignore[arg-type]
        if got != size:
            raise CorruptDataError(f"{self.path}: short read of the frame at byte {frame.offset}")
        return out

    def read_entries(self, end: int) -> list[np.ndarray]:
        """Per entry series, the rows uint8 [n, width * item] of the windows closed before position ``end``."""
        geometry, item = self.geometry, self.geometry.item
        parts: list[list[np.ndarray]] = [[] for _ in geometry.entries]
        for frame in self._frames:
            if frame.tag != POSITIONS or frame.position >= end:
                continue
            payload, offset = self._read(frame), 4 * frame.count
            wanted = geometry.entry_counts(frame.position, min(frame.count, end - frame.position))
            held = geometry.entry_counts(frame.position, frame.count)
            for i, (n, (width, _)) in enumerate(zip(held, geometry.entries, strict=True)):
                rows = payload[offset : offset + n * width * item].reshape(n, width * item)
                parts[i].append(rows[: wanted[i]])
                offset += n * width * item
        return [
            np.concatenate(rows) if rows else np.empty((0, width * item), np.uint8)
            for rows, (width, _) in zip(parts, geometry.entries, strict=True)
        ]

    def read_snapshot(self, position: int) -> list[np.ndarray]:
        """Per window series, the rows uint8 [n, width * item] the snapshot at ``position`` holds."""
        geometry, item = self.geometry, self.geometry.item
        rows = geometry.window_rows(position)
        if position == 0:
            return [np.empty((0, width * item), np.uint8) for width, _, _ in geometry.windows]
        frame = self._snapshot_frames.get(position)
        if frame is None and self.bookmark is not None and self.bookmark.position == position:
            frame = self.bookmark
        if frame is None:
            raise ValueError(f"{self.path}: no snapshot at position {position} (snapshots: {self.snapshots})")
        payload, offset, out = self._read(frame), 0, []
        for n, (width, _, _) in zip(rows, geometry.windows, strict=True):
            out.append(payload[offset : offset + n * width * item].reshape(n, width * item))
            offset += n * width * item
        return out

    # ------------------------------------------------------------------------------------ writes
    def snapshots_due(self, end: int) -> list[int]:
        """The snapshots an append up to ``end`` writes: each kept one it passes, then ``end``."""
        every = self.geometry.snapshot_every
        kept = range((self.length // every + 1) * every, end, every)
        return [*kept, end]

    def append(
        self,
        tokens: np.ndarray,
        entries: list[np.ndarray],
        snapshots: dict[int, list[np.ndarray]],
        bookmark: int | None = None,
    ) -> None:
        """Log positions length..length+n: their tokens [n], per entry series the rows uint8 [k, width *
        item] of the windows they close, and the window state at each position of ``snapshots_due``.
        ``bookmark``: an earlier position whose state is kept too (the turn's prompt: an answer
        regenerated or edited restores there), after the end snapshot until the next append: given in
        ``snapshots`` if inside the new positions, else the log's own bookmark at it is carried."""
        n, geometry = len(tokens), self.geometry
        due = self.snapshots_due(self.length + n)
        inside = [b for b in [bookmark] if b is not None and self.length < b < self.length + n and b not in due]
        if n == 0 or sorted(snapshots) != sorted([*due, *inside]):
            raise ValueError(f"an append of {n} positions needs snapshots at {due} (and a bookmark inside it)")
        held = self.bookmark if self.bookmark is not None and self.bookmark.position == bookmark else None
        if held is None and bookmark == self.length and bookmark in self._snapshot_frames:
            held = self._snapshot_frames[bookmark]  # the end snapshot the append replaces (a kept one stays)
            held = None if bookmark % geometry.snapshot_every == 0 else held
        carried = bytes(self._read(held)) if held is not None else None
        snapshots = dict(snapshots)
        marked_rows = snapshots.pop(inside[0]) if inside else None
        data, cursor, first = bytearray(), [0] * len(geometry.entries), self.length
        frames: list[tuple[bytes, int, int]] = []
        for at in sorted(snapshots):
            if at > first:
                counts = geometry.entry_counts(first, at - first)
                pieces = [np.asarray(tokens[first - self.length : at - self.length], dtype="<u4").tobytes()]
                for i, k in enumerate(counts):
                    pieces.append(self._checked(entries[i][cursor[i] : cursor[i] + k], k, geometry.entries[i][0]))
                    cursor[i] += k
                frames.append((POSITIONS, first, at - first))
                data += _frame_bytes(POSITIONS, first, at - first, b"".join(pieces))
                first = at
            rows = geometry.window_rows(at)
            windows = [
                self._checked(r, k, w) for r, k, (w, _, _) in zip(snapshots[at], rows, geometry.windows, strict=True)
            ]
            frames.append((SNAPSHOT, at, 0))
            data += _frame_bytes(SNAPSHOT, at, 0, b"".join(windows))
        if cursor != [len(e) for e in entries]:
            raise ValueError(f"entries of {[len(e) for e in entries]} windows given, {cursor} closed")
        if marked_rows is not None and bookmark is not None:
            rows = geometry.window_rows(bookmark)
            series = zip(marked_rows, rows, geometry.windows, strict=True)
            carried = b"".join(self._checked(r, k, w) for r, k, (w, _, _) in series)
        if carried is not None and bookmark is not None:
            frames.append((BOOKMARK, bookmark, 0))
            data += _frame_bytes(BOOKMARK, bookmark, 0, carried)
        self._write(bytes(data), frames, np.asarray(tokens, dtype="<u4").tobytes())

    def _checked(self, rows: np.ndarray, count: int, width: int) -> bytes:
        shape = (count, width * self.geometry.item)
        if rows.shape != shape or rows.dtype != np.uint8:
            raise ValueError(f"rows must be uint8{list(shape)}, got {rows.dtype}{list(rows.shape)}")
        return rows.tobytes()

    def _write(self, data: bytes, frames: list[tuple[bytes, int, int]], tokens: bytes) -> None:
        """Write the frames over the end snapshot (unless it is a kept one), fsync, index them."""
        replaced = self._replaceable_tail()
        end = self._frames[-1].end if self._frames else HEADER_BYTES
        offset = self._frames[-replaced].offset if replaced else end
        old_end = os.pread(self._fd, end - offset, offset) if replaced else b""
        try:
            with write_errors(self.path, f"{len(frames)} KV log frame(s)"):
                self._fault("before_write")
                split = max(0, len(data) - len(data) // 4)  # a kill at "mid_record" leaves a torn frame
                _pwrite_all(self._fd, data[:split], offset)
                self._fault("mid_record")
                _pwrite_all(self._fd, data[split:], offset + split)
                self._fault("before_fsync")
                os.ftruncate(self._fd, offset + len(data))
                os.fsync(self._fd)
        except BaseException:  # a full disk: put the old end snapshot back, or the scan falls back further
            _cut_back(self._fd, offset)
            if old_end:
                try:
                    _pwrite_all(self._fd, old_end, offset)
                except OSError:
                    pass
            raise
        for _ in range(replaced):
            self._forget_last_frame()
        for tag, position, count in frames:
            size = FRAME_HEADER.size + self._payload_bytes(tag, position, count) + _CRC_BYTES
            self._index(Frame(tag, position, count, offset, offset + size))
            offset += size
        self._tokens.frombytes(tokens)
        self._fault("after_fsync")

    def _replaceable_tail(self) -> int:
        """How many frames at the end an append writes over: a bookmark, and an end snapshot unless it is a
        kept one."""
        tail = 0
        if self._frames and self._frames[-1].tag == BOOKMARK:
            tail = 1
        before = self._frames[-1 - tail] if len(self._frames) > tail else None
        if before is not None and before.tag == SNAPSHOT and before.position % self.geometry.snapshot_every:
            tail += 1
        return tail

    def _forget_last_frame(self) -> None:
        frame = self._frames.pop()
        if frame.tag == BOOKMARK:
            self.bookmark = None
        elif frame.tag == POSITIONS:
            self.length -= frame.count
            del self._tokens[frame.position :]
        elif self._snapshot_frames.pop(frame.position, None) is not None and frame.position:
            self.snapshots.remove(frame.position)

    def truncate(self, position: int) -> None:
        """Forget everything after the state at ``position``, which must be a restore point (a snapshot
        or 0): the log then ends with that state."""
        if self.bookmark is not None and position == self.bookmark.position and position not in self.snapshots:
            self._cut_to_bookmark()
            return
        if position not in self.snapshots:
            raise ValueError(f"a lean log is cut back to a snapshot ({self.snapshots}), not to {position}")
        while self._frames and not (self._frames[-1].tag == SNAPSHOT and self._frames[-1].position == position):
            self._forget_last_frame()
        end = self._frames[-1].end if self._frames else HEADER_BYTES
        # A device that fails the cut: the frames past ``end`` stay in the file, whole and valid (a reopen
        # restores from them, matched by token id), and this log, cut in memory, writes over them next.
        with write_errors(self.path, f"a cut-back of the KV log to position {position}"):
            os.ftruncate(self._fd, end)
            os.fsync(self._fd)

    def _cut_to_bookmark(self) -> None:
        """End the log at its bookmark b: the positions frame holding b cut there, the bookmark's state
        written after it as the end snapshot (a kill meanwhile leaves the frames before it whole)."""
        assert self.bookmark is not None
        b, payload = self.bookmark.position, bytes(self._read(self.bookmark))
        index = next(
            i for i, f in enumerate(self._frames) if f.tag == POSITIONS and f.position < b <= f.position + f.count
        )
        frame = self._frames[index]
        cut = frame.position + frame.count > b
        data, tokens = b"", b""
        if cut:
            data, tokens = self._positions_prefix(frame, b - frame.position)
        offset = frame.offset if cut else frame.end
        data += _frame_bytes(SNAPSHOT, b, 0, payload)
        try:
            with write_errors(self.path, f"a cut-back of the KV log to position {b}"):
                _pwrite_all(self._fd, data, offset)
                os.ftruncate(self._fd, offset + len(data))
                os.fsync(self._fd)
        except BaseException:  # the frame holding b may be half rewritten: index what the file holds now
            self._rescan()
            raise
        while len(self._frames) > index + (0 if cut else 1):
            self._forget_last_frame()
        snapshot_at = offset + len(data) - (FRAME_HEADER.size + len(payload) + _CRC_BYTES)
        if cut:
            self._index(Frame(POSITIONS, frame.position, b - frame.position, offset, snapshot_at))
            self._tokens.frombytes(tokens)
        self._index(Frame(SNAPSHOT, b, 0, snapshot_at, offset + len(data)))

    def _rescan(self) -> None:
        """Index the file's valid frames again after a failed write (what a reopen would restore); if even
        reading fails, the log holds nothing (the next open scans the file)."""
        try:
            self._recover(os.fstat(self._fd).st_size)
        except OSError:
            self._start_empty()

    def _positions_prefix(self, frame: Frame, count: int) -> tuple[bytes, bytes]:
        """(the frame of ``frame``'s first ``count`` positions, their token bytes)."""
        geometry, payload = self.geometry, self._read(frame)
        tokens = payload[: 4 * count].tobytes()
        pieces, offset = [tokens], 4 * frame.count
        held, wanted = geometry.entry_counts(frame.position, frame.count), geometry.entry_counts(frame.position, count)
        for n, k, (width, _) in zip(held, wanted, geometry.entries, strict=True):
            pieces.append(payload[offset : offset + k * width * geometry.item].tobytes())
            offset += n * width * geometry.item
        return _frame_bytes(POSITIONS, frame.position, count, b"".join(pieces)), tokens


def count_positions(path: str | os.PathLike[str], geometry: LeanGeometry) -> tuple[int, int]:
    """(positions, snapshots) of a lean log's frames in sequence, read from their headers only (no lock,
    no checksums: `kv ls`'s count; the next open checks them)."""
    positions, snapshots, offset = 0, 0, HEADER_BYTES
    opened = os.fdopen(open_regular(Path(path), "KV log", follow_symlinks=False), "rb")
    with opened as f, read_errors(Path(path), "the KV log's frame headers"):
        size = os.fstat(f.fileno()).st_size
        while offset + FRAME_HEADER.size <= size:
            tag, zero, position, count = FRAME_HEADER.unpack(os.pread(f.fileno(), FRAME_HEADER.size, offset))
            if zero or position != positions or tag not in (POSITIONS, SNAPSHOT) or (tag == SNAPSHOT) != (count == 0):
                break
            if tag == POSITIONS and count > (size - offset) // 4:
                break
            size_of = geometry.positions_payload_bytes if tag == POSITIONS else None
            payload = size_of(position, count) if size_of else geometry.snapshot_payload_bytes(position)
            end = offset + FRAME_HEADER.size + payload + _CRC_BYTES
            if end > size:
                break
            positions, snapshots, offset = positions + count, snapshots + (tag == SNAPSHOT), end
    return positions, snapshots
