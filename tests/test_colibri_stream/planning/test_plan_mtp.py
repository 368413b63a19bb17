"""`plan` before the download counts the multi-token-prediction layer DeepSeek-V3/R1's and GLM-5's real
config.json ship (``num_nextn_predict_layers``: 1): one more MoE layer's expert records, and its block,
joining projection and norms in the dense bytes, against hand-computed DeepSeek-V3 numbers; `--no-mtp`
leaves it out; one report line says which."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import pytest

from colibri_stream import cli
from colibri_stream.checkpoint.dtypes import FLOAT32_PARAMETERS
from colibri_stream.planning.geometry import ContainerTarget, dequantised_config, model_geometry
from engine.config.args import ModelArgs
from engine.families import meta_transformer
from tests.test_colibri_stream.planning.test_plan_config import DEEPSEEK_V3 as V3_CONFIG

GIB = 2**30
BANDWIDTH = ["--memory-bandwidth", "40GB", "--disk-bandwidth", "2GB"]

# deepseek-ai/DeepSeek-V3's config.json: the fields the engine reads, FP8 as shipped.
DEEPSEEK_V3: dict[str, Any] = {**V3_CONFIG, "num_nextn_predict_layers": 1}  # as the shipped config.json says
# zai-org/GLM-5's config.json: the fields the engine reads (every layer a full DSA layer, the first 3 dense).
GLM_5: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_nextn_predict_layers": 1,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "vocab_size": 154880,
    "max_position_embeddings": 202752,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-05,
}

# DeepSeek-V3, hand-computed (as test_plan_config.py beside this file): one int4 g64 record, and the MTP
# module's parameters: its block (attention + 2 norms, router weight + bias, one shared expert), the joining
# projection eh_proj [7168, 2 x 7168] and its 3 norms (enorm, hnorm, norm).
RECORD = 3 * 2048 * 7168 // 2 + 3 * 2048 * (7168 // 64) * 2
ATTENTION = 1536 * 7168 + 1536 + 128 * 192 * 1536 + 576 * 7168 + 512 + 128 * 256 * 512 + 7168 * 128 * 128
MTP_PARAMETERS = ATTENTION + 2 * 7168 + 256 * 7168 + 256 + 3 * 7168 * 2048 + 2 * 7168 * 7168 + 3 * 7168
MTP_DENSE_BF16 = 2 * MTP_PARAMETERS + 2 * 256  # the router bias stays float32
MTP_LINE = "multi-token prediction       1 layer for speculative decoding: "
LEFT_OUT_LINE = (
    "multi-token prediction       none: the model ships 1 layer, left out (--no-mtp, or not in the checkpoint); "
    "no speculative decoding"
)


class Memory:
    total = 2048 * GIB
    available = 2000 * GIB


@pytest.fixture(autouse=True)
def memory(monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)


def _config(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / config["model_type"] / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return path


def _plan(capsys, config: Path, *flags: str) -> tuple[dict, list[str]]:
    argv = ["plan", str(config), "--dtype", "bfloat16", "--ram", "64GiB", *BANDWIDTH, *flags]
    assert cli.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert cli.main(argv) == 0
    return report, capsys.readouterr().out.splitlines()


def _one_layer_dense_bf16(config: dict[str, Any]) -> int:
    """What one MTP module adds to the bf16 dense bytes, from the meta-device model: a block like the last
    layer's (a MoE layer, with its indexer where the model has DSA), eh_proj and 3 norms."""
    args = ModelArgs.from_hf_config(dequantised_config(config))
    last = f"layers.{args.n_layers - 1}."
    block = {n: p.numel() for n, p in meta_transformer(args).state_dict().items() if n.startswith(last)}
    assert args.is_moe(args.n_layers - 1) and args.has_indexer(args.n_layers - 1) == args.has_dsa
    held = sum(numel * (4 if name.endswith(FLOAT32_PARAMETERS) else 2) for name, numel in block.items())
    return held + 2 * (2 * args.dim * args.dim + 3 * args.dim)


