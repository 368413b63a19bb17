"""The tiered store: placement changes speed, never tokens; only routed bytes move."""

from __future__ import annotations

import itertools
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from colibri_stream.devtools.fixtures import FAMILIES, make_prompt
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_container
from storage.container.reader import Container
from storage.errors import BudgetError, CorruptDataError
from storage.files.page_cache import file_bypass
from storage.tiers.config import StoreConfig
from storage.tiers.history import UsageHistory
from storage.tiers.policy import POLICY_NAMES
from storage.tiers.tiered import minimum_slots

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
    if name == "min":  # the floor: one token's routed experts (prefill acquires a layer's in chunks)
        return container.experts_per_token * container.layout.record_bytes
    return int(container.expert_bytes * int(name.rstrip("%")) / 100)


# 16 VRAM slots hold fewer than a token's 28 experts (7 MoE layers x top-4): every expert is staged
# through the tier, and only a policy that resists that cycle keeps some for a hit (LRU kept none)
GRID = list(itertools.product(["min", "20%", "50%", "100%"], POLICY_NAMES, [True, False], [False, True], [0, 16]))
# ... and a slice of it with O_DIRECT, fadvise, cgroups and /proc forced off (tests/test_storage/conftest.py)
FALLBACK_GRID = [(*g, "forced-off") for g in GRID if g[0] in ("min", "50%") and g[2] and g[3] and g[4] == 0]


@pytest.mark.parametrize(
    "budget, policy, prefetch, direct, vram_slots, io_features",
    [(*g, "platform") for g in GRID] + FALLBACK_GRID,
    indirect=["io_features"],
)
def test_any_placement_generates_the_resident_tokens(
    stream_container, reference_ids, history_file, budget, policy, prefetch, direct, vram_slots, io_features
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
        preload=False,  # 100% streams too: preload has its own tests
    )
    loaded = load_container(stream_container, store=config)
    acquires = _count_acquires(loaded.experts)
    try:
        assert generate(loaded.model, PROMPT, NEW_TOKENS, loaded.experts).ids == reference_ids
        stats = loaded.experts.report()
    finally:
        loaded.experts.close()
    assert stats["hits"]["ram"] + stats["hits"]["vram"] + stats["misses"] == stats["expert_requests"]
    first = container.expert_path(container.moe_layers[0], 0)
    assert stats["page_cache_bypass"] == (file_bypass(first) if direct and not io_features.fallback else "none")
    if budget != "100%":
        assert stats["reads"] > len(container.moe_layers) * 4  # small budgets really evict and re-read
    if vram_slots:
        assert stats["hits"]["vram"] > 0
    if budget == "min":  # the prompt's union of a layer is over the floor: it was acquired in chunks
        assert max(len(chunk) for _, chunk in acquires) == container.experts_per_token
        assert len(acquires) > (NEW_TOKENS + 1) * len(container.moe_layers)
    if policy == "pinned" and budget != "min":  # below one layer's experts nothing is pinned
        assert loaded.experts.ram.hot


def _count_acquires(store) -> list[tuple[int, tuple[int, ...]]]:
    """Record every (layer, expert ids) the store is asked to acquire (an instance-level wrapper)."""
    acquires: list[tuple[int, tuple[int, ...]]] = []
    acquire = store.acquire

    def counting(layer, expert_ids):
        acquires.append((layer, tuple(expert_ids)))
        return acquire(layer, expert_ids)

    store.acquire = counting
    return acquires


def _prompt_acquires_per_layer(acquires, moe_layers) -> dict[int, int]:
    """Acquires per layer of the first forward (the prompt's), which ends where the layers wrap around."""
    end = next((i for i in range(1, len(acquires)) if acquires[i][0] < acquires[i - 1][0]), len(acquires))
    return {layer: sum(1 for lay, _ in acquires[:end] if lay == layer) for layer in moe_layers}


# (policy, VRAM slots on the stand-in device)
FAMILY_STORES = [("frequent", 0), ("lru", 0), ("hybrid", 0), ("frequent", 3)]


