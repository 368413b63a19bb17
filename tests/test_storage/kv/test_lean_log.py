"""The lean KV log (format 4, DeepSeek-V4's sessions) under crashes, truncation and bit rot: whatever
happens, what opens is a prefix of what was appended, every snapshot it offers reads back exactly what
was written (a torn one is never offered), and a file of another kind is refused untouched."""

from __future__ import annotations

import hashlib
import os
import random

import numpy as np
import pytest

from storage.errors import IncompatibleStateError
from storage.kv.geometry import LeanGeometry, RowsGeometry
from storage.kv.lean_log import LeanLog, count_positions
from storage.kv.log import HEADER_BYTES, KVLog, StateMismatchError
from tests.test_storage.kv.test_kvlog import kill_at

# Odd widths: an entry series closing every 2 positions and one every 4; a sliding window of 3 rows, an
# overlapping compressor (rate 2, keep 1) and a plain one (rate 4).
# with O_DIRECT, fadvise, cgroups and /proc forced off too (tests/test_storage/conftest.py); the exhaustive
# loops (ONCE) run as the platform is
pytestmark = pytest.mark.usefixtures("io_features")
ONCE = pytest.mark.parametrize("io_features", ["platform"], indirect=True)


GEOMETRY = LeanGeometry.sized(((51, 2), (29, 4)), ((71, 1, 3), (61, 2, 1), (53, 4, 0)), "float32")


def _bytes(seed: int, n: int) -> np.ndarray:
    return ((np.arange(n) * 7 + seed * 13) % 251).astype(np.uint8)


def _rows(seeds: list[int], width: int) -> np.ndarray:
    return np.array([_bytes(seed, width) for seed in seeds], dtype=np.uint8).reshape(len(seeds), width)


def entry_rows(series: int, first_window: int, count: int) -> np.ndarray:
    width = GEOMETRY.entries[series][0] * GEOMETRY.item
    return _rows([1000 * series + w for w in range(first_window, first_window + count)], width)


def window_rows(position: int) -> list[np.ndarray]:
    rows = GEOMETRY.window_rows(position)
    return [
        _rows([position * 31 + 7 * j + r for r in range(n)], width * GEOMETRY.item)
        for j, (n, (width, _, _)) in enumerate(zip(rows, GEOMETRY.windows, strict=True))
    ]


