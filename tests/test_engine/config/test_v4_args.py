"""DeepSeek-V4 config.json parsing: both spellings, and a clear error for what we do not run."""

from __future__ import annotations

import json

import pytest

from colibri_stream.devtools import fixtures
from engine.config.args import ConfigError, ModelArgs
from engine.config.v4_args import CSA, HCA, SLIDING


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> dict:
    path = fixtures.build_tiny_checkpoint("deepseek_v4", tmp_path_factory.mktemp("v4args") / "m")
    return json.loads((path / "config.json").read_text())


def test_the_fixture_config_reads_as_v4(config):
    args = ModelArgs.from_hf_config(config)
    v4 = args.v4
    assert v4.layer_types == (HCA, CSA, SLIDING, CSA)
    assert [v4.rate(i) for i in range(4)] == [8, 2, 0, 2]
    assert v4.hash_layers == (True, True, False, False)
    assert (v4.head_dim, v4.rope_dim, v4.hc_mult, v4.sliding_window) == (40, 8, 3, 6)
    assert args.moe_layers == (0, 1, 2, 3) and args.norm_topk_prob
    assert args.rope.theta == 10000.0 and args.rope.kind == "default"
    assert args.compress_rope.theta == 160000.0 and args.compress_rope.kind == "yarn"
    assert args.compress_rope.attention_factor == 1.0  # V4 never scales cos/sin by yarn's mscale


def test_defaults_follow_transformers(config):
    for key in ("layer_types", "mlp_layer_types", "compress_rates"):
        config = {k: v for k, v in config.items() if k != key}
    v4 = ModelArgs.from_hf_config({**config, "num_hidden_layers": 5}).v4
    assert v4.layer_types == (HCA, HCA, HCA, CSA, HCA)
    assert v4.hash_layers == (True, True, True, False, False)
    assert (v4.csa_rate, v4.hca_rate) == (4, 128)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"o_groups": 3}, "o_groups"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"compress_ratios": [0, 3, 0, 0], "layer_types": None}, "compress_ratios"),
        ({"mlp_layer_types": ["dense"] * 4}, "mlp_layer_types"),
        ({"index_head_dim": 4}, "index_head_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"compress_rates": {"compressed_sparse_attention": 0}}, "compress_rates"),
    ],
)
def test_bad_values_are_refused_naming_the_key(config, change, named):
    with pytest.raises(ConfigError, match=named):
        ModelArgs.from_hf_config({**config, **change})
