"""KV cache state/trim and the expert source contract (batch-union, only routed experts)."""

from __future__ import annotations

import pytest
import torch

from colibri_stream.devtools import fixtures
from engine.core.cache import KVCache
from engine.core.sources import Offered


def _forward(loaded, ids, start, cache):
    return loaded.model(torch.tensor([ids]), start, cache, loaded.experts)[0]


def _mla_only(loaded) -> None:
    if loaded.args.v4 is not None:
        pytest.skip("MLA's KVCache; V4's per-position rows: test_v4_oracle.py::test_a_cache_rebuilt_from_its_rows...")


def test_cache_holds_only_the_compressed_state(loaded):
    _mla_only(loaded)
    args = loaded.args
    cache = loaded.model.new_cache()
    _forward(loaded, fixtures.make_prompt(args.vocab_size, 9), 0, cache)
    for layer, state in enumerate(cache.state()):
        assert state["latent"].shape == (1, 9, args.kv_lora_rank)
        assert state["rope_key"].shape == (1, 9, args.qk_rope_head_dim)
        if args.has_indexer(layer):
            assert state["index_key"].shape == (1, 9, args.index_head_dim)
        else:
            assert "index_key" not in state


def test_state_round_trip_resumes_exactly(loaded):
    _mla_only(loaded)
    ids = fixtures.make_prompt(loaded.args.vocab_size, 30, seed=5)
    cache = loaded.model.new_cache()
    _forward(loaded, ids[:20], 0, cache)
    restored = KVCache.from_state(cache.state())
    assert restored.length == 20
    assert torch.equal(_forward(loaded, ids[20:], 20, restored), _forward(loaded, ids[20:], 20, cache))


def test_trim_then_new_suffix_equals_fresh_run(loaded):
    ids = fixtures.make_prompt(loaded.args.vocab_size, 24, seed=6)
    edited = ids[:15] + fixtures.make_prompt(loaded.args.vocab_size, 9, seed=7)
    cache = loaded.model.new_cache()
    if loaded.args.v4 is not None:
        cache.keep_rows_from = 0  # V4 keeps only the windows' rows unless a log still needs them
    _forward(loaded, ids, 0, cache)
    cache.trim(15)
    resumed = _forward(loaded, edited[15:], 15, cache)
    fresh = _forward(loaded, edited, 0, loaded.model.new_cache())[15:]
    assert (resumed - fresh).abs().max().item() <= 1e-5


def test_prefill_acquires_each_routed_expert_once_per_layer_and_nothing_else(loaded, monkeypatch):
    from engine.core.moe import Gate

    routed: dict[int, set[int]] = {}
    original = Gate.forward

    def spy(self, x, tokens=None):
        weights, ids = original(self, x, tokens)
        layer = next(i for i, block in enumerate(loaded.model.layers) if getattr(block.ffn, "gate", None) is self)
        routed[layer] = set(ids.flatten().tolist())
        return weights, ids

    monkeypatch.setattr(Gate, "forward", spy)
    acquired: list[tuple[int, tuple[int, ...]]] = []
    original_acquire = type(loaded.experts).acquire

    def record(self, layer, expert_ids):
        acquired.append((layer, tuple(expert_ids)))
        return original_acquire(self, layer, expert_ids)

    monkeypatch.setattr(type(loaded.experts), "acquire", record)
    _forward(loaded, fixtures.make_prompt(loaded.args.vocab_size, 16, seed=8), 0, loaded.model.new_cache())
    layers = [layer for layer, _ in acquired]
    assert layers == list(loaded.args.moe_layers)  # one acquire per MoE layer, in order
    for layer, expert_ids in acquired:
        assert len(expert_ids) == len(set(expert_ids))  # batch-union: no expert twice
        assert set(expert_ids) == routed[layer]  # exactly the routed experts


class _ElsewhereExpert:
    """An expert that claims another device ("cpu:0" != "cpu" to torch), so RoutedSum keeps its
    inputs and partial sum apart exactly as for a VRAM-tier expert, without needing a GPU."""

    device = torch.device("cpu", 0)

    def __init__(self, expert):
        self.expert = expert
        self.inputs: list[torch.Tensor] = []

    def __call__(self, x, limit=None):
        self.inputs.append(x)
        return self.expert(x, limit=limit)


