"""The engine against transformers on every family of the Foundation fixtures, float32."""

from __future__ import annotations

import pytest
import torch

from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint

PROMPT_LEN = 20  # longer than index_topk (8): DSA selects from the first decode step on
NEW_TOKENS = 32
LOGIT_TOL = 1e-4


def _prompt(loaded) -> list[int]:
    return fixtures.make_prompt(loaded.args.vocab_size, PROMPT_LEN)


def test_greedy_tokens_equal_transformers(loaded, reference):
    prompt = _prompt(loaded)
    expected = fixtures.oracle_greedy(reference, prompt, NEW_TOKENS)
    assert generate(loaded.model, prompt, NEW_TOKENS, loaded.experts).ids == expected


@pytest.mark.parametrize("absorb", [False, True], ids=["expanded", "absorbed"])
def test_teacher_forced_logits_equal_transformers(loaded, reference, absorb):
    ids = _prompt(loaded) + fixtures.oracle_greedy(reference, _prompt(loaded), NEW_TOKENS)
    expected = fixtures.oracle_teacher_forced(reference, ids)
    logits = loaded.model(torch.tensor([ids]), 0, loaded.model.new_cache(), loaded.experts, absorb=absorb)[0]
    assert logits.argmax(-1).tolist() == expected.argmax
    assert (logits - expected.logits).abs().max().item() <= LOGIT_TOL


def test_decoded_logits_equal_transformers_at_every_step(loaded, reference):
    """Token-by-token decode (absorbed path, DSA gather) against the teacher-forced oracle."""
    prompt = _prompt(loaded)
    ids = prompt + fixtures.oracle_greedy(reference, prompt, NEW_TOKENS)
    expected = fixtures.oracle_teacher_forced(reference, ids).logits
    cache = loaded.model.new_cache()
    first = loaded.model(torch.tensor([prompt]), 0, cache, loaded.experts)[0, -1]
    steps = [first] + [
        loaded.model(torch.tensor([[token]]), cache.length, cache, loaded.experts)[0, -1]
        for token in ids[PROMPT_LEN:-1]
    ]
    assert (torch.stack(steps) - expected[PROMPT_LEN - 1 : -1]).abs().max().item() <= LOGIT_TOL


@pytest.mark.parametrize(
    "overrides",
    [{"q_lora_rank": None}, {"rope_interleave": False}],
    ids=["no-q-lora", "half-split-rope"],
)
def test_deepseek_v3_variants_equal_transformers(tmp_path, overrides):
    path = fixtures.build_tiny_checkpoint("deepseek_v3", tmp_path / "variant", config_overrides=overrides)
    reference, loaded = fixtures.load_reference(path), load_checkpoint(path)
    prompt = fixtures.make_prompt(loaded.args.vocab_size, PROMPT_LEN)
    expected = fixtures.oracle_greedy(reference, prompt, 16)
    assert generate(loaded.model, prompt, 16, loaded.experts).ids == expected
    forced = fixtures.oracle_teacher_forced(reference, prompt + expected)
    logits = loaded.model(torch.tensor([prompt + expected]), 0, loaded.model.new_cache(), loaded.experts)[0]
    assert (logits - forced.logits).abs().max().item() <= LOGIT_TOL
