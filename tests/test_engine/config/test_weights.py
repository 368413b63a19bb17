"""The strict HF -> engine weight mapping: every tensor consumed, none missing."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from colibri_stream.runtime.loader import CheckpointError, load_checkpoint
from engine.config.weights import WeightNameError, engine_name, routed_expert_key, sort_names


def _copy_with(tmp_path, source, edit):
    dst = tmp_path / "edited"
    shutil.copytree(source, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_name_table_examples():
    assert engine_name("model.layers.3.self_attn.kv_b_proj.weight") == "layers.3.attn.wkv_b.weight"
    assert engine_name("model.layers.0.mlp.gate.e_score_correction_bias") == "layers.0.ffn.gate.bias"
    assert engine_name("model.layers.2.self_attn.indexer.k_norm.bias") == "layers.2.attn.indexer.k_norm.bias"
    assert engine_name("model.layers.1.mlp.experts.5.up_proj.weight") is None
    assert routed_expert_key("model.layers.1.mlp.experts.5.up_proj.weight") == (1, 5, "w3")


def test_unknown_tensor_is_refused_by_name(tmp_path, tiny_checkpoints):
    path = _copy_with(tmp_path, tiny_checkpoints["deepseek_v3"], lambda t: t.update({"model.surprise": torch.ones(2)}))
    with pytest.raises(WeightNameError, match="model.surprise"):
        load_checkpoint(path)


def test_missing_tensor_is_refused_by_name(tmp_path, tiny_checkpoints):
    path = _copy_with(
        tmp_path,
        tiny_checkpoints["deepseek_v32"],
        lambda t: t.pop("model.layers.1.self_attn.indexer.wk.weight"),
    )
    with pytest.raises(WeightNameError, match=r"layers\.1\.attn\.indexer\.wk\.weight"):
        load_checkpoint(path)


def test_missing_routed_expert_is_refused(tmp_path, tiny_checkpoints):
    path = _copy_with(
        tmp_path,
        tiny_checkpoints["deepseek_v3"],
        lambda t: t.pop("model.layers.2.mlp.experts.7.down_proj.weight"),
    )
    with pytest.raises(CheckpointError, match="layer 2 expert 7 lacks"):
        load_checkpoint(path)


def test_a_broken_multi_token_prediction_layer_is_refused_naming_the_tensor(tmp_path, tiny_checkpoints):
    """DeepSeek-V3 ships an MTP layer as model.layers.<num_hidden_layers>: it is loaded (engine/mla/mtp.py), so a
    wrong one is an error naming the tensor; ``sort_names(mtp=False)`` (convert --no-mtp) leaves it out."""
    source = tiny_checkpoints["deepseek_v3"]

    def add_mtp(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.2.")]:
            tensors[name.replace("model.layers.2.", "model.layers.3.")] = tensors[name].clone()
        tensors["model.layers.3.eh_proj.weight"] = torch.ones(4, 4)

    broken = _copy_with(tmp_path, source, add_mtp)
    with pytest.raises(WeightNameError, match=r"parameter\(s\) missing, e\.g\. \['mtp\.0\.enorm\.weight'"):
        load_checkpoint(broken)
    names = sort_names(["model.layers.3.eh_proj.weight", "model.layers.3.mlp.experts.0.up_proj.weight"], 3, mtp=False)
    assert names.mtp_layers == 0 and not names.dense and not names.routed and len(names.left_out) == 2


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: not found"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        load_checkpoint(tmp_path)
