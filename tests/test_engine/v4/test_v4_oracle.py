"""DeepSeek-V4 against transformers' deepseek_v4, float32: every layer type, hash routing, the clamp."""

from __future__ import annotations

import pytest
import torch

from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint
from engine.core.sources import ResidentExperts

PROMPT_LEN = 20  # CSA selects from position 10 on: index_topk 4 x rate 2 < 20 / 2 entries
NEW_TOKENS = 32
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    path = fixtures.build_tiny_checkpoint("deepseek_v4", tmp_path_factory.mktemp("v4") / "deepseek_v4")
    return fixtures.load_reference(path), load_checkpoint(path)


def _forced(reference, loaded):
    prompt = fixtures.make_prompt(loaded.args.vocab_size, PROMPT_LEN)
    ids = prompt + fixtures.oracle_greedy(reference, prompt, NEW_TOKENS)
    return ids, fixtures.oracle_teacher_forced(reference, ids)


def test_greedy_tokens_equal_transformers(v4):
    reference, loaded = v4
    prompt = fixtures.make_prompt(loaded.args.vocab_size, PROMPT_LEN)
    expected = fixtures.oracle_greedy(reference, prompt, NEW_TOKENS)
    assert len(set(expected)) > NEW_TOKENS // 2  # varied output, not a short loop
    assert generate(loaded.model, prompt, NEW_TOKENS, loaded.experts).ids == expected


def test_teacher_forced_logits_equal_transformers(v4):
    reference, loaded = v4
    ids, expected = _forced(reference, loaded)
    logits = loaded.model(torch.tensor([ids]), 0, loaded.model.new_cache(), loaded.experts)[0]
    assert logits.argmax(-1).tolist() == expected.argmax
    assert (logits - expected.logits).abs().max().item() <= LOGIT_TOL


def test_token_by_token_logits_equal_transformers(v4):
    reference, loaded = v4
    ids, expected = _forced(reference, loaded)
    model, cache = loaded.model, loaded.model.new_cache()
    steps = [model(torch.tensor([ids[:PROMPT_LEN]]), 0, cache, loaded.experts)[0, -1]]
    steps += [model(torch.tensor([[t]]), cache.length, cache, loaded.experts)[0, -1] for t in ids[PROMPT_LEN:-1]]
    assert (torch.stack(steps) - expected.logits[PROMPT_LEN - 1 : -1]).abs().max().item() <= LOGIT_TOL


def test_a_prompt_fed_in_pieces_equals_the_prompt_at_once(v4):
    """Pieces that end inside open CSA and HCA windows: the pending rows and the carried overlap half
    must make the same entries as one pass."""
    _, loaded = v4
    ids = fixtures.make_prompt(loaded.args.vocab_size, 37)
    model = loaded.model
    whole_cache = model.new_cache()
    whole = model(torch.tensor([ids]), 0, whole_cache, loaded.experts)[0]
    cache, pieces, start = model.new_cache(), [], 0
    for size in (7, 1, 5, 3, 9, 12):
        pieces.append(model(torch.tensor([ids[start : start + size]]), start, cache, loaded.experts)[0])
        start += size
    assert start == len(ids)
    assert (torch.cat(pieces) - whole).abs().max().item() <= LOGIT_TOL
    for piece_layer, whole_layer in zip(cache.layers, whole_cache.layers, strict=True):
        if piece_layer.compressor is not None:
            assert piece_layer.compressor.entries.shape == whole_layer.compressor.entries.shape
            assert torch.allclose(piece_layer.compressor.entries, whole_layer.compressor.entries, atol=1e-5)


def test_the_fixture_exercises_selection_the_clamp_and_the_window(v4):
    """Each feature changes the logits of the test context when switched off: none is idle."""
    _, loaded = v4
    ids = torch.tensor([fixtures.make_prompt(loaded.args.vocab_size, PROMPT_LEN + NEW_TOKENS)])
    model = loaded.model

    def logits():
        return model(ids, 0, model.new_cache(), loaded.experts)[0]

    base = logits()
    switches = {
        "index_topk": [(layer.attn.indexer, "topk", 10**6) for layer in model.layers if layer.attn.indexer],
        "swiglu_limit": [(layer.ffn, "limit", None) for layer in model.layers],
        "sliding_window": [(layer.attn, "window", 10**6) for layer in model.layers],
    }
    for feature, changes in switches.items():
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
        for obj, name, value in changes:
            setattr(obj, name, value)
        try:
            assert (logits() - base).abs().max().item() > 1e-3, feature
        finally:
            for obj, name, value in saved:
                setattr(obj, name, value)


def _legacy(path):
    return fixtures.legacy_v4_config(path)


