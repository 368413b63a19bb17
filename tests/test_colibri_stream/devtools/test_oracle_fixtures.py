"""Self-checks of the oracle fixtures: later issues can only trust comparisons against tie-free,
really-selecting references."""

from __future__ import annotations

import json

import torch

from colibri_stream.devtools import fixtures

PROMPT_LEN = 20
NEW_TOKENS = 32


def _prompt(reference) -> list[int]:
    return fixtures.make_prompt(reference.config.vocab_size, PROMPT_LEN)


def test_cached_greedy_equals_uncached_equals_teacher_forced(reference):
    prompt = _prompt(reference)
    cached = fixtures.oracle_greedy(reference, prompt, NEW_TOKENS, use_cache=True)
    uncached = fixtures.oracle_greedy(reference, prompt, NEW_TOKENS, use_cache=False)
    forced = fixtures.oracle_teacher_forced(reference, prompt + cached)

    assert len(cached) == NEW_TOKENS
    assert cached == uncached
    assert forced.argmax[PROMPT_LEN - 1 : -1] == cached
    assert forced.logits.dtype == torch.float32
    assert forced.logits.shape == (PROMPT_LEN + NEW_TOKENS, reference.config.vocab_size)


def test_fixture_is_tie_free(reference):
    """The top-1/top-2 logit gap must dwarf the 1e-4 tolerance later issues compare logits with."""
    prompt = _prompt(reference)
    forced = fixtures.oracle_teacher_forced(reference, prompt + fixtures.oracle_greedy(reference, prompt, NEW_TOKENS))
    top2 = forced.logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min().item() > 1e-3


def test_greedy_output_is_not_degenerate(reference):
    tokens = fixtures.oracle_greedy(reference, _prompt(reference), NEW_TOKENS)
    assert len(set(tokens)) > NEW_TOKENS // 2


def test_dsa_fixtures_really_select(tiny_checkpoints):
    for family in ("deepseek_v32", "glm_moe_dsa"):
        path = tiny_checkpoints[family]
        config = json.loads((path / "config.json").read_text())
        ids = fixtures.make_prompt(config["vocab_size"], 3 * config["index_topk"])
        sparse = fixtures.oracle_teacher_forced(fixtures.load_reference(path), ids).logits
        dense = fixtures.oracle_teacher_forced(fixtures.load_reference(path, index_topk=10**6), ids).logits
        k = config["index_topk"]
        # Up to index_topk tokens of context the indexer keeps everything: identical logits.
        torch.testing.assert_close(sparse[:k], dense[:k], rtol=0, atol=1e-5)
        assert (sparse[k:] - dense[k:]).abs().max().item() > 1e-2, family


def test_glm_fixture_mixes_full_and_shared_indexer_layers(tiny_checkpoints):
    config = json.loads((tiny_checkpoints["glm_moe_dsa"] / "config.json").read_text())
    assert set(config["indexer_types"]) == {"full", "shared"}


def test_kimi_k2_fixture_ships_legacy_yarn_and_the_oracle_reads_it(tiny_checkpoints):
    path = tiny_checkpoints["kimi_k2"]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "kimi_k2"
    assert "rope_parameters" not in config
    assert config["rope_scaling"]["type"] == "yarn" and config["rope_theta"] == 50000.0
    rope = fixtures.load_reference(path).config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == config["rope_scaling"]["factor"]
    assert rope["rope_theta"] == 50000.0


def test_deepseek_v3_fixture_has_grouped_routing_and_yarn(tiny_checkpoints):
    config = json.loads((tiny_checkpoints["deepseek_v3"] / "config.json").read_text())
    assert config["n_group"] > 1 and 1 <= config["topk_group"] < config["n_group"]
    assert config["rope_parameters"]["rope_type"] == "yarn"


def test_checkpoints_are_float32_and_deterministic(tmp_path, tiny_checkpoints):
    from safetensors.torch import load_file

    rebuilt = fixtures.build_tiny_checkpoint("deepseek_v3", tmp_path / "again")
    first = load_file(tiny_checkpoints["deepseek_v3"] / "model.safetensors")
    second = load_file(rebuilt / "model.safetensors")
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, second[name]), name


def test_router_correction_bias_is_not_zero(tiny_checkpoints):
    """A zero bias would let a router that ignores it pass every comparison."""
    from safetensors.torch import load_file

    for family, path in tiny_checkpoints.items():
        tensors = load_file(path / "model.safetensors").items()
        biases = [t for k, t in tensors if k.endswith(("e_score_correction_bias", ".ffn.gate.bias"))]  # V3 / V4 names
        assert biases and all(b.abs().min().item() > 0 for b in biases), family
