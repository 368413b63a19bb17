"""Saved state knows what made it: another model's or another dtype's session never resumes silently,
a damaged header is a one-line error with a way out, and no log size can exhaust memory."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest

from colibri_stream import cli
from colibri_stream.checkpoint import fingerprint
from colibri_stream.checkpoint.fingerprint import container_weights_sha256, model_fingerprint
from colibri_stream.devtools import fixtures
from colibri_stream.errors import SessionError
from colibri_stream.runtime.kv.sessions import Session, check_session_name
from engine.config.args import ModelArgs
from storage.container.reader import Container
from storage.container.write import CONTENT_KEY, content_sha256
from storage.errors import FormatError
from storage.kv import log as kvlog
from storage.kv.log import HEADER_BYTES

IDS_A = list(range(1, 11))
IDS_B = list(range(1, 12))  # A's prompt plus one token: a full prefix match if the log were reused


@pytest.fixture(scope="module")
def twins(tiny_checkpoints, tmp_path_factory):
    """Two deepseek_v3 checkpoints with every shape (and shard size) equal and different weights."""
    a = tiny_checkpoints["deepseek_v3"]
    b = fixtures.build_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("twin") / "b", seed=12345)
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    return a, b


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Default session directories and the weights-hash cache under the test's own directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def run(capsys, path, ids, *extra) -> tuple[int, dict | None, str]:
    """(exit status, the --json object or None, stderr) of one in-process `run`."""
    capsys.readouterr()
    argv = ["run", str(path), "--ids", ",".join(map(str, ids)), "--max-new-tokens", "6", "--json", *extra]
    status = cli.main(argv)
    out, err = capsys.readouterr()
    return status, json.loads(out.strip().splitlines()[-1]) if status == 0 else None, err


# ------------------------------------------------------------------------------------- D1: identity


def test_same_shaped_models_have_different_fingerprints_and_sessions(twins, capsys):
    a, b = twins
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_fingerprint(a) == model_fingerprint(a)  # and stable (the second from the cache)
    assert run(capsys, a, IDS_A, "--session", "fp")[0] == 0
    status, turn, _ = run(capsys, b, IDS_B, "--session", "fp")  # default directories: B's own
    assert status == 0
    fresh = run(capsys, b, IDS_B)[1]
    assert turn["stats"]["reused_tokens"] == 0
    assert turn["ids"] == fresh["ids"]


def test_another_models_session_in_a_shared_directory_is_refused_naming_it(twins, tmp_path, capsys):
    a, b = twins
    assert run(capsys, a, IDS_A, "--session", "fp", "--kv-dir", str(tmp_path))[0] == 0
    before = (tmp_path / "fp.kvlog").read_bytes()
    status, _, err = run(capsys, b, IDS_B, "--session", "fp", "--kv-dir", str(tmp_path))
    assert status == 1
    assert "was made by another model" in err and "--reset" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "fp.kvlog").read_bytes() == before


def test_hf_fingerprint_reads_samples_only_and_sees_a_changed_tensor(twins, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(twins[0], copy)
    shard = copy / "model.safetensors"
    reads: list[int] = []
    real_pread = os.pread
    monkeypatch.setattr(fingerprint.os, "pread", lambda fd, n, at: reads.append(n) or real_pread(fd, n, at))
    monkeypatch.setattr(fingerprint, "RACY_NS", 0)  # the copy is new: cache it all the same
    original = model_fingerprint(copy)
    (header_length,) = struct.unpack("<Q", shard.read_bytes()[:8])
    n_tensors = len(json.loads(shard.read_bytes()[8 : 8 + header_length])) - 1  # minus __metadata__
    assert sum(reads) <= 8 + header_length + 3 * fingerprint.SPAN_BYTES * n_tensors + fingerprint.SPAN_BYTES
    assert sum(reads) < shard.stat().st_size

    reads.clear()
    assert model_fingerprint(copy) == original and reads == []  # cached: no shard bytes read again

    data = bytearray(shard.read_bytes())
    data[8 + header_length] ^= 0x01  # the first data byte: one bit of the first tensor
    shard.write_bytes(bytes(data))  # same size; the mtime moves, so the cache entry no longer applies
    assert model_fingerprint(copy) != original


@pytest.mark.parametrize("planted", ["tokenizer.json", "model.safetensors"])
def test_fingerprint_refuses_a_fifo_instead_of_blocking_on_it(twins, tmp_path, planted):
    """`kv ls MODEL` fingerprints before anything loads: a FIFO there must not block the open."""
    copy = tmp_path / "copy"
    shutil.copytree(twins[0], copy)
    (copy / planted).unlink()
    os.mkfifo(copy / planted)
    with pytest.raises(FormatError, match=f"{planted}.*FIFO"):
        model_fingerprint(copy)


def test_fingerprint_of_a_deeply_nested_header_is_a_hash_not_a_recursion_error(twins, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(twins[0], copy)
    deep = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (copy / "model.safetensors").write_bytes(struct.pack("<Q", len(deep)) + deep)
    assert model_fingerprint(copy) != model_fingerprint(twins[0])  # the loader is what refuses it


def test_container_content_hash_is_published_and_old_containers_compute_the_same(make_container):
    container = Container(make_container("deepseek_v3"))
    published = container.attrs[CONTENT_KEY]
    assert published == content_sha256(container.attrs)
    older = {k: v for k, v in container.attrs.items() if k != CONTENT_KEY}  # converted before the hash
    container.attrs = older
    assert container_weights_sha256(container) == published
    layer = next(iter(older["experts"]["checksums"]))
    changed = json.loads(json.dumps(older))
    changed["experts"]["checksums"][layer][0] ^= 1  # one expert record's bytes differ
    assert content_sha256(changed) != published


# --------------------------------------------------------------------------------- D5: compute dtype


def test_a_session_continued_in_another_compute_dtype_is_refused(twins, tmp_path, capsys):
    a = twins[0]
    session = ("--session", "d", "--kv-dir", str(tmp_path))
    assert run(capsys, a, IDS_A, *session, "--dtype", "bfloat16")[0] == 0
    status, _, err = run(capsys, a, IDS_B, *session, "--dtype", "float32")
    assert status == 1
    assert "made with compute dtype (--dtype) bfloat16; this run uses float32" in err
    status, turn, _ = run(capsys, a, IDS_B, *session, "--dtype", "float32", "--reset")
    assert status == 0 and turn["stats"]["reused_tokens"] == 0
    assert turn["ids"] == run(capsys, a, IDS_B, "--dtype", "float32")[1]["ids"]


# ---------------------------------------------------------------------------------- D14: bad header


def _damage_header(path) -> None:
    data = bytearray(path.read_bytes())
    data[20] ^= 0x04  # inside the header JSON: its checksum fails
    path.write_bytes(bytes(data))


def test_a_corrupt_header_is_one_line_with_the_way_out_and_both_ways_work(twins, tmp_path, capsys):
    a = twins[0]
    kv = ("--kv-dir", str(tmp_path))
    for name in ("good", "bad"):
        assert run(capsys, a, IDS_A, "--session", name, *kv)[0] == 0
    _damage_header(tmp_path / "bad.kvlog")

    status, _, err = run(capsys, a, IDS_B, "--session", "bad", *kv)
    assert status == 1 and len(err.strip().splitlines()) == 1
    assert "corrupt or unreadable KV log header" in err and "--reset" in err and "kv rm" in err

    assert cli.main(["kv", "ls", str(a), *kv]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].startswith("bad\tcorrupt header") and listing[1].startswith("good\t15 tokens")
    assert cli.main(["kv", "ls", str(a), *kv, "--json"]) == 0
    assert [i["header"] for i in json.loads(capsys.readouterr().out)][1] == "ok"

    status, turn, _ = run(capsys, a, IDS_B, "--session", "bad", *kv, "--reset")
    assert status == 0 and turn["stats"]["reused_tokens"] == 0
    _damage_header(tmp_path / "bad.kvlog")
    assert cli.main(["kv", "rm", str(a), "bad", *kv]) == 0
    assert not (tmp_path / "bad.kvlog").exists() and (tmp_path / "good.kvlog").exists()


def test_a_log_of_the_previous_format_names_the_reset(twins, tmp_path, monkeypatch):
    args = ModelArgs.from_hf_config(json.loads((twins[0] / "config.json").read_text()))
    with monkeypatch.context() as patch:
        patch.setattr(kvlog.KVGeometry, "FORMAT_VERSION", 1)  # what an MLA log's header says
        Session(tmp_path, "old", "fp", args).close()
    with pytest.raises(SessionError, match=r"format version 1 is not supported.*--reset"):
        Session(tmp_path, "old", "fp", args)
    Session(tmp_path, "old", "fp", args, reset=True).close()
    Session(tmp_path, "old", "fp", args).close()  # readable again after the reset


# ------------------------------------------------------------------------------------- D15: names


@pytest.mark.parametrize("name", ["chat\n", "chat\r\n", "a\nb", "\nchat", ".hidden", "a/b", "..", "x" * 129])
def test_hostile_session_names_are_refused(name):
    with pytest.raises(SessionError, match="session name"):
        check_session_name(name)


# ------------------------------------------------------------------------------- D6: bounded memory

_OPEN_HUGE_LOG = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from colibri_stream.runtime.memory import peak_rss_bytes
    from storage.kv.log import KVGeometry, KVLog
    geometry = KVGeometry(2, 4, 2, (0,), 3, "float32")
    path = sys.argv[1]
    with KVLog(path, "fp", geometry) as log:
        log.append(np.arange(5, dtype=np.uint32), np.full((5, geometry.payload_bytes), 7, dtype=np.uint8))
    with open(path, "ab") as f:
        f.write(os.urandom(1 << 20))  # garbage, then a hole: 100 GiB that read as zeros
    os.truncate(path, 100 << 30)
    before = peak_rss_bytes()
    with KVLog(path, "fp", geometry) as log:
        tokens, _ = log.read()
        prefix = log.common_prefix(list(range(5)) + [9] * 1000)
    print(json.dumps({"growth": peak_rss_bytes() - before, "tokens": tokens.tolist(), "prefix": prefix,
                      "size": os.path.getsize(path)}))
    """
)


def test_a_100_gib_log_opens_in_bounded_memory(tmp_path):
    path = tmp_path / "huge.kvlog"
    done = subprocess.run([sys.executable, "-c", _OPEN_HUGE_LOG, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["tokens"] == [0, 1, 2, 3, 4] and result["prefix"] == 5
    assert result["size"] == HEADER_BYTES + 5 * (4 + 2 * (4 + 2) * 4 + 3 * 4 + 4)  # the bad tail was cut
    assert result["growth"] < 64 << 20  # was: a MemoryError (1 GiB appended: +1.38 GB)
