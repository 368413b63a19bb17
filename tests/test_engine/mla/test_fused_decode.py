"""A decode step in one C call (engine/mla/fused_decode.py): with every expert resident it gives the module path's
bits (logits, hidden states, cache) for one row and for a verify step's rows, at the fixtures' widths and at
odd ones, with int8 activations over int8 and int4 dense records and on the float32 path over bf16 ones (the
default container), in the tiered store and the resident one; several sequences in one step each get their
solo bits and each expert of the union is used once; it counts the experts it used as the acquires it
skipped would have; on DSA models the indexers run between the C step's layers with the same bits; it stays
off where it does not apply (a budget below the experts, float activations over int8 records, float32
weights), and a failed step leaves the caches as they were."""

from __future__ import annotations

import pytest
import torch

from colibri_stream.runtime.loader import load_container
from engine.core.cache import KVCache
from engine.kernels import decode_ops
from engine.mla import fused_decode
from storage.container.reader import Container
from storage.tiers.config import StoreConfig

pytestmark = pytest.mark.skipif(not fused_decode.available(), reason="the C kernels are not built")

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


class Counting:
    """The extension, counting the decode steps begun in C (a DSA step resumes after each indexer: those calls
    are not counted) and failing them with ``fail``."""

    def __init__(self, real, fail: bool = False):
        self.real, self.fail, self.calls = real, fail, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def decode_layers(self, *args):
        self.calls += args[9] == (0, False)  # at: from the first layer
        if self.fail:
            raise MemoryError("no memory for the work area")
        return self.real.decode_layers(*args)


@pytest.fixture
def counting(monkeypatch):
    kernels = Counting(fused_decode._kernels)
    monkeypatch.setattr(fused_decode, "_kernels", kernels)
    return kernels


def _decode(model, experts, steps: int, verify: int = 0, prompt: list[int] = PROMPT):
    """Prompt, ``steps`` greedy one-row steps, then (``verify``) one step of that many rows on the same cache:
    (tokens, every step's logits and hidden states, the cache's final state)."""
    cache, tokens, outputs = model.new_cache(), list(prompt), []
    logits = model(torch.tensor([tokens]), 0, cache, experts)[0, -1]
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits, hidden = model.forward_rows_hidden([tokens[-1]], [cache], experts)
        outputs += [logits, hidden]
        logits = logits[0]
    if verify:
        drafted = [(tokens[-1] + i) % 7 for i in range(verify)]
        outputs += list(model.forward_rows_hidden(drafted, [cache] * verify, experts))
    return tokens, outputs, cache.state()