@pytest.mark.parametrize(
    "policy, vram_slots, io_features",
    [(*s, "platform") for s in FAMILY_STORES] + [("frequent", 0, "forced-off")],
    indirect=["io_features"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_at_the_floor_generates_the_resident_tokens(
    make_container, family, policy, vram_slots, io_features
):
    """Top-k RAM slots and nothing else: the prompt's union of each layer comes in several chunks, decode
    one token's experts at a time, and the greedy tokens are the resident run's."""
    path = make_container(family)
    container = Container(path)
    prompt = make_prompt(container.model_config["vocab_size"], 12, seed=5)
    resident = load_container(path)
    expected = generate(resident.model, prompt, NEW_TOKENS, resident.experts).ids
    record = container.layout.record_bytes
    config = StoreConfig(
        ram_bytes=minimum_slots(container) * record,
        vram_bytes=vram_slots * record,
        vram_device="cpu",
        policy=policy,
    )
    loaded = load_container(path, store=config)
    acquires = _count_acquires(loaded.experts)
    try:
        assert loaded.experts.max_acquire() == container.experts_per_token == 4
        assert generate(loaded.model, prompt, NEW_TOKENS, loaded.experts).ids == expected
    finally:
        loaded.experts.close()
    per_layer = _prompt_acquires_per_layer(acquires, container.moe_layers)
    assert all(count > 1 for count in per_layer.values()), per_layer
    assert all(len(chunk) <= 4 for _, chunk in acquires)


@pytest.mark.usefixtures("io_features")
def test_a_chunk_reads_no_more_than_its_own_union(stream_container):
    """At the floor, with prefetch off: between a chunk's acquire and its release the store reads the
    chunk's missing records and nothing else, and never pins more than max_acquire RAM slots."""
    container = Container(stream_container)
    record = container.layout.record_bytes
    config = StoreConfig(ram_bytes=_budget(container, "min"), prefetch=False)
    loaded = load_container(stream_container, store=config)
    store = loaded.experts
    acquire, release = store.acquire, store.release
    chunks: list[tuple[int, int]] = []  # (chunk size, bytes read while it was held)
    held: list = []

    def acquiring(layer, expert_ids):
        held.append(store.snapshot())
        return acquire(layer, expert_ids)

    def releasing(layer, expert_ids):
        assert sum(1 for e in store.ram.entries.values() if e.pins) <= store.max_acquire()
        release(layer, expert_ids)
        read = store.snapshot().minus(held.pop())
        assert read.expert_bytes_read == read.misses * record
        chunks.append((len(expert_ids), read.expert_bytes_read))

    store.acquire, store.release = acquiring, releasing
    long_prompt = [(i * 37) % 500 + 2 for i in range(32)]
    try:
        generate(loaded.model, long_prompt, 3, store)
    finally:
        store.close()
    assert any(size == container.experts_per_token for size, _ in chunks)
    assert len(chunks) > 3 * len(container.moe_layers)
    assert all(read <= size * record for size, read in chunks)
    assert sum(read for _, read in chunks) == store.stats.expert_bytes_read


def _fresh(stream_container, **overrides):
    """A store whose RAM holds every expert, read as the model asks (no preload): its reads are counted."""
    container = Container(stream_container)
    config = StoreConfig(ram_bytes=container.expert_bytes, **{"preload": False, **overrides})
    return container, load_container(stream_container, store=config)


@pytest.mark.usefixtures("io_features")
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


@pytest.mark.usefixtures("io_features")
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


@pytest.mark.usefixtures("io_features")
def test_prefetch_is_counted_and_recalls_some_experts(stream_container):
    _, loaded = _fresh(stream_container, prefetch=True)
    generate(loaded.model, PROMPT, NEW_TOKENS, loaded.experts)
    stats = loaded.experts.report()
    loaded.experts.close()
    assert stats["prefetch"]["issued"] > 0
    assert stats["prefetch"]["useful"] <= stats["prefetch"]["issued"]
    assert 0 < stats["prefetch_recall"] <= 1


def test_budget_below_one_tokens_experts_fails_with_the_numbers(stream_container):
    container = Container(stream_container)
    record = container.layout.record_bytes
    with pytest.raises(
        BudgetError, match=rf"holds 3 expert records of {record} B; the minimum is 4 \(one token's routed experts\)"
    ):
        load_container(stream_container, store=StoreConfig(ram_bytes=record * 4 - 1))
    loaded = load_container(stream_container, store=StoreConfig(ram_bytes=record * 4))  # the floor itself runs
    assert loaded.experts.ram.n_slots == loaded.experts.max_acquire() == 4
    loaded.experts.close()


def test_pinned_leaves_a_layer_unpinned_and_chunks_fit_beside_the_hot_store(stream_container, history_file):
    container = Container(stream_container)
    record = container.layout.record_bytes
    for slots, hot in ((4, 0), (15, 0), (16, 0), (40, 24)):
        config = StoreConfig(ram_bytes=slots * record, policy="pinned", history_path=history_file)
        store = load_container(stream_container, store=config).experts
        assert len(store.ram.hot) == hot and store.max_acquire() == slots - hot >= minimum_slots(container)
        store.close()


def test_history_is_persisted_and_refuses_another_model(history_file, stream_container):
    from colibri_stream.checkpoint.fingerprint import container_fingerprint
    from storage.errors import IncompatibleStateError

    container = Container(stream_container)
    history = UsageHistory.load(history_file, container.n_experts, container_fingerprint(container))
    assert sum(sum(row) for row in history.counts.values()) > 0
    assert len(history.hottest(5)) == 5
    with pytest.raises(IncompatibleStateError, match="another model"):
        UsageHistory.load(history_file, container.n_experts, "someone-else")


def _with_a_flipped_bit(container: Path, destination: Path, layer: int, offset: int) -> Path:
    """A copy of ``container`` with one bit flipped in the first chunk of every expert of ``layer``."""
    shutil.copytree(container, destination)
    for chunk in (destination / "experts" / f"layer_{layer:03d}" / "c").glob("*/0"):
        data = bytearray(chunk.read_bytes())
        data[offset] ^= 0x01
        chunk.write_bytes(bytes(data))
    return destination


@pytest.mark.usefixtures("io_features")
def test_a_corrupted_record_read_while_streaming_is_a_typed_error(stream_container, tmp_path):
    broken = _with_a_flipped_bit(stream_container, tmp_path / "broken", layer=1, offset=10)
    _, loaded = _fresh(broken)
    with pytest.raises(CorruptDataError, match=r"layer 1 expert \d+: checksum mismatch"):
        generate(loaded.model, PROMPT, 2, loaded.experts)
    loaded.experts.close()


@pytest.mark.parametrize("io_features", ["platform", "forced-off", "f_nocache"], indirect=True)
def test_reads_bypass_the_page_cache_by_default_and_fall_back_where_they_cannot(
    stream_container, reference_ids, monkeypatch, io_features
):
    """O_DIRECT where the OS and filesystem take it, F_NOCACHE where O_DIRECT does not exist (macOS), else
    buffered; the stats name which, and the tokens never change."""
    import storage.files.page_cache

    container = Container(stream_container)
    config = StoreConfig(ram_bytes=_budget(container, "min"))
    assert config.direct
    loaded = load_container(stream_container, store=config)
    try:
        assert generate(loaded.model, PROMPT, NEW_TOKENS, loaded.experts).ids == reference_ids
        report = loaded.experts.report()
    finally:
        loaded.experts.close()
    expected = {"platform": "o_direct", "forced-off": "none", "f_nocache": "f_nocache"}[io_features.name]
    if not hasattr(os, "O_DIRECT") and io_features.name == "platform":  # reflection: the host OS's constant
        expected = str(io_features.bypass)
    assert report["page_cache_bypass"] == expected  # this filesystem takes O_DIRECT (the 96-way grid reads with it)
    assert report["direct_io"] is (expected != "none")
    if io_features.name == "f_nocache":  # F_NOCACHE set on every record opened: the first-file check, then each read
        assert len(io_features.nocache_fds) == 1 + report["reads"]

    # a filesystem that refuses the bypass (tmpfs refuses O_DIRECT): buffered reads, the same tokens
    monkeypatch.setattr(storage.files.page_cache, "bypass_refusal", lambda path: "unsupported (test)")
    loaded = load_container(stream_container, store=config)
    try:
        assert generate(loaded.model, PROMPT, NEW_TOKENS, loaded.experts).ids == reference_ids
        assert loaded.experts.report()["direct_io"] is False
        assert loaded.experts.report()["page_cache_bypass"] == "none"
    finally:
        loaded.experts.close()


def test_acquired_experts_say_whether_indexing_would_wait_for_a_read(stream_container):
    container = Container(stream_container)
    config = StoreConfig(ram_bytes=container.expert_bytes, prefetch=False, preload=False)
    loaded = load_container(stream_container, store=config)
    store, layer = loaded.experts, container.moe_layers[0]
    try:
        first = store.acquire(layer, [0, 1])
        first[0], first[1]  # noqa: B018 - waits for both reads
        assert first.ready(0) and first.ready(1)
        store.release(layer, [0, 1])
        again = store.acquire(layer, [1, 2])  # 1 a hit, 2 a miss whose read has just been started
        assert again.ready(1)
        again[2]  # noqa: B018
        assert again.ready(2)
        with pytest.raises(KeyError):
            again.ready(0)  # not part of this acquire
        store.release(layer, [1, 2])
    finally:
        store.close()


@pytest.mark.parametrize("budget", ["min", "50%"])
def test_int8_activations_give_the_resident_tokens_under_a_streaming_budget(stream_container, budget):
    """The experts in memory are computed in one call before the store waits for the others: the
    batches change with what is loaded, the float64 sum (and the tokens) do not."""
    resident = load_container(stream_container, int8_activations=True)
    expected = generate(resident.model, PROMPT, NEW_TOKENS, resident.experts).ids
    container = Container(stream_container)
    config = StoreConfig(ram_bytes=_budget(container, budget), policy="lru")
    loaded = load_container(stream_container, store=config, int8_activations=True)
    try:
        assert generate(loaded.model, PROMPT, NEW_TOKENS, loaded.experts).ids == expected
        assert loaded.experts.report()["reads"] > len(container.moe_layers)
    finally:
        loaded.experts.close()


class HeldReads:
    """The store's disk reads wait until released: queued guesses stay queued while a test looks."""

    def __init__(self, store):
        self.gate = threading.Event()
        read = store._reader.read_into
        store._reader.read_into = lambda *a: (self.gate.wait(10), read(*a))[1]


@pytest.fixture
def held_store(stream_container):
    """(store with room for every expert, none read yet, one read thread whose reads wait at ``held.gate``,
    first MoE layer, held); the gate is opened and the store closed after the test."""
    container = Container(stream_container)
    config = StoreConfig(ram_bytes=container.expert_bytes, threads=1, preload=False)
    loaded = load_container(stream_container, store=config)
    store = loaded.experts
    held = HeldReads(store)
    try:
        yield store, container.moe_layers[0], held
    finally:
        held.gate.set()
        store.close()


def test_a_guess_the_router_does_not_confirm_is_dropped_before_its_read(held_store):
    store, layer, held = held_store
    store.prefetch(layer, [0, 1, 2, 3])  # one thread: 0 starts (and waits), 1-3 queue
    store.prefetch(layer, [0, 1, 2])  # a nearer guess: 3 is dropped
    acquired = store.acquire(layer, [0, 1])  # the router picks 0 and 1: 2 is dropped
    assert (layer, 2) not in store.ram and (layer, 3) not in store.ram  # slots freed
    held.gate.set()
    acquired[0], acquired[1]  # noqa: B018 - both read
    store.release(layer, [0, 1])
    stats = store.report()
    assert stats["prefetch"] == {"issued": 4, "useful": 2, "wasted": 0, "cancelled": 2}
    assert stats["reads"] == 2 and stats["misses"] == 0


def test_a_guess_whose_read_started_is_kept_and_counted_as_read(held_store):
    store, layer, held = held_store
    store.prefetch(layer, [5, 6])
    reading_5, deadline = store.ram.entries[(layer, 5)].loading, time.monotonic() + 10
    while not reading_5.running() and time.monotonic() < deadline:
        time.sleep(0.01)  # until the one thread has taken 5's read (it then waits at the gate)
    acquired = store.acquire(layer, [6])  # 5 is not picked, but its read is under way
    held.gate.set()
    acquired[6]  # noqa: B018
    store.release(layer, [6])
    assert (layer, 5) in store.ram
    stats = store.report()
    assert stats["prefetch"]["cancelled"] == 0 and stats["reads"] == 2


def test_a_guess_is_awaited_until_the_router_reaches_its_layer(held_store):
    store, layer, held = held_store
    held.gate.set()
    store.prefetch(layer, [1, 2, 3])
    assert all(store.ram.entries[(layer, e)].awaited for e in (1, 2, 3))
    for expert in (1, 2, 3):
        store.ram.entries[(layer, expert)].loading.result(timeout=10)  # read: no longer cancellable
    store.prefetch(layer, [1, 2])  # a nearer guess leaves 3 out: no longer awaited (its read ran)
    assert (layer, 3) in store.ram and not store.ram.entries[(layer, 3)].awaited
    acquired = store.acquire(layer, [1, 4])  # 1 used, 2 passed by
    acquired[1], acquired[4]  # noqa: B018
    store.release(layer, [1, 4])
    assert not any(store.ram.entries[(layer, e)].awaited for e in (1, 2, 4))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_any_prefetch_depth_generates_the_resident_tokens(stream_container, reference_ids, depth):
    container = Container(stream_container)
    config = StoreConfig(ram_bytes=_budget(container, "20%"), prefetch_layers=depth, threads=2)
    loaded = load_container(stream_container, store=config)
    try:
        ids = generate(loaded.model, PROMPT, NEW_TOKENS, loaded.experts).ids
        stats = loaded.experts.report()
    finally:
        loaded.experts.close()
    assert ids == reference_ids
    assert stats["prefetch"]["issued"] > 0


@pytest.mark.usefixtures("io_features")
def test_preload_reads_every_expert_once_when_the_budget_holds_them_all(stream_container, reference_ids):
    container = Container(stream_container)
    loaded = load_container(stream_container, store=StoreConfig(ram_bytes=container.expert_bytes, preload=True))
    store = loaded.experts
    try:
        loaded_keys = {(layer, e) for layer in container.moe_layers for e in range(container.n_experts)}
        assert set(store.ram.entries) == loaded_keys and not store.ram.loading()
        assert store.report()["reads"] == len(loaded_keys)  # read at load, each once
        before = store.snapshot()
        ids = generate(loaded.model, PROMPT, NEW_TOKENS, store).ids
        turn = store.snapshot().minus(before)
        assert store.preload() == 0  # already there: nothing read again
    finally:
        store.close()
    assert ids == reference_ids
    assert turn.misses == 0 and turn.reads == 0 and turn.requests == turn.hits_ram > 0


def test_preload_reads_nothing_when_the_budget_holds_part_or_it_is_off(stream_container):
    container = Container(stream_container)
    for config in (
        StoreConfig(ram_bytes=_budget(container, "50%"), preload=True),
        StoreConfig(ram_bytes=container.expert_bytes, preload=False),
    ):
        loaded = load_container(stream_container, store=config)
        try:
            assert not loaded.experts.preloads() and loaded.experts.preload() == 0
            assert loaded.experts.report()["reads"] == 0 and not loaded.experts.ram.entries
        finally:
            loaded.experts.close()


@pytest.mark.usefixtures("io_features")
def test_a_corrupted_record_met_by_preload_fails_the_load_naming_it(stream_container, tmp_path):
    broken = _with_a_flipped_bit(stream_container, tmp_path / "broken", layer=2, offset=99)
    config = StoreConfig(ram_bytes=Container(broken).expert_bytes, preload=True)
    with pytest.raises(CorruptDataError, match=r"layer 2 expert \d+: checksum mismatch"):
        load_container(broken, store=config)


def test_a_slot_keeps_its_views_and_they_show_whichever_record_it_holds(stream_container):
    """The expert of a slot is built once; after the slot is reused for another record the same object
    holds that record's codes (what a full-budget store gives for it), never the old ones."""
    container = Container(stream_container)
    config = StoreConfig(ram_bytes=_budget(container, "min"), prefetch=False)
    store = load_container(stream_container, store=config).experts
    resident = load_container(stream_container).experts
    layer, built = container.moe_layers[0], {}
    try:
        for first in range(0, container.n_experts, container.experts_per_token):
            ids = list(range(first, min(first + container.experts_per_token, container.n_experts)))
            store.acquire(layer, ids)
            for expert in ids:
                got, want = store.expert(layer, expert), resident.acquire(layer, [expert])[expert]
                assert all(getattr(got, m).q.equal(getattr(want, m).q) for m in ("w1", "w2", "w3"))
                built.setdefault(store.ram.entries[(layer, expert)].slot, set()).add(id(got))
            store.release(layer, ids)
    finally:
        store.close()
    assert container.n_experts > store.ram.n_slots  # slots were reused...
    assert all(len(objects) == 1 for objects in built.values())  # ...each with its one expert object


def test_settle_builds_each_resident_slot_once_and_every_use_gets_its_expert(stream_container):
    """``settle`` (the engine's rearrangement of a slot that keeps its record) runs once per slot when
    ``resident`` first hands a layer out, and ``expert`` then gives the same object; without every record
    in RAM nothing is settled."""
    from colibri_stream.experts.codec import expert_from_record
    from storage.tiers.tiered import TieredExpertStore

    container = Container(stream_container)
    settled: list[int] = []

    def settle(record):
        settled.append(record.ctypes.data)
        return ("settled", expert_from_record(container.layout, record))

    materialize = lambda record: expert_from_record(container.layout, record)  # noqa: E731
    store = TieredExpertStore(container, StoreConfig(ram_bytes=container.expert_bytes), materialize, settle=settle)
    layer = container.moe_layers[0]
    acquired = store.acquire(layer, [0, 1])
    before = acquired[0]
    store.release(layer, [0, 1])
    assert store.resident(layer) is None and not settled  # not every record is in RAM yet
    store.preload()
    held = store.resident(layer)
    assert held is not None and len(settled) == container.n_experts == len(set(settled))
    assert all(e[0] == "settled" for e in held) and held[0] is not before
    assert store.resident(layer) is held and len(settled) == container.n_experts  # built once
    acquired = store.acquire(layer, [0, 3])
    assert acquired[0] is held[0] and acquired[3] is held[3]
    store.release(layer, [0, 3])
    store.close()
