"""Kimi-K2.5-style wrapped checkpoints: the text model converts and runs; the vision tower is skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from colibri_stream.checkpoint.wrapped_configs import text_model_config
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint, load_container, read_config
from engine.config.weights import sort_names

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def k25(tmp_path_factory) -> Path:
    return fixtures.build_kimi_k25_checkpoint(tmp_path_factory.mktemp("k25") / "hf")


def _names(checkpoint: Path) -> list[str]:
    with safe_open(checkpoint / "model.safetensors", framework="pt") as f:
        return list(f.keys())


def _prompt() -> list[int]:
    return fixtures.make_prompt(512, 20)


def test_the_fixture_has_the_shipped_layout(k25):
    raw = json.loads((k25 / "config.json").read_text())
    assert raw["model_type"] == "kimi_k25" and "text_config" in raw and "vision_config" in raw
    names = _names(k25)
    assert any(n.startswith("language_model.model.layers.1.mlp.experts.") for n in names)
    assert any(n.startswith("vision_tower.") for n in names)


def test_wrapped_text_model_runs_token_exact_against_transformers(k25, tmp_path):
    expected = fixtures.oracle_greedy(fixtures.load_reference(k25), _prompt(), NEW_TOKENS)
    direct = load_checkpoint(k25)
    assert direct.args.model_type == "deepseek_v3" and direct.args.n_routed_experts == 16
    assert generate(direct.model, _prompt(), NEW_TOKENS, direct.experts).ids == expected
    dst = tmp_path / "c"
    report = Converter(k25, dst, ConvertOptions(experts="f32", dense="f32"), progress=False).run()
    skipped = sum(1 for name in _names(k25) if "vision_tower" in name or "mm_projector" in name)
    assert report["skipped"]["tensors"] == skipped > 0 and "vision_tower" in report["skipped"]["prefixes"]
    container = load_container(dst)
    assert generate(container.model, _prompt(), NEW_TOKENS, container.experts).ids == expected


def test_vision_tensors_are_sorted_as_skipped_only_in_a_wrapped_checkpoint(k25):
    config = read_config(k25)
    names = _names(k25)
    sorted_names = sort_names(names, config["num_hidden_layers"])
    assert sorted_names.skipped and all("vision_tower" in n or "mm_projector" in n for n in sorted_names.skipped)
    assert sorted_names.unmapped == []
    plain = sort_names(["model.embed_tokens.weight", "vision_tower.encoder.x.weight"], 3)
    assert plain.unmapped == ["vision_tower.encoder.x.weight"] and plain.skipped == []


def test_wrapper_config_carries_quantisation_and_tying_and_refuses_a_missing_text_config():
    text = text_model_config(
        {
            "model_type": "kimi_k25",
            "text_config": {"model_type": "kimi_k2", "hidden_size": 8},
            "tie_word_embeddings": False,
            "quantization_config": {"quant_method": "compressed-tensors"},
        }
    )
    assert text == {
        "model_type": "kimi_k2",
        "hidden_size": 8,
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "compressed-tensors"},
    }
    from colibri_stream.errors import CheckpointError

    with pytest.raises(CheckpointError, match="kimi_k25 needs a text_config object"):
        text_model_config({"model_type": "kimi_k25", "text_config": "x"})


def test_plan_of_a_wrapped_config_sizes_its_text_model(k25, capsys):
    from colibri_stream import cli

    bandwidths = ["--memory-bandwidth", "40GB", "--disk-bandwidth", "2GB"]  # not measured here
    for target in (k25, k25 / "config.json"):
        assert cli.main(["plan", str(target), *bandwidths, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert (plan["moe_layers"], plan["experts_per_layer"], plan["experts_per_token"]) == (2, 16, 4)