@pytest.mark.parametrize("config", [DEEPSEEK_V3, GLM_5], ids=["deepseek-v3", "glm-5"])
def test_plan_counts_the_mtp_layer_a_real_config_ships(tmp_path, capsys, config):
    path = _config(tmp_path, config)
    held, held_lines = _plan(capsys, path)
    left_out, left_out_lines = _plan(capsys, path, "--no-mtp")
    record = held["expert_record_bytes"]
    assert held["moe_layers"] == left_out["moe_layers"] + 1 == config["num_hidden_layers"] - 3 + 1
    assert held["expert_bytes"] - left_out["expert_bytes"] == held["mtp_expert_bytes"] == 256 * record
    assert held["dense_bytes"] - left_out["dense_bytes"] == held["mtp_dense_bytes"] == _one_layer_dense_bf16(config)
    assert (held["mtp_layers"], held["mtp_left_out"], left_out["mtp_layers"], left_out["mtp_left_out"]) == (1, 0, 0, 1)
    assert left_out["mtp_dense_bytes"] == left_out["mtp_expert_bytes"] == 0
    # plain decoding does not run the MTP module: bytes per token, KV and the floor are the same
    for same in ("dense_bytes_per_token", "bytes_per_token_at_zero_hits", "kv_bytes_per_token", "minimum_ram_slots"):
        assert held[same] == left_out[same], same
    line = next(text for text in held_lines if text.startswith("multi-token prediction"))
    dense, experts = held["mtp_dense_bytes"] / GIB, held["mtp_expert_bytes"] / GIB
    assert line == f"{MTP_LINE}{dense:.2f} GiB dense + {experts:.2f} GiB routed experts of the sizes above " + (
        "(--no-mtp leaves it out)"
    )
    assert [text for text in left_out_lines if text.startswith("multi-token prediction")] == [LEFT_OUT_LINE]
    # the line sits beside the routed experts it adds to
    assert held_lines[held_lines.index(line) - 1].startswith("routed experts (on disk)")


def test_deepseek_v3s_mtp_layer_against_hand_computed_sizes(tmp_path, capsys):
    held, lines = _plan(capsys, _config(tmp_path, DEEPSEEK_V3))
    assert held["expert_record_bytes"] == RECORD == 23_396_352
    assert held["mtp_expert_bytes"] == 256 * RECORD and held["expert_bytes"] == 59 * 256 * RECORD
    assert held["mtp_dense_bytes"] == MTP_DENSE_BF16 == _one_layer_dense_bf16(DEEPSEEK_V3)
    assert f"{MTP_LINE}0.63 GiB dense + 5.58 GiB routed experts of the sizes above (--no-mtp leaves it out)" in lines


def test_a_config_without_num_nextn_predict_layers_has_no_mtp_line(tmp_path, capsys):
    plain = {k: v for k, v in DEEPSEEK_V3.items() if k != "num_nextn_predict_layers"}
    report, lines = _plan(capsys, _config(tmp_path, plain))
    left_out, _ = _plan(capsys, tmp_path / "deepseek_v3" / "config.json", "--no-mtp")
    assert report["mtp_layers"] == report["mtp_left_out"] == left_out["mtp_left_out"] == 0
    assert not any(text.startswith("multi-token prediction") for text in lines)


def test_int8_dense_stores_the_mtp_modules_matrices_as_int8(tmp_path):
    """stored_dense_dtype by engine name: the MTP module's 2-D weights are int8 like any block's, its norms
    bf16, its router bias and indexer weights_proj float32."""
    geometry = model_geometry(_config(tmp_path, GLM_5), ContainerTarget(dense="int8"))
    dtypes = {a.name: a.dtype for a in geometry.dense if a.name.startswith("mtp.")}
    assert dtypes["mtp.0.eh_proj.weight"] == dtypes["mtp.0.block.attn.wq_a.weight"] == "int8"
    assert dtypes["mtp.0.block.ffn.shared_experts.w1.weight"] == dtypes["mtp.0.block.ffn.gate.weight"] == "int8"
    assert dtypes["mtp.0.enorm.weight"] == dtypes["mtp.0.norm.weight"] == "bfloat16"
    assert dtypes["mtp.0.block.attn_norm.weight"] == dtypes["mtp.0.block.attn.q_norm.weight"] == "bfloat16"
    assert dtypes["mtp.0.block.ffn.gate.bias"] == dtypes["mtp.0.block.attn.indexer.weights_proj.weight"] == "float32"
    last = {a.name.removeprefix("layers.77."): a.dtype for a in geometry.dense if a.name.startswith("layers.77.")}
    assert {name.removeprefix("mtp.0.block."): d for name, d in dtypes.items() if ".block." in name} == last
