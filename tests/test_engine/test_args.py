"""Reading config.json: both rope spellings, layer kinds, and clear refusals."""

from __future__ import annotations

import json

import pytest

from engine.args import ConfigError, ModelArgs
from engine.rope import cos_sin_scale, softmax_scale


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