@pytest.mark.parametrize(
    ("overrides", "rewrite"),
    [
        ({"scoring_func": "sigmoid"}, None),
        ({"hc_mult": 2, "sliding_window": 3, "o_groups": 1, "num_attention_heads": 3}, None),
        ({}, _legacy),
    ],
    ids=["sigmoid-scores", "two-streams-one-group", "legacy-config-spellings"],
)
def test_variants_equal_transformers(tmp_path, overrides, rewrite):
    path = fixtures.build_tiny_checkpoint("deepseek_v4", tmp_path / "variant", config_overrides=overrides)
    if rewrite is not None:
        rewrite(path)
    reference, loaded = fixtures.load_reference(path), load_checkpoint(path)
    ids, expected = _forced(reference, loaded)
    assert generate(loaded.model, ids[:PROMPT_LEN], NEW_TOKENS, loaded.experts).ids == ids[PROMPT_LEN:]
    logits = loaded.model(torch.tensor([ids]), 0, loaded.model.new_cache(), loaded.experts)[0]
    assert logits.argmax(-1).tolist() == expected.argmax
    assert (logits - expected.logits).abs().max().item() <= LOGIT_TOL


def test_rows_decode_each_sequence_as_alone(v4):
    _, loaded = v4
    model, experts = loaded.model, loaded.experts
    prompts = [fixtures.make_prompt(loaded.args.vocab_size, n, seed=n) for n in (9, 14)]
    caches = [model.new_cache() for _ in prompts]
    alone = [model.new_cache() for _ in prompts]
    for prompt, cache, solo in zip(prompts, caches, alone, strict=True):
        model(torch.tensor([prompt]), 0, cache, experts)
        model(torch.tensor([prompt]), 0, solo, experts)
    rows = model.forward_rows([5, 7], caches, experts)
    for b, (token, solo) in enumerate(zip([5, 7], alone, strict=True)):
        assert torch.equal(rows[b], model(torch.tensor([[token]]), solo.length, solo, experts)[0, -1])


class RecordingExperts(ResidentExperts):
    def __init__(self, experts):
        super().__init__(experts)
        self.prefetched: dict[int, list[int]] = {}
        self.acquired: dict[int, list[int]] = {}

    def prefetch(self, layer, expert_ids):
        self.prefetched[layer] = list(expert_ids)

    def acquire(self, layer, expert_ids):
        self.acquired[layer] = list(expert_ids)
        return super().acquire(layer, expert_ids)


def test_hash_routed_layers_prefetch_exactly_the_experts_they_use(v4):
    _, loaded = v4
    experts = RecordingExperts(loaded.experts._experts)
    model, cache = loaded.model, loaded.model.new_cache()
    model(torch.tensor([fixtures.make_prompt(loaded.args.vocab_size, 5)]), 0, cache, experts)
    model(torch.tensor([[42]]), cache.length, cache, experts)
    hashed = [i for i, layer in enumerate(model.layers) if layer.ffn.hashed and i > 0]
    assert hashed  # layer 1 of the fixture: prefetched while layer 0 runs
    for layer in hashed:
        assert sorted(experts.prefetched[layer]) == sorted(experts.acquired[layer])
        assert sorted(experts.acquired[layer]) == sorted(model.layers[layer].ffn.gate.tid2eid[42].tolist())


def test_a_cache_rebuilt_from_its_rows_or_trimmed_continues_as_the_original(v4):
    """What a KV log holds (every position's rows) is the whole state: rebuilt from them, or cut back
    to an earlier length, a cache continues exactly as an uninterrupted one."""
    from engine.v4.cache import V4Cache

    _, loaded = v4
    model, experts = loaded.model, loaded.experts
    ids = fixtures.make_prompt(loaded.args.vocab_size, 41)
    reference = model(torch.tensor([ids]), 0, model.new_cache(), experts)[0]
    cache = model.new_cache()
    cache.keep_rows_from = 0  # as a session whose log lacks them all: every row stays
    model(torch.tensor([ids[:29]]), 0, cache, experts)
    rows = [{k: v.all().clone() for k, v in layer.rows().items()} for layer in cache.layers]
    tail = model(torch.tensor([ids[29:]]), 29, V4Cache.from_rows(loaded.args, rows), experts)[0]
    assert (tail - reference[29:]).abs().max().item() <= LOGIT_TOL
    cache.trim(17)  # inside an open HCA window and between CSA windows
    tail = model(torch.tensor([ids[17:]]), 17, cache, experts)[0]
    assert (tail - reference[17:]).abs().max().item() <= LOGIT_TOL


def test_without_a_log_only_the_windows_rows_stay_and_trimming_before_them_is_refused(v4):
    """No log needs the rows: after a call a layer holds the sliding window's K=V rows and the open
    compressor windows' projections, not one row per position; what follows is still exact (the
    oracle tests above run this way) and a cut back before the held rows says why it cannot."""
    from engine.v4.position_rows import RowsReleased

    _, loaded = v4
    model, v4_args = loaded.model, loaded.args.v4
    cache = model.new_cache()
    model(torch.tensor([fixtures.make_prompt(loaded.args.vocab_size, 45)]), 0, cache, loaded.experts)
    for i, layer in enumerate(cache.layers):
        assert layer.kv.length - layer.kv.base == v4_args.sliding_window - 1
        for state, rate, overlap in ((layer.compressor, v4_args.rate(i), v4_args.is_csa(i)), (layer.indexer, 2, True)):
            if state is not None:
                held = state.kv.length - state.kv.base
                assert held == 45 % rate + overlap * rate and state.entries.shape[1] == 45 // rate
    with pytest.raises(RowsReleased):
        cache.trim(20)