def test_experts_on_another_device_give_the_same_layer_output(loaded, monkeypatch):
    """The MoE layer with every other expert "elsewhere": one partial sum per device, same output."""
    from engine.core.moe import MoE, RoutedSum
    from engine.core.sources import ResidentExperts

    layer = next(
        i for i, block in enumerate(loaded.model.layers) if isinstance(block.ffn, MoE) and not block.ffn.hashed
    )
    moe = loaded.model.layers[layer].ffn
    x = torch.randn(1, 9, loaded.args.dim, generator=torch.Generator().manual_seed(0))
    experts = loaded.experts.acquire(layer, range(loaded.args.n_routed_experts))
    moved = {e: _ElsewhereExpert(w) if e % 2 else w for e, w in experts.items()}
    partial_sums: list[set] = []
    total = RoutedSum.total
    monkeypatch.setattr(RoutedSum, "total", lambda self: partial_sums.append(set(self._sums)) or total(self))
    with torch.no_grad():
        expected = moe(x, ResidentExperts({layer: experts}))
        got = moe(x, ResidentExperts({layer: moved}))
    assert partial_sums == [{torch.device("cpu")}, {torch.device("cpu"), torch.device("cpu", 0)}]
    assert any(w.inputs for w in moved.values() if isinstance(w, _ElsewhereExpert))
    assert (got - expected).abs().max().item() <= 1e-6


class _Chunking:
    """A provider over ``experts`` that pins at most ``limit`` experts at once, checking the MoE layer
    keeps to it (each chunk released before the next is acquired) and recording every acquire."""

    def __init__(self, experts, limit: int | None):
        self.experts, self.limit = experts, limit
        self.acquires: list[tuple[int, tuple[int, ...]]] = []
        self.pinned: tuple[int, ...] = ()

    def offers(self):
        return Offered(max_acquire=self.limit, read_ahead=self.experts)

    def prefetch(self, layer, expert_ids):
        pass

    def lookahead(self, layers):
        return ()

    def routed_sum(self):
        return None

    def acquire(self, layer, expert_ids):
        assert not self.pinned, "a chunk was acquired before the previous one was released"
        assert self.limit is None or len(expert_ids) <= self.limit
        self.pinned = tuple(expert_ids)
        self.acquires.append((layer, self.pinned))
        return self.experts.acquire(layer, expert_ids)

    def release(self, layer, expert_ids):
        assert tuple(expert_ids) == self.pinned
        self.pinned = ()
        self.experts.release(layer, expert_ids)


def test_chunks_keep_the_order_and_cover_every_id_once():
    from engine.core.moe import chunks

    ids = [3, 0, 7, 1, 5]
    assert chunks(ids, None) == chunks(ids, 5) == chunks(ids, 9) == [ids]
    assert chunks(ids, 2) == [[3, 0], [7, 1], [5]]
    assert chunks(ids, 1) == [[e] for e in ids]
    with pytest.raises(ValueError, match="at least one expert"):
        chunks(ids, 0)


@pytest.mark.parametrize("limit", [1, 2, 3, 4])
def test_chunked_moe_is_bit_identical_to_one_acquire(loaded, limit):
    """Any chunk size (here 1 .. top-k) gives the same floats, in the layer and through a whole prefill
    and decode: one RoutedSum adds the experts in the same order whatever the chunking."""
    from engine.core.moe import MoE

    assert loaded.args.n_activated_experts == 4
    layer = next(
        i for i, block in enumerate(loaded.model.layers) if isinstance(block.ffn, MoE) and not block.ffn.hashed
    )
    moe = loaded.model.layers[layer].ffn
    x = torch.randn(1, 9, loaded.args.dim, generator=torch.Generator().manual_seed(0))
    whole, chunked = _Chunking(loaded.experts, None), _Chunking(loaded.experts, limit)
    with torch.no_grad():
        assert torch.equal(moe(x, chunked), moe(x, whole))
    assert len(whole.acquires) == 1 and len(chunked.acquires) > 1
    assert [e for _, chunk in chunked.acquires for e in chunk] == list(whole.acquires[0][1])

    prompt = fixtures.make_prompt(loaded.args.vocab_size, 12, seed=3)
    logits = {}
    for name, provider in (("whole", _Chunking(loaded.experts, None)), ("chunked", chunked)):
        cache = loaded.model.new_cache()
        prefill = loaded.model(torch.tensor([prompt]), 0, cache, provider)[0]
        decode = loaded.model(torch.tensor([[prompt[0]]]), len(prompt), cache, provider)[0]
        logits[name] = (prefill, decode)
    assert all(torch.equal(a, b) for a, b in zip(logits["chunked"], logits["whole"], strict=True))