def append(log: LeanLog, count: int, bookmark: int | None = None) -> None:
    first = log.length
    entries = [
        entry_rows(i, first // period, n)
        for i, ((_, period), n) in enumerate(zip(GEOMETRY.entries, GEOMETRY.entry_counts(first, count), strict=True))
    ]
    snapshots = {at: window_rows(at) for at in log.snapshots_due(first + count)}
    if bookmark is not None and first < bookmark < first + count:
        snapshots.setdefault(bookmark, window_rows(bookmark))
    log.append(np.arange(first, first + count, dtype=np.uint32), entries, snapshots, bookmark)


def check(log: LeanLog) -> None:
    """Everything the log offers is what was written."""
    assert log.tokens().tolist() == list(range(log.length))
    for i, (rows, (_, period)) in enumerate(zip(log.read_entries(log.length), GEOMETRY.entries, strict=True)):
        assert np.array_equal(rows, entry_rows(i, 0, log.length // period))
    marks = [log.bookmark.position] if log.bookmark is not None else []
    for at in [*log.snapshots, *marks]:
        assert all(np.array_equal(a, b) for a, b in zip(log.read_snapshot(at), window_rows(at), strict=True))


def test_the_interval_keeps_a_long_log_within_twice_the_entries():
    assert GEOMETRY.snapshot_every % 4 == 0
    assert GEOMETRY.bytes_per_token <= 2 * GEOMETRY.entry_bytes_per_token


def test_appends_truncation_to_a_snapshot_and_reopening(tmp_path):
    path = tmp_path / "s.kvlog"
    every = GEOMETRY.snapshot_every
    with LeanLog(path, "fp", GEOMETRY) as log:
        for count in (3, 1, every, 5, every + 2):
            append(log, count)
            check(log)
        end = log.length
        assert log.snapshots == [0, every, 2 * every, end]
        assert log.restore_point(2 * every + 1) == 2 * every and log.restore_point(every - 1) == 0
        log.truncate(every)
        assert (log.length, log.snapshots) == (every, [0, every])
        append(log, 7)
    with LeanLog(path, "fp", GEOMETRY) as log:
        assert log.length == every + 7 and log.snapshots == [0, every, every + 7]
        check(log)
        assert log.common_prefix([0, 1, 2, 99]) == 3
    assert count_positions(path, GEOMETRY) == (every + 7, 2)


def test_the_end_snapshot_is_replaced_the_kept_ones_stay(tmp_path):
    path = tmp_path / "s.kvlog"
    with LeanLog(path, "fp", GEOMETRY) as log:
        for _ in range(3 * GEOMETRY.snapshot_every):
            append(log, 1)
        assert log.snapshots == [0, GEOMETRY.snapshot_every, 2 * GEOMETRY.snapshot_every, 3 * GEOMETRY.snapshot_every]
        append(log, 1)
    size = os.path.getsize(path) - HEADER_BYTES
    assert size <= (3 * GEOMETRY.snapshot_every + 1) * GEOMETRY.bytes_per_token + GEOMETRY.end_snapshot_bytes


def _child(path, point: str) -> None:
    log = LeanLog(path, "fp", GEOMETRY, fault=kill_at(point))
    append(log, random.Random(os.getpid()).randint(1, GEOMETRY.snapshot_every + 3))
    os._exit(0)


@ONCE
@pytest.mark.parametrize("point", ["before_write", "mid_record", "before_fsync", "after_fsync"])
def test_kill_9_during_an_append_leaves_a_prefix_and_never_a_torn_snapshot(tmp_path, point):
    path = tmp_path / "s.kvlog"
    with LeanLog(path, "fp", GEOMETRY) as log:
        append(log, 5)
    for _ in range(4):
        with LeanLog(path, "fp", GEOMETRY) as log:
            before = log.length
        pid = os.fork()
        if pid == 0:
            try:
                _child(path, point)
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status)
        with LeanLog(path, "fp", GEOMETRY) as log:
            check(log)  # every offered snapshot whole and as written
            if point == "after_fsync":
                assert log.length > before and log.snapshots[-1] == log.length
            if point == "before_write":
                assert log.length == before


@ONCE
def test_every_one_byte_truncation_opens_as_a_checked_prefix(tmp_path):
    full_path = tmp_path / "full.kvlog"
    with LeanLog(full_path, "fp", GEOMETRY) as log:
        for count in (2, GEOMETRY.snapshot_every, 3):
            append(log, count)
    full = full_path.read_bytes()
    path = tmp_path / "cut.kvlog"
    lengths = set()
    for size in range(HEADER_BYTES, len(full) + 1):
        path.write_bytes(full[:size])
        with LeanLog(path, "fp", GEOMETRY) as log:
            check(log)
            lengths.add(log.length)
        assert os.path.getsize(path) <= size
    every = GEOMETRY.snapshot_every
    assert lengths == {0, 2, every, 2 + every, 5 + every}  # the kept snapshot at 16 splits a frame


def test_random_bit_flips_cut_the_log_at_the_damaged_frame(tmp_path):
    path = tmp_path / "s.kvlog"
    with LeanLog(path, "fp", GEOMETRY) as log:
        for count in (3, GEOMETRY.snapshot_every, 4):
            append(log, count)
        frames = log.frames
    full = bytearray(path.read_bytes())
    rng = random.Random(2)
    for _ in range(200):
        at = rng.randrange(HEADER_BYTES, len(full))
        damaged = bytearray(full)
        damaged[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        with LeanLog(path, "fp", GEOMETRY) as log:
            check(log)
            assert len(log.frames) == next(i for i, f in enumerate(frames) if f.offset <= at < f.end)


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_another_kind_or_geometry_is_refused_untouched(tmp_path):
    rows = tmp_path / "rows.kvlog"
    with KVLog(rows, "fp", RowsGeometry(((4, 8), (4,)), "float32")) as log:
        log.append(np.arange(2, dtype=np.uint32), np.zeros((2, log.geometry.payload_bytes), np.uint8))
    before = _digest(rows)
    with pytest.raises(StateMismatchError, match="format version is 3, this run's geometry is written in version 4"):
        LeanLog(rows, "fp", GEOMETRY)
    assert _digest(rows) == before
    lean = tmp_path / "lean.kvlog"
    with LeanLog(lean, "fp", GEOMETRY) as log:
        append(log, 3)
    before = _digest(lean)
    other = LeanGeometry(GEOMETRY.entries, GEOMETRY.windows, GEOMETRY.snapshot_every * 2, "float32")
    with pytest.raises(IncompatibleStateError, match="geometry snapshot_every"):
        LeanLog(lean, "fp", other)
    with pytest.raises(TypeError, match="KVLog does not write LeanGeometry"):
        KVLog(tmp_path / "x.kvlog", "fp", GEOMETRY)  # type: ignore[arg-type]
    assert _digest(lean) == before and not (tmp_path / "x.kvlog").exists()


def test_a_bookmark_is_carried_restored_and_cut_back_to(tmp_path):
    """The state at a turn's last prompt position (the bookmark) rides after the end snapshot: carried by
    later appends of the turn, reopened, and a cut-back to it ends the log there."""
    path = tmp_path / "s.kvlog"
    every = GEOMETRY.snapshot_every
    with LeanLog(path, "fp", GEOMETRY) as log:
        append(log, every + 5)
        append(log, 9, bookmark=every + 11)  # inside the new positions
        append(log, 1, bookmark=every + 11)  # carried
        append(log, 2, bookmark=every + 11)
        assert log.bookmark is not None and log.bookmark.position == every + 11
        assert log.restore_point(every + 12) == every + 11 and log.restore_point(every + 10) == every
        check(log)
    with LeanLog(path, "fp", GEOMETRY) as log:
        assert log.bookmark is not None and log.bookmark.position == every + 11
        check(log)
        log.truncate(every + 11)  # inside a positions frame: cut there, the state written as its end
        assert (log.length, log.snapshots, log.bookmark) == (every + 11, [0, every, every + 11], None)
        check(log)
        append(log, 3, bookmark=every + 11)  # the end snapshot becomes the bookmark
        assert log.bookmark is not None and log.bookmark.position == every + 11
        append(log, 2)  # a turn without one drops it
        assert log.bookmark is None and log.restore_point(every + 12) == every
    with LeanLog(path, "fp", GEOMETRY) as log:
        assert log.length == every + 16
        check(log)
