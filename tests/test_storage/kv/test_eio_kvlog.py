"""A device that fails under the KV log, for real: ext4 on a loop device whose writes start failing
mid-run (colibri_stream/devtools/fuzz/disks.py; root only, skipped otherwise saying why).

Every write, cut and fsync of a log (append, cut-back, recovery's tail cut, the lean log's cut-back)
must raise DiskWriteError naming the file in one line, and the disk must hold the log at its last
acknowledged record once the device is back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from storage.errors import CorruptDataError, DiskWriteError
from storage.kv.geometry import LeanGeometry
from storage.kv.lean_log import LeanLog
from storage.kv.log import HEADER_BYTES, KVGeometry, KVLog

# with O_DIRECT, fadvise, cgroups and /proc forced off too (tests/test_storage/conftest.py)
pytestmark = pytest.mark.usefixtures("io_features")


GEOMETRY = KVGeometry(
    n_layers=2, kv_lora_rank=48, qk_rope_head_dim=16, index_layers=(1,), index_head_dim=24, dtype="float32"
)


def _batch(log: KVLog, n: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.arange(100 + log.length, 100 + log.length + n, dtype=np.uint32)
    payloads = (np.arange(n * GEOMETRY.payload_bytes, dtype=np.int64).reshape(n, -1) + log.length) % 251
    return tokens, payloads.astype(np.uint8)


def _one_line(error: pytest.ExceptionInfo, path: Path) -> str:
    message = str(error.value)
    assert str(path) in message and "I/O error" in message and "\n" not in message, message
    return message


def _check_acknowledged(path: Path, acknowledged: int) -> None:
    with KVLog(path, "fp", GEOMETRY) as log:
        assert log.length == acknowledged
        tokens, _ = log.read()
        assert tokens.tolist() == list(range(100, 100 + acknowledged))


def test_an_append_on_a_failing_device_raises_and_keeps_what_was_acknowledged(failing_disk):
    path = failing_disk.path / "s.kvlog"
    with KVLog(path, "fp", GEOMETRY) as log:
        log.append(*_batch(log, 5))
        failing_disk.fail()
        with pytest.raises(DiskWriteError) as failed:
            log.append(*_batch(log, 3))
        _one_line(failed, path)
        assert log.length == 5
        with pytest.raises(DiskWriteError) as again:  # the filesystem has gone read-only: still typed
            log.append(*_batch(log, 1))
        _one_line(again, path)
    failing_disk.heal()
    _check_acknowledged(path, 5)


def test_a_cut_back_on_a_failing_device_raises_and_the_log_holds_whole_records(failing_disk):
    path = failing_disk.path / "s.kvlog"
    with KVLog(path, "fp", GEOMETRY) as log:
        log.append(*_batch(log, 6))
        failing_disk.fail()
        with pytest.raises(DiskWriteError) as failed:
            log.truncate(2)
        assert "cut-back" in _one_line(failed, path)
        assert log.length in (2, 6)  # what the file holds: the cut was made in memory or not at all
    failing_disk.heal()
    with KVLog(path, "fp", GEOMETRY) as log:  # the old records (whole, valid) or the cut: nothing torn
        assert log.length in (2, 6)
        assert log.read()[0].tolist() == list(range(100, 100 + log.length))


def test_a_recovery_cut_on_a_failing_device_refuses_the_open_and_keeps_the_prefix(failing_disk):
    path = failing_disk.path / "s.kvlog"
    with KVLog(path, "fp", GEOMETRY) as log:
        log.append(*_batch(log, 4))
    with open(path, "ab") as f:  # a torn record after the acknowledged ones (a kill mid-append)
        f.write(b"\x01" * (GEOMETRY.record_bytes // 2))
    failing_disk.heal()  # the torn tail on disk
    torn_size = len(path.read_bytes())  # now cached: the failed device still reads it, only writes fail
    failing_disk.fail()
    with pytest.raises(DiskWriteError) as failed:
        KVLog(path, "fp", GEOMETRY)
    assert "recovery cut" in _one_line(failed, path)
    failing_disk.heal()
    assert path.stat().st_size in (torn_size, HEADER_BYTES + 4 * GEOMETRY.record_bytes)
    _check_acknowledged(path, 4)


def test_a_device_failing_reads_at_open_is_a_typed_error(failing_disk):
    path = failing_disk.path / "s.kvlog"
    with KVLog(path, "fp", GEOMETRY) as log:
        log.append(*_batch(log, 300))  # past the first MiB the failed device still serves
    failing_disk.heal()  # nothing cached
    path.stat()  # the inode is read before the failure: only the records' blocks fail
    failing_disk.fail()
    with pytest.raises((CorruptDataError, DiskWriteError)) as failed:
        with KVLog(path, "fp", GEOMETRY) as log:
            log.read()
    message = str(failed.value)
    assert str(path) in message and "I/O error" in message and "\n" not in message, message
    failing_disk.heal()
    _check_acknowledged(path, 300)


LEAN = LeanGeometry(entries=((8, 1),), windows=((8, 4, 1),), snapshot_every=4, dtype="float32")


def _lean_append(log: LeanLog, n: int) -> None:
    start, end, item = log.length, log.length + n, LEAN.item
    entries = [
        np.full((k, width * item), 7, np.uint8)
        for k, (width, _) in zip(LEAN.entry_counts(start, n), LEAN.entries, strict=True)
    ]
    windows = {
        at: [
            np.full((k, w * item), at % 251, np.uint8)
            for k, (w, _, _) in zip(LEAN.window_rows(at), LEAN.windows, strict=True)
        ]
        for at in log.snapshots_due(end)
    }
    log.append(np.arange(start, end, dtype=np.uint32), entries, windows)


def test_a_lean_log_cut_back_on_a_failing_device_raises_in_one_line(failing_disk):
    path = failing_disk.path / "v4.kvlog"
    with LeanLog(path, "fp", LEAN) as log:
        _lean_append(log, 9)  # kept snapshots at 4 and 8, the end one at 9
        acknowledged = log.tokens().tolist()
        failing_disk.fail()
        with pytest.raises(DiskWriteError) as failed:
            log.truncate(4)
        assert "cut-back" in _one_line(failed, path)
    failing_disk.heal()
    with LeanLog(path, "fp", LEAN) as log:  # the cut, or the old frames whole: a prefix of what was acknowledged
        assert log.length in (4, 9)
        assert log.tokens().tolist() == acknowledged[: log.length]
