"""Equivalences of the engine with itself: attention paths, chunking, and DSA selection."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from colibri_stream.devtools import fixtures
from engine.core.rope import rope_tables
from engine.mla.model import Transformer

DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")


def _ids(loaded, length: int = 40) -> list[int]:
    return fixtures.make_prompt(loaded.args.vocab_size, length, seed=3)


def _logits(loaded, ids, absorb=None, model=None):
    model = model or loaded.model
    return model(torch.tensor([ids]), 0, model.new_cache(), loaded.experts, absorb=absorb)[0]


def _with_args(loaded, **changes) -> Transformer:
    model = Transformer(dataclasses.replace(loaded.args, **changes))
    model.load_state_dict(loaded.model.state_dict())
    return model.eval()


def test_absorbed_equals_expanded(loaded):
    ids = _ids(loaded)
    absorbed, expanded = _logits(loaded, ids, absorb=True), _logits(loaded, ids, absorb=False)
    assert (absorbed - expanded).abs().max().item() <= 1e-5


def test_query_blocked_scores_equal_one_block(loaded, monkeypatch):
    """Prefill attention and DSA scoring cut into blocks of 1 and 3 queries give the same logits."""
    import engine.core.layers

    ids = _ids(loaded)
    whole = _logits(loaded, ids)
    per_query = loaded.args.n_heads * len(ids) * 4
    for block_queries in (1, 3):
        monkeypatch.setattr(engine.core.layers, "SCORE_BLOCK_BYTES", block_queries * per_query)
        assert (_logits(loaded, ids) - whole).abs().max().item() <= 1e-5


def test_query_blocks_cover_every_position_once():
    from engine.core.layers import SCORE_BLOCK_BYTES, query_blocks

    blocks = list(query_blocks(10, SCORE_BLOCK_BYTES // 3))
    assert [(b.start, b.stop) for b in blocks] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert list(query_blocks(5, SCORE_BLOCK_BYTES * 2)) == [slice(i, i + 1) for i in range(5)]


@pytest.mark.parametrize("chunk", [1, 7])
def test_prefill_then_decode_equals_one_forward(loaded, chunk):
    ids = _ids(loaded)
    whole = _logits(loaded, ids)
    cache = loaded.model.new_cache()
    pieces = [loaded.model(torch.tensor([ids[:12]]), 0, cache, loaded.experts)[0]]
    for start in range(12, len(ids), chunk):
        pieces.append(loaded.model(torch.tensor([ids[start : start + chunk]]), start, cache, loaded.experts)[0])
    assert cache.length == len(ids)
    assert (torch.cat(pieces) - whole).abs().max().item() <= 1e-5


@pytest.mark.parametrize("chunk", [12, 16])
def test_chunked_prefill_equals_one_forward(loaded, chunk):
    """generate's prefill in chunks (40 = 3 x 12 + an absorbed tail of 4; 16 + 16 + 8), each attending to
    the cache the earlier ones filled, == the prompt in one forward: logits and greedy ids."""
    from colibri_stream.devtools.steps import prefill
    from colibri_stream.runtime.generate import generate

    ids = _ids(loaded)
    whole = _logits(loaded, ids)[-1]
    cache = loaded.model.new_cache()
    chunked = prefill(loaded.model, ids, cache, loaded.experts, chunk)
    assert cache.length == len(ids)
    assert (chunked - whole).abs().max().item() <= 1e-4
    one_shot = generate(loaded.model, ids, 8, loaded.experts, prefill_chunk=len(ids)).ids
    assert generate(loaded.model, ids, 8, loaded.experts, prefill_chunk=chunk).ids == one_shot


def test_auto_mode_picks_absorbed_for_decode_and_expanded_for_prefill(loaded, monkeypatch):
    from engine.mla.attention import MLA

    if loaded.args.v4 is not None:
        pytest.skip("MLA's two attention paths; DeepSeek-V4's one K=V head has no absorbed form")

    used: list[str] = []

    def spy(name):
        original = getattr(MLA, name)
        return lambda self, *args: used.append(name) or original(self, *args)

    monkeypatch.setattr(MLA, "_absorbed", spy("_absorbed"))
    monkeypatch.setattr(MLA, "_expanded", spy("_expanded"))
    cache = loaded.model.new_cache()
    loaded.model(torch.tensor([_ids(loaded, 12)]), 0, cache, loaded.experts)
    assert set(used) == {"_expanded"}
    used.clear()
    loaded.model(torch.tensor([[5]]), 12, cache, loaded.experts)
    assert set(used) == {"_absorbed"}


@pytest.mark.parametrize("absorb", [False, True], ids=["expanded", "absorbed"])
def test_dsa_selecting_every_position_equals_dense(tiny_checkpoints, absorb):
    """Attention given a selection of all T positions (future ones masked causally) == no selection."""
    from colibri_stream.runtime.loader import load_checkpoint

    loaded = load_checkpoint(tiny_checkpoints["deepseek_v32"])
    attn, args = loaded.model.layers[0].attn, loaded.args
    x = torch.randn(1, 10, args.dim, generator=torch.Generator().manual_seed(0))
    rope = rope_tables(args, 0, 10, x.device)
    everything = torch.arange(10).expand(1, 10, 10)
    attn.indexer, indexer = None, attn.indexer  # take the selection from outside, as a shared layer does
    try:
        with torch.no_grad():
            dense, _ = attn(x, 0, rope, loaded.model.new_cache().layers[0], selection=None, absorb=absorb)
            full, _ = attn(x, 0, rope, loaded.model.new_cache().layers[0], selection=everything, absorb=absorb)
    finally:
        attn.indexer = indexer
    assert (full - dense).abs().max().item() <= 1e-6


@pytest.mark.parametrize("family", DSA_FAMILIES)
def test_index_topk_at_least_context_equals_dense_and_below_it_selects(tiny_checkpoints, family):
    from colibri_stream.runtime.loader import load_checkpoint

    loaded = load_checkpoint(tiny_checkpoints[family])
    ids = _ids(loaded, 24)
    dense = _logits(loaded, ids, model=_with_args(loaded, index_topk=10**6))
    at_context = _logits(loaded, ids, model=_with_args(loaded, index_topk=len(ids)))
    selecting = _logits(loaded, ids)  # index_topk = 8 < 24
    assert (at_context - dense).abs().max().item() <= 1e-6
    k = loaded.args.index_topk
    assert (selecting[:k] - dense[:k]).abs().max().item() <= 1e-5  # the first k rows see <= k positions
    assert (selecting[k:] - dense[k:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("family", DSA_FAMILIES)
def test_decode_selection_is_active_beyond_index_topk(tiny_checkpoints, family):
    """A decode step at context 21 > index_topk really uses a K-position selection."""
    from colibri_stream.runtime.loader import load_checkpoint

    loaded = load_checkpoint(tiny_checkpoints[family])
    ids = _ids(loaded, 21)
    steps = {}
    for name, model in {"sparse": loaded.model, "dense": _with_args(loaded, index_topk=10**6)}.items():
        cache = model.new_cache()
        model(torch.tensor([ids[:-1]]), 0, cache, loaded.experts)
        steps[name] = model(torch.tensor([ids[-1:]]), 20, cache, loaded.experts)[0, -1]
    assert (steps["sparse"] - steps["dense"]).abs().max().item() > 1e-2


def test_glm_shared_layers_reuse_the_previous_full_layers_selection(tiny_checkpoints):
    from colibri_stream.runtime.loader import load_checkpoint

    loaded = load_checkpoint(tiny_checkpoints["glm_moe_dsa"])
    kinds = loaded.args.indexer_types
    seen: dict[int, tuple] = {}

    def record(layer_id):
        def hook(module, inputs, output):
            seen[layer_id] = (inputs[4], output[1])  # (selection given, selection returned)

        return hook

    handles = [block.attn.register_forward_hook(record(i)) for i, block in enumerate(loaded.model.layers)]
    try:
        _logits(loaded, _ids(loaded, 24))
    finally:
        for handle in handles:
            handle.remove()
    for layer, kind in enumerate(kinds):
        given, returned = seen[layer]
        if kind == "shared":
            assert loaded.model.layers[layer].attn.indexer is None
            assert given is not None and given is seen[layer - 1][1] and returned is given
        else:
            assert returned is not None and returned.shape[-1] == loaded.args.index_topk
