"""Reading config.json: both rope spellings, layer kinds, and clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config.args import ConfigError, ModelArgs
from engine.core.rope import cos_sin_scale, softmax_scale


def _config(tiny_checkpoints, family):
    return json.loads((tiny_checkpoints[family] / "config.json").read_text())


def test_legacy_rope_scaling_and_rope_parameters_read_the_same(tiny_checkpoints):
    modern = _config(tiny_checkpoints, "deepseek_v3")
    legacy = dict(modern)
    rope = dict(legacy.pop("rope_parameters"))
    legacy["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    legacy["rope_scaling"] = rope
    assert ModelArgs.from_hf_config(legacy) == ModelArgs.from_hf_config(modern)


def test_kimi_k2_reads_as_deepseek_v3_with_yarn(tiny_checkpoints):
    args = ModelArgs.from_hf_config(_config(tiny_checkpoints, "kimi_k2"))
    assert args.model_type == "kimi_k2" and not args.has_dsa
    assert args.rope.kind == "yarn" and args.rope.theta == 50000.0 and args.rope.factor == 8.0
    assert args.route_scale == pytest.approx(2.827)


def test_yarn_scales_match_deepseek_formulas(tiny_checkpoints):
    args = ModelArgs.from_hf_config(_config(tiny_checkpoints, "deepseek_v3"))
    mscale = 0.1 * 1.0 * __import__("math").log(8.0) + 1.0
    assert softmax_scale(args) == pytest.approx(args.qk_head_dim**-0.5 * mscale**2)
    assert cos_sin_scale(args.rope) == pytest.approx(1.0)  # mscale == mscale_all_dim


def test_dsa_layer_kinds(tiny_checkpoints):
    glm = ModelArgs.from_hf_config(_config(tiny_checkpoints, "glm_moe_dsa"))
    assert glm.indexer_types == ("full", "shared", "full", "shared")
    assert [glm.has_indexer(i) for i in range(4)] == [True, False, True, False]
    assert glm.indexer_rope_interleave
    v32 = ModelArgs.from_hf_config(_config(tiny_checkpoints, "deepseek_v32"))
    assert all(v32.has_indexer(i) for i in range(v32.n_layers)) and not v32.indexer_rope_interleave
    assert v32.dense_layers == (True, False, False)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope type"),
        ({"n_group": 3}, "n_group"),
        ({"mlp_layer_types": ["dense"]}, "mlp_layer_types"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
    ],
)
def test_unsupported_or_broken_configs_name_the_field(tiny_checkpoints, change, field):
    with pytest.raises(ConfigError, match=field):
        ModelArgs.from_hf_config({**_config(tiny_checkpoints, "deepseek_v3"), **change})


def test_dsa_configs_refuse_a_shared_first_layer(tiny_checkpoints):
    config = _config(tiny_checkpoints, "glm_moe_dsa")
    with pytest.raises(ConfigError, match="indexer_types"):
        ModelArgs.from_hf_config({**config, "indexer_types": ["shared", "full", "full", "full"]})


def test_real_model_configs_pass_validation():
    """transformers' defaults are the released models' shapes (GLM-5: 78 layers, n_group 1; DeepSeek-V3 and
    V3.2: 61 layers, 256 experts in 8 groups, top-4 groups); the demo model is a real glm_moe_dsa."""
    from transformers import DeepseekV3Config, DeepseekV32Config, GlmMoeDsaConfig

    for config_class in (DeepseekV3Config, DeepseekV32Config, GlmMoeDsaConfig):
        config = {**config_class().to_dict(), "model_type": config_class.model_type}
        assert ModelArgs.from_hf_config(config).n_layers in (61, 78)
    demo = json.loads((Path(__file__).resolve().parents[3] / "colibri_stream/demo_model/config.json").read_text())
    assert ModelArgs.from_hf_config(demo).n_routed_experts == 32


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps=inf, expected a finite number > 0"),
        ({"num_hidden_layers": 10**7}, "num_hidden_layers=10000000, expected an integer in [1, 1024]"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers=2.5"),
        ({"routed_scaling_factor": 0}, "routed_scaling_factor=0"),
        ({"n_group": 16, "topk_group": 1}, "n_group=16, expected at most n_routed_experts/2=8"),
        ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 5}, "num_experts_per_tok=5, expected at most"),
        ({"norm_topk_prob": "false"}, "norm_topk_prob='false', expected true or false"),
        ({"qk_rope_head_dim": 15}, "qk_rope_head_dim=15, expected an even number"),
        ({"rope_scaling": "yarn", "rope_parameters": None}, "rope_scaling='yarn', expected an object"),
        ({"first_k_dense_replace": 9}, "first_k_dense_replace=9, expected an integer in [0, 3]"),
    ],
)
def test_values_out_of_range_are_refused_with_key_value_and_expectation(tiny_checkpoints, change, message):
    with pytest.raises(ConfigError) as raised:
        ModelArgs.from_hf_config({**_config(tiny_checkpoints, "deepseek_v3"), **change})
    assert str(raised.value).startswith("config.json: ") and message in str(raised.value)
