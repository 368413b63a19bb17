"""Weight identity that a replacement cannot fool (issue 39 item 4): the HF weight-hash cache is keyed
by each shard's inode, size, mtime and ctime, and the sampled hash covers pages of every tensor and a
grid over every shard, with the limit it states."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time

import pytest

from colibri_stream.checkpoint import fingerprint
from colibri_stream.checkpoint.fingerprint import model_fingerprint, shard_digest
from colibri_stream.devtools import fixtures

SHARD = "model.safetensors"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def twins(tiny_checkpoints, tmp_path_factory):
    a = tiny_checkpoints["deepseek_v3"]
    b = fixtures.build_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("twin") / "b", seed=777)
    assert (a / SHARD).stat().st_size == (b / SHARD).stat().st_size
    return a, b


@pytest.fixture
def copy(twins, tmp_path, monkeypatch):
    """A copy of twin A whose weight hash is cached (as if it had been there a while)."""
    monkeypatch.setattr(fingerprint, "RACY_NS", 0)
    path = tmp_path / "model"
    shutil.copytree(twins[0], path)
    return path


def _restore_times(path, status) -> None:
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))


@pytest.mark.parametrize("how", ["renamed over", "rewritten in place"])
def test_a_same_size_replacement_with_its_mtime_restored_gets_a_new_fingerprint(twins, copy, how):
    original = model_fingerprint(copy)
    before = (copy / SHARD).stat()
    time.sleep(0.05)  # past a coarse timestamp tick: the rewrite's ctime is another one
    if how == "renamed over":  # another inode
        shutil.copyfile(twins[1] / SHARD, copy / "incoming")
        os.replace(copy / "incoming", copy / SHARD)
    else:  # same inode: only the ctime tells
        (copy / SHARD).write_bytes((twins[1] / SHARD).read_bytes())
    _restore_times(copy / SHARD, before)
    after = (copy / SHARD).stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert model_fingerprint(copy) != original  # was: the cached hash of the replaced weights
    assert model_fingerprint(copy) == model_fingerprint(twins[1])


def test_an_edit_inside_a_tensor_away_from_the_old_64_byte_samples_is_seen(copy):
    original = model_fingerprint(copy)
    data = bytearray((copy / SHARD).read_bytes())
    (header_length,) = struct.unpack("<Q", data[:8])
    table = json.loads(data[8 : 8 + header_length])
    begin, end = max((v["data_offsets"] for k, v in table.items() if k != "__metadata__"), key=lambda o: o[1] - o[0])
    assert end - begin > 3 * fingerprint.SPAN_BYTES
    data[8 + header_length + begin + 1000] ^= 0x01  # past the first 64 bytes the old hash read
    (copy / SHARD).write_bytes(bytes(data))
    assert model_fingerprint(copy) != original


def _one_tensor_shard(path, n_bytes: int) -> int:
    """A safetensors file holding one uint8 tensor of ``n_bytes``; returns where its data starts."""
    header = json.dumps({"t": {"dtype": "U8", "shape": [n_bytes], "data_offsets": [0, n_bytes]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(n_bytes))
    return 8 + len(header)


def _flipped(path, at: int) -> bytes:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x80]))
    digest = shard_digest(path)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([byte]))
    return digest


def test_the_grid_covers_a_large_tensor_between_its_samples_and_the_limit_is_what_is_documented(tmp_path):
    shard = tmp_path / SHARD
    stride, span = fingerprint.GRID_STRIDE, fingerprint.SPAN_BYTES
    data = _one_tensor_shard(shard, 3 * stride)
    clean = shard_digest(shard)
    for seen in (0, span - 1, stride + 7, 2 * stride + span - 1, 3 * stride // 2, 3 * stride - 1):
        assert _flipped(shard, data + seen) != clean, seen
    # The stated limit: a byte of a large tensor outside its three spans and the grid is not read.
    for unseen in (span, stride // 2, stride + span, 3 * stride - span - 1):
        assert _flipped(shard, data + unseen) == clean, unseen


def test_reads_stay_bounded_for_a_large_tensor(tmp_path, monkeypatch):
    shard = tmp_path / SHARD
    data = _one_tensor_shard(shard, 16 * fingerprint.GRID_STRIDE)
    reads: list[int] = []
    real_pread = os.pread
    monkeypatch.setattr(fingerprint.os, "pread", lambda fd, n, at: reads.append(n) or real_pread(fd, n, at))
    shard_digest(shard)
    assert sum(reads) <= data + (16 + 3) * fingerprint.SPAN_BYTES  # a grid page per stride, three per tensor


def test_a_shard_changed_just_now_is_hashed_but_not_cached(twins, tmp_path, monkeypatch):
    """A timestamp of coarse granularity cannot tell a second edit in the same tick: not cached yet."""
    path = tmp_path / "fresh"
    shutil.copytree(twins[0], path)
    first = model_fingerprint(path)
    reads: list[int] = []
    real_pread = os.pread
    monkeypatch.setattr(fingerprint.os, "pread", lambda fd, n, at: reads.append(n) or real_pread(fd, n, at))
    assert model_fingerprint(path) == first and reads  # hashed again: nothing was cached
    monkeypatch.setattr(fingerprint, "RACY_NS", 0)
    model_fingerprint(path)
    reads.clear()
    assert model_fingerprint(path) == first and reads == []  # settled: cached