def _assert_same(a, b):
    assert a[0] == b[0]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
    for x, y in zip(a[2], b[2], strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _resident_store(path):
    return StoreConfig(ram_bytes=Container(path).expert_bytes, preload=True)


def _int8_activations(dense: str) -> bool:
    """int8 activations over int8 / int4 dense records; a bf16 container runs the float32 path."""
    return dense != "bf16"


@pytest.mark.parametrize(
    ("family", "dense", "tiered"),
    [
        ("deepseek_v3", "int8", True),
        ("deepseek_v3", "int4", False),
        ("kimi_k2", "int4", True),
        ("deepseek_v32", "int8", True),
        ("glm_moe_dsa", "int4", False),
        ("deepseek_v3", "bf16", True),
        ("kimi_k2", "bf16", False),
        ("deepseek_v32", "bf16", False),
        ("glm_moe_dsa", "bf16", True),
    ],
)
def test_one_call_gives_the_module_paths_bits(make_container, counting, family, dense, tiered):
    path = make_container(family, "int4", dense)
    store = _resident_store(path) if tiered else None
    loaded = load_container(path, store=store, int8_activations=_int8_activations(dense))
    fused = _decode(loaded.model, loaded.experts, 5, verify=3)
    assert counting.calls == 5 + 1  # every decode step (the verify step's three rows in one), none of the prompt's
    with fused_decode.module_path():
        plain = _decode(loaded.model, loaded.experts, 5, verify=3)
    assert counting.calls == 6
    _assert_same(fused, plain)


@pytest.mark.parametrize("dense", ["int8", "bf16"])
def test_odd_widths_give_the_module_paths_bits(odd_container, odd_bf16_container, counting, dense):
    path = odd_container if dense == "int8" else odd_bf16_container
    loaded = load_container(path, store=_resident_store(path), int8_activations=_int8_activations(dense))
    fused = _decode(loaded.model, loaded.experts, 6)
    with fused_decode.module_path():
        plain = _decode(loaded.model, loaded.experts, 6)
    assert counting.calls == 6
    _assert_same(fused, plain)


def test_a_dsa_context_growing_past_index_topk_gives_the_module_paths_bits(make_container, counting):
    """From a 3-token prompt to 12 positions: the indexer keeps every position (no selection) up to its
    top-k of 8, then selects; the cache's indexer keys are the module path's throughout."""
    loaded = load_container(make_container("glm_moe_dsa", "int4", "int8"), int8_activations=True)
    fused = _decode(loaded.model, loaded.experts, 8, verify=2, prompt=PROMPT[:3])
    with fused_decode.module_path():
        plain = _decode(loaded.model, loaded.experts, 8, verify=2, prompt=PROMPT[:3])
    assert counting.calls == 9 and "index_key" in fused[2][0]
    _assert_same(fused, plain)


@pytest.mark.parametrize("threads", [1, 2])
def test_routing_beside_the_shared_expert_gives_the_module_paths_bits(make_container, counting, threads):
    """The C step routes a layer while its shared expert's gate and up run (split_run_beside): on one kernel
    thread the routing runs before the blocks, on two beside the helper's; both give the module path's bits."""
    loaded = load_container(make_container("deepseek_v3", "int4", "int8"), int8_activations=True)
    assert loaded.model.args.n_shared_experts > 0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = _decode(loaded.model, loaded.experts, 4, verify=2)
        with fused_decode.module_path():
            plain = _decode(loaded.model, loaded.experts, 4, verify=2)
    finally:
        torch.set_num_threads(before)
    assert counting.calls == 5
    _assert_same(fused, plain)


@pytest.mark.parametrize(
    ("family", "dense"),
    [("kimi_k2", "int8"), ("kimi_k2", "int4"), ("glm_moe_dsa", "int8"), ("kimi_k2", "bf16"), ("glm_moe_dsa", "bf16")],
)
def test_several_sequences_in_one_call_each_get_their_solo_bits(make_container, counting, family, dense):
    """Three conversations of different lengths, one of them twice in the step (a verify step beside two
    requests): each row's logits, hidden state and cache are what its solo module-path steps give, and each
    layer's experts are the union of the rows' once. On the DSA model one conversation is within the
    indexer's top-k and the others past it."""
    loaded = load_container(make_container(family, "int4", dense), int8_activations=_int8_activations(dense))
    model, experts = loaded.model, loaded.experts
    prompts = [PROMPT, PROMPT[:4], [9, 8, 7, 6, 5, 4, 3]]
    caches, solo = [model.new_cache() for _ in prompts], [model.new_cache() for _ in prompts]
    for prompt, cache, alone in zip(prompts, caches, solo, strict=True):
        model(torch.tensor([prompt]), 0, cache, experts)
        model(torch.tensor([prompt]), 0, alone, experts)
    batched = [
        KVCache.from_state(cache.state()) for cache in caches
    ]  # the module path's batched step, for its acquires
    rows, tokens = [caches[0], caches[1], caches[1], caches[2]], [11, 12, 13, 14]
    before = experts.snapshot()
    logits, hidden = model.forward_rows_hidden(tokens, rows, experts)
    used = experts.snapshot().minus(before).requests
    assert counting.calls == 1
    before = experts.snapshot()
    with fused_decode.module_path():
        module = model.forward_rows_hidden(tokens, [batched[0], batched[1], batched[1], batched[2]], experts)
    assert used == experts.snapshot().minus(before).requests  # the union of each layer, once
    assert torch.equal(module[0], logits) and torch.equal(module[1], hidden)
    with fused_decode.module_path():
        for b, (token, cache) in enumerate(zip(tokens, [solo[0], solo[1], solo[1], solo[2]], strict=True)):
            alone_logits, alone_hidden = model.forward_rows_hidden([token], [cache], experts)
            assert torch.equal(logits[b], alone_logits[0]) and torch.equal(hidden[b], alone_hidden[0])
    for cache, alone in zip(caches, solo, strict=True):
        _assert_same(([], [], cache.state()), ([], [], alone.state()))


def test_the_experts_used_are_counted_as_the_acquires_would_have(make_container, counting):
    path = make_container("deepseek_v3", "int4", "int8")
    runs = []
    for module_path in (False, True):
        loaded = load_container(path, store=_resident_store(path), int8_activations=True)
        cache = loaded.model.new_cache()
        loaded.model(torch.tensor([PROMPT]), 0, cache, loaded.experts)
        before = loaded.experts.snapshot()
        with fused_decode.module_path() if module_path else _nothing():
            for token in (7, 8, 9, 10):
                loaded.model.forward_rows([token], [cache], loaded.experts)
        step = loaded.experts.snapshot().minus(before)
        history = {layer: list(counts) for layer, counts in loaded.experts.history.counts.items()}
        runs.append((step.requests, step.hits_ram, step.misses, loaded.experts.routed.table(), history))
    assert counting.calls == 4
    (requests, hits, misses, routed, history), plain = runs[0], runs[1]
    assert requests == plain[0] == hits == plain[1] and requests == 4 * loaded.args.n_activated_experts * 2
    assert misses == plain[2] == 0
    assert routed == plain[3] and history == plain[4]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_it_stays_off_where_it_does_not_apply(make_container, counting):
    path = make_container("deepseek_v3", "int4", "int8")
    container = Container(path)
    # a budget below the experts: the store cannot promise they stay, so every step acquires
    partial = load_container(path, store=StoreConfig(ram_bytes=container.expert_bytes // 2), int8_activations=True)
    assert all(partial.experts.resident(layer) is None for layer in container.moe_layers)
    _decode(partial.model, partial.experts, 3)
    # float activations over int8 records: the modules compute in float, C would quantise x
    exact = load_container(path, store=_resident_store(path))
    _decode(exact.model, exact.experts, 3)
    # float32 weights (a lossless container): no C matrix of them
    f32 = make_container("deepseek_v3", "int4", "f32")
    lossless = load_container(f32, store=_resident_store(f32))
    _decode(lossless.model, lossless.experts, 3)
    # the float32 path's prompt rows
    bf16 = make_container("deepseek_v3", "int4", "bf16")
    default = load_container(bf16, store=_resident_store(bf16))
    default.model(torch.tensor([PROMPT]), 0, default.model.new_cache(), default.experts)
    assert counting.calls == 0
    _decode(default.model, default.experts, 1)
    assert counting.calls == 1  # and its decode rows take it


def test_the_tiered_store_promises_residency_only_once_every_expert_is_read(make_container):
    path = make_container("deepseek_v3", "int4", "int8")
    container = Container(path)
    lazy = load_container(path, store=StoreConfig(ram_bytes=container.expert_bytes, preload=False))
    layer = container.moe_layers[0]
    assert lazy.experts.resident(layer) is None  # the slots could hold them all, but nothing is read yet
    loaded = load_container(path, store=_resident_store(path))
    first = loaded.experts.resident(layer)
    assert first is not None and len(first) == container.n_experts
    assert loaded.experts.resident(layer) is first  # the same tuple: a caller keeps what it derived from it
    assert loaded.experts.resident(0 if layer else -1) is None  # a dense layer has no experts
    record = container.layout.record_bytes
    cpu_vram = StoreConfig(ram_bytes=container.expert_bytes, vram_bytes=record, vram_device="cpu")
    assert load_container(path, store=cpu_vram).experts.resident(layer) is None  # a VRAM tier moves experts


def test_a_failed_step_leaves_the_caches_as_they_were(make_container, monkeypatch):
    path = make_container("deepseek_v3", "int4", "int8")
    loaded = load_container(path, store=_resident_store(path), int8_activations=True)
    cache, other = loaded.model.new_cache(), loaded.model.new_cache()
    loaded.model(torch.tensor([PROMPT]), 0, cache, loaded.experts)
    loaded.model(torch.tensor([PROMPT[:3]]), 0, other, loaded.experts)
    before = cache.state()
    monkeypatch.setattr(fused_decode, "_kernels", Counting(fused_decode._kernels, fail=True))
    with pytest.raises(MemoryError):
        loaded.model.forward_rows([7, 8, 9], [cache, other, cache], loaded.experts)
    assert cache.length == len(PROMPT) and other.length == 3
    after = cache.state()
    assert all(torch.equal(before[i]["latent"], after[i]["latent"]) for i in range(len(before)))
    monkeypatch.undo()
    with fused_decode.module_path():  # and the next step is the one it would have been
        expected = loaded.model.forward_rows([7], [KVCache.from_state(before)], loaded.experts)
    assert torch.equal(loaded.model.forward_rows([7], [cache], loaded.experts), expected)
    assert decode_ops.available()
