"""The tiered store: placement changes speed, never tokens; only routed bytes move."""

from __future__ import annotations

import itertools

import pytest

from colibri_stream.generate import generate
from colibri_stream.loader import load_container
from storage.container import Container
from storage.errors import BudgetError
from storage.history import UsageHistory
from storage.tiered import StoreConfig

PROMPT = [5, 9, 17, 33, 65, 129, 257, 300, 11, 23]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def reference_ids(stream_container) -> list[int]:
    resident = load_container(stream_container)
    return generate(resident.model, PROMPT, NEW_TOKENS, resident.experts).ids


@pytest.fixture(scope="module")
def history_file(stream_container, tmp_path_factory):
    """A usage history recorded by one streamed run, for the learned hot store."""
    path = tmp_path_factory.mktemp("history") / "usage.json"
    config = StoreConfig(ram_bytes=Container(stream_container).expert_bytes, history_path=path)
    loaded = load_container(stream_container, store=config)
    generate(loaded.model, PROMPT[::-1], NEW_TOKENS, loaded.experts)
    loaded.experts.end_turn()
    loaded.experts.close()
    return path


def _budget(container: Container, name: str) -> int:
    if name == "min":
        return container.n_experts * container.layout.record_bytes
    return int(container.expert_bytes * int(name.rstrip("%")) / 100)


GRID = list(
    itertools.product(["min", "20%", "50%", "100%"], ["lru", "hybrid", "pinned"], [True, False], [False, True], [0, 40])
)


@pytest.mark.parametrize("budget, policy, prefetch, direct, vram_slots", GRID)
def test_any_placement_generates_the_resident_tokens(
    stream_container, reference_ids, history_file, budget, policy, prefetch, direct, vram_slots
):
    container = Container(stream_container)
    config = StoreConfig(
        ram_bytes=_budget(container, budget),
        vram_bytes=vram_slots * container.layout.record_bytes,
        vram_device="cpu",  # the stand-in device: same tier logic as CUDA
        policy=policy,
        prefetch=prefetch,
        direct=direct,
        history_path=history_file if policy == "pinned" else None,
    )
    loaded = load_container(stream_container, store=config)
    try:
        assert generate(loaded.model, PROMPT, NEW_TOKENS, loaded.experts).ids == reference_ids
        stats = loaded.experts.report()
    finally:
        loaded.experts.close()
    assert stats["hits"]["ram"] + stats["hits"]["vram"] + stats["misses"] == stats["expert_requests"]
    if budget != "100%":
        assert stats["reads"] > len(container.moe_layers) * 4  # small budgets really evict and re-read
    if vram_slots:
        assert stats["hits"]["vram"] > 0
    if policy == "pinned" and budget != "min":  # at the minimum every slot is needed for one layer
        assert loaded.experts.ram.hot


def _fresh(stream_container, **overrides):
    container = Container(stream_container)
    config = StoreConfig(ram_bytes=container.expert_bytes, **overrides)
    return container, load_container(stream_container, store=config)


def test_cold_decode_reads_exactly_the_missed_records(stream_container):
    container, loaded = _fresh(stream_container, prefetch=False)
    store = loaded.experts
    cache = loaded.model.new_cache()
    generate(loaded.model, PROMPT, 1, store, cache=cache)  # prefill
    before = store.report()
    generate(loaded.model, PROMPT + [7], 1, store, cache=cache)  # one decode step
    after = store.report()
    store.close()
    misses = after["misses"] - before["misses"]
    assert misses > 0
    assert after["expert_bytes_read"] - before["expert_bytes_read"] == misses * container.layout.record_bytes
    assert after["reads"] - before["reads"] == misses


def test_cold_prefill_reads_each_expert_at_most_once(stream_container):
    container, loaded = _fresh(stream_container, prefetch=False)
    long_prompt = [(i * 37) % 500 + 2 for i in range(64)]
    generate(loaded.model, long_prompt, 1, loaded.experts)
    stats = loaded.experts.report()
    loaded.experts.close()
    history = loaded.experts.history.counts  # what was acquired, per layer
    keys = {(layer, e) for layer, row in history.items() for e, count in enumerate(row) if count}
    assert stats["reads"] == len(keys)  # one read per distinct (layer, expert)
    assert stats["expert_bytes_read"] <= container.expert_bytes


def test_lookahead_prefetch_is_counted_and_recalls_some_experts(stream_container):
    _, loaded = _fresh(stream_container, prefetch=True)
    generate(loaded.model, PROMPT, NEW_TOKENS, loaded.experts)
    stats = loaded.experts.report()
    loaded.experts.close()
    assert stats["prefetch"]["issued"] > 0
    assert stats["prefetch"]["useful"] <= stats["prefetch"]["issued"]
    assert 0 < stats["prefetch_recall"] <= 1


def test_budget_below_one_layer_fails_with_the_numbers(stream_container):
    container = Container(stream_container)
    with pytest.raises(BudgetError, match=r"minimum is one layer's routed experts: 16 records"):
        load_container(stream_container, store=StoreConfig(ram_bytes=container.layout.record_bytes * 15))


def test_history_is_persisted_and_refuses_another_model(history_file, stream_container):
    from colibri_stream.fingerprint import container_fingerprint
    from storage.errors import IncompatibleStateError

    container = Container(stream_container)
    history = UsageHistory.load(history_file, container.n_experts, container_fingerprint(container))
    assert sum(sum(row) for row in history.counts.values()) > 0
    assert len(history.hottest(5)) == 5
    with pytest.raises(IncompatibleStateError, match="another model"):
        UsageHistory.load(history_file, container.n_experts, "someone-else")


def test_a_corrupted_record_read_while_streaming_is_a_typed_error(stream_container, tmp_path):
    import shutil

    from storage.errors import CorruptDataError

    broken = tmp_path / "broken"
    shutil.copytree(stream_container, broken)
    for chunk in (broken / "experts" / "layer_001" / "c").glob("*/0"):
        data = bytearray(chunk.read_bytes())
        data[10] ^= 0x01
        chunk.write_bytes(bytes(data))
    _, loaded = _fresh(broken)
    with pytest.raises(CorruptDataError, match=r"layer 1 expert \d+: checksum mismatch"):
        generate(loaded.model, PROMPT, 2, loaded.experts)
    loaded.experts.close()


def test_o_direct_is_the_default_and_falls_back_where_the_filesystem_refuses(
    stream_container, reference_ids, monkeypatch
):
    import storage.tiered

    container = Container(stream_container)
    config = StoreConfig(ram_bytes=_budget(container, "min"))
    assert config.direct
    loaded = load_container(stream_container, store=config)
    assert loaded.experts.report()["direct_io"]  # this filesystem takes O_DIRECT (the 96-way grid reads with it)
    loaded.experts.close()

    monkeypatch.setattr(storage.tiered, "o_direct_refusal", lambda path: "O_DIRECT unsupported (test)")
    loaded = load_container(stream_container, store=config)
    assert generate(loaded.model, PROMPT, NEW_TOKENS, loaded.experts).ids == reference_ids
    assert loaded.experts.report()["direct_io"] is False
    loaded.experts.close()
