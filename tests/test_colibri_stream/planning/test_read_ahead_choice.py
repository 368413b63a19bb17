"""Whether a loaded model reads ahead (colibri_stream/planning/read_ahead.py): only where the last-level cache holds
a read-ahead request several times over; the engine then never asks the helper thread to read."""

from __future__ import annotations

import pytest

import engine.mla.model
from colibri_stream.planning import read_ahead
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.planning.read_ahead import CACHE_SHARE, choose_read_ahead, last_level_cache_bytes
from colibri_stream.runtime import loader


def _cache_dir(root, *entries):
    for i, (level, size) in enumerate(entries):
        index = root / f"index{i}"
        index.mkdir(parents=True)
        (index / "level").write_text(f"{level}\n")
        (index / "size").write_text(f"{size}\n")
    return root


def test_the_last_level_cache_is_the_highest_level_sysfs_lists(tmp_path):
    caches = _cache_dir(tmp_path, (1, "32K"), (1, "32K"), (3, "32768K"), (2, "1024K"))
    assert last_level_cache_bytes(caches) == 32 * 2**20
    assert last_level_cache_bytes(_cache_dir(tmp_path / "m", (2, "2M"))) == 2 * 2**20


def test_an_unreadable_cache_listing_means_unknown(tmp_path):
    assert last_level_cache_bytes(tmp_path / "missing") is None
    broken = _cache_dir(tmp_path / "b", (3, "lots"))
    assert last_level_cache_bytes(broken) is None


def test_a_request_counts_the_largest_layer_and_its_guessed_experts(stream_container):
    loaded = loader.load(stream_container, store=StoreOptions(ram="100%"))
    try:
        model = loaded.model
        dense = [sum(t.nbytes for t in model._weights_of(i)) for i in range(len(model.layers) + 1)]
        moe = [isinstance(layer.ffn, engine.mla.model.MoE) for layer in model.layers] + [False]
        expected = max(d + (4 * 1000 if m else 0) for d, m in zip(dense, moe, strict=True))
        assert model.read_ahead_bytes(4, 1000) == expected
        assert model.read_ahead_bytes(4, 10**6) > max(dense)  # the experts count on a MoE layer
    finally:
        loaded.experts.close()


@pytest.mark.parametrize(("cache", "reads_ahead"), [(None, False), ("just_short", False), ("enough", True)], ids=str)
def test_a_model_reads_ahead_only_where_the_cache_holds_it(stream_container, cache, reads_ahead):
    loaded = loader.load(stream_container, store=StoreOptions(ram="100%"))
    try:
        request = loaded.model.read_ahead_bytes(6, 5000)
        size = {None: None, "just_short": CACHE_SHARE * request - 1, "enough": CACHE_SHARE * request}[cache]
        assert choose_read_ahead(loaded.model, 6, 5000, size) is reads_ahead
        assert loaded.model.read_ahead is reads_ahead
    finally:
        loaded.experts.close()


def test_a_model_loaded_on_a_small_cache_never_asks_for_read_ahead(stream_container, monkeypatch):
    from colibri_stream.runtime.generate import generate

    monkeypatch.setattr(read_ahead, "last_level_cache_bytes", lambda: 1024)  # far below any request
    monkeypatch.setattr(loader, "last_level_cache_bytes", lambda: 1024)
    monkeypatch.setattr(engine.mla.model, "read_ahead_available", lambda: True)  # as with 2 kernel threads
    requests = []
    monkeypatch.setattr(engine.mla.model, "request_read_ahead", lambda arrays: requests.append(arrays))
    loaded = loader.load(stream_container, store=StoreOptions(ram="100%"))
    try:
        assert loaded.model.read_ahead is False
        generate(loaded.model, [5, 9, 2], 4, loaded.experts)
        assert requests == []
        loaded.model.read_ahead = True  # the same model told otherwise asks once per layer and step
        generate(loaded.model, [5, 9, 2], 4, loaded.experts)
        assert len(requests) >= 3 * len(loaded.model.layers)
    finally:
        loaded.experts.close()
