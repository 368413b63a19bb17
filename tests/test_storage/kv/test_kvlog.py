"""The KV log under crashes, truncation, bit rot and foreign files, for both record geometries: MLA's
(format 2) and DeepSeek-V4's per-layer rows (format 3). A format-2 log is byte for byte what builds
before format 3 wrote."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import signal
import struct
import time

import numpy as np
import pytest

from storage.errors import CorruptDataError, FormatError, IncompatibleStateError
from storage.files.checksum import crc32c
from storage.kv import log as kvlog
from storage.kv.log import (
    HEADER_BYTES,
    FaultHook,
    KVGeometry,
    KVLog,
    RowsGeometry,
    StateMismatchError,
    count_valid_records,
    read_header_state,
    remove_log,
)

# with O_DIRECT, fadvise, cgroups and /proc forced off too (tests/test_storage/conftest.py); the exhaustive
# loops (ONCE) run as the platform is
pytestmark = pytest.mark.usefixtures("io_features")
ONCE = pytest.mark.parametrize("io_features", ["platform"], indirect=True)


def kill_at(point: str) -> FaultHook:
    """The crash tests' fault hook: SIGKILL this process at the named point of an append."""

    def hook(reached: str) -> None:
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


GEOMETRY = KVGeometry(
    n_layers=2, kv_lora_rank=4, qk_rope_head_dim=2, index_layers=(0,), index_head_dim=3, dtype="float32"
)
# DeepSeek-V4's shape of record at tiny widths: a CSA layer (kv, compressor kv/gate x2, indexer kv/gate),
# an HCA layer (kv, compressor kv/gate) and a sliding layer (kv).
ROWS = RowsGeometry(((4, 8, 8, 6, 6), (4, 4, 4), (4,)), "float32")
GEOMETRIES = pytest.mark.parametrize("geometry", [GEOMETRY, ROWS], ids=["mla", "v4-rows"])


def payload(position: int, geometry=GEOMETRY) -> np.ndarray:
    """Deterministic content for a position, so any recovered record can be checked."""
    return ((np.arange(geometry.payload_bytes) * 7 + position * 13) % 251).astype(np.uint8)


def append_positions(log: KVLog, count: int, sync: bool = True) -> None:
    positions = range(log.length, log.length + count)
    payloads = np.stack([payload(p, log.geometry) for p in positions])
    log.append(np.array(positions, dtype=np.uint32), payloads, sync=sync)


def assert_is_a_prefix(path, at_least: int = 0, geometry=GEOMETRY) -> int:
    with KVLog(path, "fp", geometry) as log:
        tokens, payloads = log.read()
        assert log.length >= at_least
        assert tokens.tolist() == list(range(log.length))
        assert all(np.array_equal(payloads[i], payload(i, geometry)) for i in range(log.length))
        assert os.path.getsize(path) == HEADER_BYTES + log.length * geometry.record_bytes  # torn tail cut
        return log.length


def _child(path, geometry, fault_point: str | None, batches: int, ack_fd: int) -> None:
    log = KVLog(path, "fp", geometry, fault=kill_at(fault_point) if fault_point else None)
    os.write(ack_fd, b"open\n")  # the parent's kill clock starts here, not while the log is still opening
    rng = random.Random(os.getpid())
    for _ in range(batches):
        append_positions(log, rng.randint(1, 3))
        os.write(ack_fd, f"{log.length}\n".encode())  # acknowledged: fsync completed
    os._exit(0)


