"""KV cache state/trim and the ExpertProvider contract (batch-union, only routed experts)."""

from __future__ import annotations

import torch

from colibri_stream.devtools import fixtures
from engine.cache import KVCache


def _forward(loaded, ids, start, cache):
    return loaded.model(torch.tensor([ids]), start, cache, loaded.experts)[0]


def test_cache_holds_only_the_compressed_state(loaded):
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
    _forward(loaded, ids, 0, cache)
    cache.trim(15)
    resumed = _forward(loaded, edited[15:], 15, cache)
    fresh = _forward(loaded, edited, 0, loaded.model.new_cache())[15:]
    assert (resumed - fresh).abs().max().item() <= 1e-5


def test_prefill_acquires_each_routed_expert_once_per_layer_and_nothing_else(loaded, monkeypatch):
    from engine.moe import Gate

    routed: dict[int, set[int]] = {}
    original = Gate.forward

    def spy(self, x):
        weights, ids = original(self, x)
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

    def __call__(self, x):
        self.inputs.append(x)
        return self.expert(x)


def test_experts_on_another_device_give_the_same_layer_output(loaded, monkeypatch):
    """The MoE layer with every other expert "elsewhere": one partial sum per device, same output."""
    from engine.experts import ResidentExperts
    from engine.moe import MoE, RoutedSum

    layer = next(i for i, block in enumerate(loaded.model.layers) if isinstance(block.ffn, MoE))
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
