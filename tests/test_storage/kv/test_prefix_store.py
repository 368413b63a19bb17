"""The prefix cache's block store: both tiers by bytes, least recently used first across a restart, the
directory kept to itself (links never followed), damaged or foreign files never returned."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from storage.errors import FormatError
from storage.kv.log import KVGeometry
from storage.kv.prefix_blocks import Block, Namespace, read_block
from storage.kv.prefix_store import PrefixStore

# odd widths: 3 layers x (kv_lora 7 + rope 5) + one index layer of 3
# with O_DIRECT, fadvise, cgroups and /proc forced off too (tests/test_storage/conftest.py)
pytestmark = pytest.mark.usefixtures("io_features")


GEOMETRY = KVGeometry(
    n_layers=3, kv_lora_rank=7, qk_rope_head_dim=5, index_layers=(1,), index_head_dim=3, dtype="float32"
)
NAMESPACE = Namespace.of("model-a", GEOMETRY, {"compute_dtype": "float32"})


def _block(first: int, n: int = 5, seed: int = 0) -> Block:
    rng = np.random.default_rng(seed)
    payloads = rng.integers(0, 256, (n, GEOMETRY.payload_bytes), dtype=np.uint8)
    return Block(first, np.arange(first, first + n, dtype=np.uint32), payloads)


def _key(i: int) -> str:
    return f"{i:064x}"


def _same(a: Block, b: Block) -> bool:
    return a.first == b.first and np.array_equal(a.tokens, b.tokens) and np.array_equal(a.payloads, b.payloads)


def test_a_block_reads_back_from_disk_after_a_restart_and_is_refused_under_another_namespace(tmp_path):
    store = PrefixStore(NAMESPACE, tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 20)
    block = _block(5, seed=1)
    store.put(_key(1), block)
    again = PrefixStore(NAMESPACE, tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 20)
    got = again.get(_key(1))
    assert got is not None and got[1] == "disk" and _same(got[0], block)
    assert again.get(_key(1))[1] == "ram"  # type: ignore[index]
    for other in (
        Namespace.of("model-b", GEOMETRY, {"compute_dtype": "float32"}),
        Namespace.of("model-a", GEOMETRY, {"compute_dtype": "bfloat16"}),
        Namespace.of("model-a", KVGeometry(3, 7, 5, (1,), 3, "bfloat16"), {"compute_dtype": "float32"}),
    ):
        PrefixStore(NAMESPACE, tmp_path, 0, 1 << 20).put(_key(1), block)  # (again: the refusal removes it)
        assert (tmp_path / f"{_key(1)}.kvblock").exists()
        assert PrefixStore(other, tmp_path, 1 << 20, 1 << 20).get(_key(1)) is None
        assert not (tmp_path / f"{_key(1)}.kvblock").exists()  # not a block of this store: recomputed
    # a whole valid block under another key's name is not that key's block either
    PrefixStore(NAMESPACE, tmp_path, 0, 1 << 20).put(_key(1), block)
    os.rename(tmp_path / f"{_key(1)}.kvblock", tmp_path / f"{_key(2)}.kvblock")
    assert PrefixStore(NAMESPACE, tmp_path, 1 << 20, 1 << 20).get(_key(2)) is None


@pytest.mark.parametrize("cut", [1, 100, 4096, 4100])
def test_a_truncated_block_is_never_returned(tmp_path, cut):
    store = PrefixStore(NAMESPACE, tmp_path, ram_bytes=0, disk_bytes=1 << 20)
    store.put(_key(3), _block(0))
    path = tmp_path / f"{_key(3)}.kvblock"
    path.write_bytes(path.read_bytes()[:-cut])
    assert PrefixStore(NAMESPACE, tmp_path, 0, 1 << 20).get(_key(3)) is None


def test_disk_eviction_after_a_restart_drops_the_least_recently_used_first(tmp_path):
    size = len(_block(0).payloads) * GEOMETRY.record_bytes + 4096
    store = PrefixStore(NAMESPACE, tmp_path, ram_bytes=0, disk_bytes=3 * size)
    for i in range(3):
        store.put(_key(i), _block(0, seed=i))
        time.sleep(0.01)  # distinct mtimes
    assert PrefixStore(NAMESPACE, tmp_path, 0, 3 * size).get(_key(0)) is not None  # used: now the newest
    restarted = PrefixStore(NAMESPACE, tmp_path, 0, 3 * size)
    restarted.put(_key(9), _block(0, seed=9))  # one over: the least recently used (key 1) goes
    assert sorted(p.stem for p in tmp_path.glob("*.kvblock")) == sorted([_key(0), _key(2), _key(9)])
    assert restarted.usage().disk_bytes <= 3 * size


def test_links_are_never_followed_out_of_the_directory(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    cache = tmp_path / "prefix"
    cache.mkdir()
    (cache / f"{_key(4)}.kvblock").symlink_to(outside)
    store = PrefixStore(NAMESPACE, cache, 1 << 20, 1 << 20)
    assert store.get(_key(4)) is None
    store.put(_key(4), _block(0))  # replaces the link itself
    assert outside.read_bytes() == b"precious"
    assert _same(read_block(cache / f"{_key(4)}.kvblock", NAMESPACE, _key(4)), _block(0))
    linked = tmp_path / "linked"
    linked.symlink_to(cache)
    with pytest.raises(FormatError, match="link is never followed"):
        PrefixStore(NAMESPACE, linked, 1 << 20, 1 << 20)


def test_ram_holds_its_budget_and_a_key_that_is_not_hex_is_refused(tmp_path):
    one = _block(0).nbytes
    store = PrefixStore(NAMESPACE, None, ram_bytes=2 * one, disk_bytes=0)
    for i in range(4):
        store.put(_key(i), _block(0, seed=i))
    assert store.usage().ram_blocks == 2 and store.usage().ram_bytes <= 2 * one
    assert store.get(_key(0)) is None and store.get(_key(3)) is not None
    with pytest.raises(ValueError, match="hex"):
        store.get("../../etc/passwd")