def _run_child(path, geometry=GEOMETRY, fault_point=None, batches=10_000, kill_after=None) -> int:
    """Fork a writer; kill -9 it (after ``kill_after`` seconds) or let the fault hook do it; return acked length."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            _child(path, geometry, fault_point, batches, write_fd)
        finally:
            os._exit(1)
    os.close(write_fd)
    acked = b""
    if kill_after is not None:
        while b"\n" not in acked and (chunk := os.read(read_fd, 65536)):
            acked += chunk  # wait for "open": a kill during start-up tests nothing
        time.sleep(kill_after)
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    while chunk := os.read(read_fd, 65536):
        acked += chunk
    os.close(read_fd)
    lengths = [line for line in acked.decode().split() if line != "open"]
    return int(lengths[-1]) if lengths else 0


@ONCE
@pytest.mark.parametrize(("geometry", "kills"), [(GEOMETRY, 200), (ROWS, 80)], ids=["mla", "v4-rows"])
def test_kill_9_at_random_points_recovers_a_prefix_holding_every_acknowledged_record(tmp_path, geometry, kills):
    path = tmp_path / "s.kvlog"
    rng = random.Random(0)
    previous, landed = 0, 0
    for _ in range(kills):
        acked = _run_child(path, geometry, kill_after=rng.uniform(0, 0.01))
        recovered = assert_is_a_prefix(path, at_least=max(acked, previous), geometry=geometry)
        landed += recovered > previous
        previous = recovered
    # The kills really landed among appends (measured idle: ~110 of 200; under heavy load fewer).
    assert landed >= kills // 10


@GEOMETRIES
@ONCE
@pytest.mark.parametrize("point", ["before_write", "mid_record", "before_fsync", "after_fsync"])
def test_kill_9_at_instrumented_points(tmp_path, point, geometry):
    path = tmp_path / "s.kvlog"
    with KVLog(path, "fp", geometry) as log:
        append_positions(log, 5)
    for _ in range(5):
        before = assert_is_a_prefix(path, geometry=geometry)
        _run_child(path, geometry, fault_point=point, batches=1)
        after = assert_is_a_prefix(path, at_least=before, geometry=geometry)
        if point == "before_write":
            assert after == before
        if point == "after_fsync":
            assert after > before  # the batch was fsynced before the kill: nothing lost
        if point == "mid_record":
            assert after < before + 3  # the torn last record never survives


def _file_with_records(path, count: int, geometry=GEOMETRY) -> bytes:
    with KVLog(path, "fp", geometry) as log:
        append_positions(log, count)
    return path.read_bytes()


@ONCE
@pytest.mark.parametrize(("geometry", "records"), [(GEOMETRY, 64), (ROWS, 16)], ids=["mla", "v4-rows"])
def test_every_one_byte_truncation_gives_a_prefix_or_a_typed_header_error(tmp_path, geometry, records):
    full = _file_with_records(tmp_path / "full.kvlog", records, geometry)
    path = tmp_path / "cut.kvlog"
    for size in range(len(full)):
        path.write_bytes(full[:size])
        if size == 0:
            expected = 0  # an empty file is a new session
        elif size < HEADER_BYTES:
            with pytest.raises((FormatError, CorruptDataError)):
                KVLog(path, "fp", geometry)
            continue
        else:
            expected = (size - HEADER_BYTES) // geometry.record_bytes
        assert assert_is_a_prefix(path, geometry=geometry) == expected, size


@GEOMETRIES
def test_ten_thousand_random_bit_flips_are_all_detected(tmp_path, geometry):
    records = bytearray(_file_with_records(tmp_path / "f.kvlog", 64, geometry)[HEADER_BYTES:])
    rng = random.Random(1)
    size = geometry.record_bytes
    for _ in range(10_000):
        bit = rng.randrange(len(records) * 8)
        records[bit // 8] ^= 1 << (bit % 8)
        assert count_valid_records(records, size) == (bit // 8) // size  # stops exactly at the damaged record
        records[bit // 8] ^= 1 << (bit % 8)
    assert count_valid_records(records, size) == 64


@GEOMETRIES
def test_a_record_moved_to_another_position_fails_its_checksum(tmp_path, geometry):
    records = bytearray(_file_with_records(tmp_path / "f.kvlog", 4, geometry)[HEADER_BYTES:])
    size = geometry.record_bytes
    records[size : 2 * size] = records[2 * size : 3 * size]
    assert count_valid_records(records, size) == 1


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "written, fingerprint, geometry, message",
    [
        (GEOMETRY, "another-model", GEOMETRY, "fingerprint mismatch"),
        (GEOMETRY, "fp", KVGeometry(2, 4, 2, (), 3, "float32"), "geometry"),
        (GEOMETRY, "fp", KVGeometry(2, 4, 2, (0,), 3, "bfloat16"), "geometry"),
        (ROWS, "another-model", ROWS, "fingerprint mismatch"),
        (ROWS, "fp", RowsGeometry(((4, 8, 8, 6, 6), (4, 4, 4), (4, 4, 4)), "float32"), "geometry layer_rows"),
        (ROWS, "fp", RowsGeometry(ROWS.layer_rows, "bfloat16"), "geometry dtype"),
        (ROWS, "fp", GEOMETRY, "format version is 3, this run's geometry is written in version 2"),
        (GEOMETRY, "fp", ROWS, "format version is 2, this run's geometry is written in version 3"),
    ],
)
def test_a_foreign_log_is_refused_and_left_untouched(tmp_path, written, fingerprint, geometry, message):
    path = tmp_path / "s.kvlog"
    _file_with_records(path, 10, written)
    before = _digest(path)
    with pytest.raises(IncompatibleStateError, match=message):
        KVLog(path, fingerprint, geometry)
    assert _digest(path) == before


def test_header_damage_is_a_typed_error(tmp_path):
    path = tmp_path / "s.kvlog"
    data = bytearray(_file_with_records(path, 3))
    data[20] ^= 0x04  # inside the header JSON
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match="header checksum"):
        KVLog(path, "fp", GEOMETRY)
    path.write_bytes(b"NOTAKVLOG" + bytes(data[9:]))
    with pytest.raises(FormatError, match="bad magic"):
        KVLog(path, "fp", GEOMETRY)


def test_a_session_in_use_is_refused(tmp_path):
    path = tmp_path / "s.kvlog"
    with KVLog(path, "fp", GEOMETRY):
        with pytest.raises(IncompatibleStateError, match="in use by another process"):
            KVLog(path, "fp", GEOMETRY)
    KVLog(path, "fp", GEOMETRY).close()  # free again once closed


@GEOMETRIES
def test_truncate_on_divergence(tmp_path, geometry):
    path = tmp_path / "s.kvlog"
    with KVLog(path, "fp", geometry) as log:
        append_positions(log, 10)
        log.truncate(4)
        append_positions(log, 2)
    assert assert_is_a_prefix(path, geometry=geometry) == 6


def test_a_log_written_under_another_state_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "s.kvlog"
    with KVLog(path, "fp", GEOMETRY, state={"compute_dtype": "bfloat16"}) as log:
        append_positions(log, 3)
    before = _digest(path)
    with pytest.raises(StateMismatchError, match="state compute_dtype is 'bfloat16', this run's is 'float32'") as err:
        KVLog(path, "fp", GEOMETRY, state={"compute_dtype": "float32"})
    assert (err.value.field, err.value.stored, err.value.current) == ("state.compute_dtype", "bfloat16", "float32")
    assert _digest(path) == before
    with KVLog(path, "fp", GEOMETRY, state={"compute_dtype": "bfloat16"}) as log:
        assert log.length == 3


def test_fresh_starts_over_a_log_whatever_its_header_holds(tmp_path):
    path = tmp_path / "s.kvlog"
    data = bytearray(_file_with_records(path, 5))
    data[20] ^= 0x04
    path.write_bytes(bytes(data))
    with KVLog(path, "another-model", GEOMETRY, fresh=True) as log:
        assert log.length == 0
        append_positions(log, 2)
    with KVLog(path, "another-model", GEOMETRY) as log:
        assert log.length == 2


def test_remove_log_needs_no_valid_header_but_respects_the_lock(tmp_path):
    path = tmp_path / "s.kvlog"
    path.write_bytes(kvlog.MAGIC + b"NOTAKVLOG" * 10)  # ours (the magic), its header unreadable
    with open(path, "r+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(IncompatibleStateError, match="in use by another process"):
            remove_log(path)
    remove_log(path)
    assert not path.exists()


@GEOMETRIES
def test_scan_read_and_common_prefix_agree_across_chunk_boundaries(tmp_path, monkeypatch, geometry):
    monkeypatch.setattr(kvlog, "CHUNK_BYTES", 3 * geometry.record_bytes + 1)  # 3 records per chunk
    path = tmp_path / "s.kvlog"
    _file_with_records(path, 10, geometry)
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 7 * geometry.record_bytes + 5] ^= 0x10  # record 7, inside the third chunk
    path.write_bytes(bytes(data))
    with KVLog(path, "fp", geometry) as log:
        assert log.length == 7
        tokens, payloads = log.read()
        assert tokens.tolist() == list(range(7))
        assert all(np.array_equal(payloads[i], payload(i, geometry)) for i in range(7))
        assert log.common_prefix(list(range(7))) == 7
        assert log.common_prefix([0, 1, 2, 3, 99, 5]) == 4  # diverges in the second chunk
        assert log.common_prefix(list(range(20))) == 7
        assert log.common_prefix([]) == 0


# ------------------------------------------------------------------------------------ format versions
# sha256 of _format_2_bytes(5): the file the build before format 3 (commit 222eccd) wrote for these
# records, measured by running that build's KVLog.
FORMAT_2_SHA256 = "b63db5a286ae1f7d413647297c6b95413502da213ee2591348485a9a29f7c554"


def _format_2_bytes(records: int) -> bytes:
    """A version-2 log of GEOMETRY laid out by hand from the format: header, then per position
    u32 token | payload | u32 crc32c(u64 position, token, payload)."""
    meta = json.dumps(
        {
            "format_version": 2,
            "fingerprint": "fp",
            "geometry": {
                "n_layers": 2,
                "kv_lora_rank": 4,
                "qk_rope_head_dim": 2,
                "index_layers": [0],
                "index_head_dim": 3,
                "dtype": "float32",
            },
            "state": {"compute_dtype": "float32"},
        },
        sort_keys=True,
    ).encode()
    data = (b"COLIKV\x00\x01" + struct.pack("<I", len(meta)) + meta + struct.pack("<I", crc32c(meta))).ljust(
        HEADER_BYTES, b"\x00"
    )
    for position in range(records):
        body = struct.pack("<I", position) + payload(position).tobytes()
        data += body + struct.pack("<I", crc32c(body, crc32c(struct.pack("<Q", position))))
    return data


def test_an_mla_log_is_format_2_byte_for_byte_and_an_old_one_reads_as_before(tmp_path):
    old = _format_2_bytes(5)
    assert hashlib.sha256(old).hexdigest() == FORMAT_2_SHA256
    written = tmp_path / "new.kvlog"
    with KVLog(written, "fp", GEOMETRY, state={"compute_dtype": "float32"}) as log:
        append_positions(log, 5)
    assert written.read_bytes() == old  # this build still writes what older builds read
    path = tmp_path / "old.kvlog"
    path.write_bytes(old + b"\x07" * 10)  # and reads theirs, a torn tail cut as before
    with KVLog(path, "fp", GEOMETRY, state={"compute_dtype": "float32"}) as log:
        tokens, payloads = log.read()
        assert tokens.tolist() == list(range(5))
        assert all(np.array_equal(payloads[i], payload(i)) for i in range(5))
        append_positions(log, 2)
    assert path.read_bytes() == _format_2_bytes(7)


def test_a_rows_log_is_format_3_and_its_header_gives_back_the_geometry(tmp_path):
    path = tmp_path / "s.kvlog"
    _file_with_records(path, 3, ROWS)
    meta = path.read_bytes()[12 : 12 + struct.unpack_from("<I", path.read_bytes(), 8)[0]]
    header = json.loads(meta)
    assert header["format_version"] == 3
    assert header["geometry"] == {"layer_rows": [[4, 8, 8, 6, 6], [4, 4, 4], [4]], "dtype": "float32"}
    assert read_header_state(path)[1] == ROWS
    assert ROWS.record_bytes == 4 + (32 + 12 + 4) * 4 + 4


def _rewrite_header(path, **changes) -> None:
    """Replace header fields, with a valid checksum: what a buggy or hostile writer could leave."""
    data = path.read_bytes()
    (length,) = struct.unpack_from("<I", data, 8)
    meta = json.dumps({**json.loads(data[12 : 12 + length]), **changes}, sort_keys=True).encode()
    header = (data[:8] + struct.pack("<I", len(meta)) + meta + struct.pack("<I", crc32c(meta))).ljust(
        HEADER_BYTES, b"\x00"
    )
    path.write_bytes(header + data[HEADER_BYTES:])


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"format_version": 5}, "format version 5 is not supported"),
        ({"format_version": 3.0}, "format version 3.0 is not supported"),
        ({"format_version": 1}, "format version 1 is not supported"),
        ({"geometry": {"layer_rows": [[4, 0]], "dtype": "float32"}}, "positive row widths"),
        ({"geometry": {"layer_rows": [[4, True]], "dtype": "float32"}}, "positive row widths"),
        ({"geometry": {"layer_rows": [], "dtype": "float32"}}, "positive row widths"),
        ({"geometry": {"layer_rows": [4, 8], "dtype": "float32"}}, "geometry is malformed"),
        ({"geometry": {"layer_rows": [[1 << 40]], "dtype": "float32"}}, "positive row widths"),
        ({"geometry": {"layer_rows": [[4]], "dtype": "float16"}}, "dtype 'float16'"),
        ({"geometry": {"dtype": "float32"}}, "geometry is malformed"),
        ({"geometry": "rows"}, "geometry is malformed"),
    ],
)
def test_a_bad_rows_header_is_one_format_error_and_the_log_is_untouched(tmp_path, changes, message):
    path = tmp_path / "s.kvlog"
    _file_with_records(path, 3, ROWS)
    _rewrite_header(path, **changes)
    before = _digest(path)
    with pytest.raises(FormatError, match=message):
        read_header_state(path)
    with pytest.raises((FormatError, IncompatibleStateError)):
        KVLog(path, "fp", ROWS)
    assert _digest(path) == before
