"""`plan` before the download: a bare config.json or a checkpoint directory, sized as `convert` would write
it, against hand-computed DeepSeek-V3 numbers; the same numbers as the converted container; the
verdict line and the refusals, with bandwidths and memory injected."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import psutil
import pytest

from colibri_stream import cli
from colibri_stream.errors import BudgetError
from colibri_stream.planning.bandwidth import Bandwidth
from colibri_stream.planning.geometry import ContainerTarget, model_geometry
from colibri_stream.planning.placement import check_fits, expected_speed, plan, verdict
from storage.container.reader import Container
from storage.tiers.config import StoreConfig
from storage.tiers.tiered import minimum_slots

GIB = 2**30

# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3), the fields the engine reads, FP8 as shipped.
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}

# Hand-computed. One int4 g64 record (storage/container/layout.py): gate/up/down nibbles, then float16 group scales.
NIBBLES = 2048 * 7168 // 2  # each of w1 [2048, 7168], w3 [2048, 7168], w2 [7168, 2048]: 7,340,032 B
SCALES = 2048 * (7168 // 64) * 2  # w1, w3: [2048, 112] float16 = 458,752 B; w2 [7168, 32] is the same
RECORD = 3 * NIBBLES + 3 * SCALES  # 23,396,352 B: every field 64-aligned already, a multiple of 4 KiB
assert RECORD == 23_396_352 and RECORD % 4096 == 0
EXPERT_BYTES = 58 * 256 * RECORD  # 61 layers, the first 3 dense
KV_PER_TOKEN_BF16 = 61 * (512 + 64) * 2  # latent + roped key per layer, bfloat16
# Dense parameters, counted: attention per layer (wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo) + 2 norms,
# 3 dense MLPs, per MoE layer the router (weight + bias) and one shared expert, embedding + head + norm.
ATTENTION = 1536 * 7168 + 1536 + 128 * 192 * 1536 + 576 * 7168 + 512 + 128 * 256 * 512 + 7168 * 128 * 128
LAYER = ATTENTION + 2 * 7168
MOE = 256 * 7168 + 256 + 3 * 7168 * 2048
EMBEDDING = 129280 * 7168
DENSE_PARAMETERS = 61 * LAYER + 3 * 3 * 7168 * 18432 + 58 * MOE + 2 * EMBEDDING + 7168
assert DENSE_PARAMETERS == 17_117_648_384
DENSE_BYTES_BF16 = 2 * DENSE_PARAMETERS + 2 * 58 * 256  # the router bias stays float32
DENSE_PER_TOKEN_BF16 = DENSE_BYTES_BF16 - 2 * EMBEDDING + 2 * 7168  # one embedding row, not the table

BANDWIDTH = ["--memory-bandwidth", "40GB", "--disk-bandwidth", "2GB"]


class Memory:
    total = 512 * GIB
    available = 500 * GIB


@pytest.fixture
def memory(monkeypatch):
    """psutil.virtual_memory() as a machine of 512 GiB with 500 available; tests change it."""
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    monkeypatch.setattr(Memory, "total", 512 * GIB)
    monkeypatch.setattr(Memory, "available", 500 * GIB)
    return Memory


@pytest.fixture
def v3_config(tmp_path) -> Path:
    path = tmp_path / "deepseek-v3" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(DEEPSEEK_V3))
    return path


def plan_json(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_deepseek_v3_config_json_against_hand_computed_sizes(v3_config, memory, capsys):
    code, p = plan_json(capsys, str(v3_config), "--dtype", "bfloat16", "--ram", "64GiB", *BANDWIDTH)
    assert code == 0
    assert p["expert_record_bytes"] == RECORD and p["expert_bytes"] == EXPERT_BYTES
    assert (p["moe_layers"], p["experts_per_layer"], p["experts_per_token"]) == (58, 256, 8)
    assert p["kv_bytes_per_token"] == KV_PER_TOKEN_BF16
    assert p["kv_bytes_at_max_context"] == KV_PER_TOKEN_BF16 * 163840
    assert p["dense_bytes"] == DENSE_BYTES_BF16 and p["dense_bytes_per_token"] == DENSE_PER_TOKEN_BF16
    assert p["ram_slots"] == 64 * GIB // RECORD and p["minimum_ram_slots"] == 8  # the floor: top-k records
    assert p["bytes_per_token_at_zero_hits"] == 58 * 8 * RECORD
    touched = DENSE_PER_TOKEN_BF16 + 58 * 8 * RECORD
    assert p["speed"]["high_tok_per_s"] == pytest.approx(40e9 / touched)
    assert p["speed"]["low_tok_per_s"] == pytest.approx(1 / (58 * 8 * RECORD / 2e9 + touched / 40e9))
    assert p["model"].startswith("fp8 checkpoint, as converted: experts int4 g64, dense bf16")
    assert p["fits"] and p["verdict"] == f"fits with {100 * (64 * GIB // RECORD) // (58 * 256)}% of experts cached"
    # The directory holding only config.json is the same model.
    code, same = plan_json(capsys, str(v3_config.parent), "--dtype", "bfloat16", "--ram", "64GiB", *BANDWIDTH)
    assert code == 0 and same == p


def test_expert_scheme_and_group_size_change_the_record(v3_config, memory, capsys):
    _, int8 = plan_json(capsys, str(v3_config), "--experts", "int8", "--group-size", "128", *BANDWIDTH)
    assert int8["expert_record_bytes"] == 3 * 2048 * 7168 + 3 * 2048 * 7168 // 128 * 2  # already 4 KiB aligned
    _, bf16 = plan_json(capsys, str(v3_config), "--experts", "bf16", *BANDWIDTH)
    assert bf16["expert_record_bytes"] == 3 * 2048 * 7168 * 2
    _, f32 = plan_json(capsys, str(v3_config), "--dense", "f32", "--dtype", "bfloat16", *BANDWIDTH)
    assert f32["dense_bytes"] == DENSE_BYTES_BF16  # stored float32, held in the compute dtype


@pytest.mark.parametrize(
    "family, experts, dense",
    [("deepseek_v3", "int4", "f32"), ("glm_moe_dsa", "int8", "bf16"), ("kimi_k2", "bf16", "int8")],
)
def test_a_checkpoint_directory_plans_like_its_container(
    tiny_checkpoints, make_container, memory, capsys, family, experts, dense
):
    container = make_container(family, experts, dense)
    common = ["--ram", "60%", "--vram", "10%", "--dtype", "float32", *BANDWIDTH]
    target = ["--experts", experts, "--dense", dense]
    code_hf, hf = plan_json(capsys, str(tiny_checkpoints[family]), *common, *target)
    code_c, converted = plan_json(capsys, str(container), *common)
    assert code_hf == code_c == 0
    # The floor from the container (storage's rule) and from the config (geometry.config_floor) agree.
    assert converted["minimum_ram_slots"] == minimum_slots(Container(container)) == hf["experts_per_token"]
    ignore = {"model", "verdict", "fits"}
    assert {k: v for k, v in hf.items() if k not in ignore} == {k: v for k, v in converted.items() if k not in ignore}


def test_geometry_of_a_checkpoint_matches_its_container(tiny_checkpoints, make_container):
    container = model_geometry(make_container("deepseek_v3", "int4", "f32"))
    checkpoint = model_geometry(tiny_checkpoints["deepseek_v3"], ContainerTarget(dense="f32"))
    assert (checkpoint.kind, container.kind) == ("checkpoint", "container")
    assert sorted(checkpoint.dense, key=lambda a: a.name) == sorted(container.dense, key=lambda a: a.name)
    assert checkpoint.layout == container.layout and checkpoint.total_records == container.total_records


# ----------------------------------------------------------------------------------- verdicts


def test_the_verdict_line_fits_partial_and_does_not_fit(v3_config, memory, capsys):
    memory.available = 2000 * GIB
    memory.total = 2048 * GIB
    code, everything = plan_json(capsys, str(v3_config), "--dtype", "bfloat16", "--ram", "400GiB", *BANDWIDTH)
    assert code == 0 and everything["verdict"] == "fits" and everything["cached_fraction"] == 1.0
    code, split = plan_json(
        capsys, str(v3_config), "--dtype", "bfloat16", "--ram", "100GiB", "--vram", "20GiB", *BANDWIDTH
    )
    slots = 100 * GIB // RECORD + 20 * GIB // RECORD
    assert code == 0 and split["verdict"] == f"fits with {100 * slots // (58 * 256)}% of experts cached"
    memory.available = 32 * GIB
    memory.total = 32 * GIB
    code = cli.main(["plan", str(v3_config), "--dtype", "bfloat16", *BANDWIDTH])
    out, err = capsys.readouterr()
    assert code == 1
    line = out.splitlines()[-1]
    assert line.startswith("does not fit: RAM available 32.00 GiB < dense 31.88 GiB + KV 10.72 GiB at 163840 tokens")
    assert "the floor of 8 expert records 0.17 GiB" in line and line.removeprefix("does not fit: ") in err


def test_plan_prints_the_expected_speed_and_the_verdict_last(v3_config, memory, capsys):
    assert cli.main(["plan", str(v3_config), "--ram", "64GiB", "--dtype", "bfloat16", *BANDWIDTH]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("expected decode") and "tok/s" in line and "given" in line for line in lines)
    assert lines[-1].startswith("fits with ")


def test_check_fits_refuses_below_the_floor_with_the_numbers(v3_config, memory):
    geometry = model_geometry(v3_config)
    placement = plan(geometry, StoreConfig(ram_bytes=3 * RECORD), "bfloat16")
    assert not verdict(placement).fits
    below_floor = r"holds 3 expert records; the minimum is 8 \(one token's routed experts: 0.17 GiB\)"
    with pytest.raises(BudgetError, match=below_floor):
        check_fits(placement)


def test_the_speed_range_formula():
    from colibri_stream.planning.placement import Placement

    fields = {f.name: 0 for f in dataclasses.fields(Placement)}
    placement = Placement(**{**fields, "dense_bytes_per_token": 6e9, "bytes_per_token_at_zero_hits": 4e9})
    speed = expected_speed(placement, Bandwidth(memory_bytes_per_s=50e9, disk_bytes_per_s=2e9, disk_method="given"))
    assert speed.high_tok_per_s == pytest.approx(5.0)  # 10 GB touched at 50 GB/s
    assert speed.low_tok_per_s == pytest.approx(1 / 2.2)  # + 4 GB from disk at 2 GB/s


# ----------------------------------------------------------------------------------- auto and budget files


def test_auto_refuses_when_memavailable_cannot_hold_the_floor(v3_config, memory, capsys):
    memory.available = 40 * GIB
    code = cli.main(["plan", str(v3_config), "--ram", "auto", "--dtype", "bfloat16", *BANDWIDTH])
    err = capsys.readouterr().err
    assert code == 1
    assert "RAM available 40.00 GiB < dense 31.88 GiB + KV 10.72 GiB at 163840 tokens + prefill" in err
    assert "+ the floor of 8 expert records 0.17 GiB = " in err


def test_auto_keeps_the_floor_when_only_the_margin_is_short(v3_config, memory, capsys):
    activations = plan(model_geometry(v3_config), StoreConfig(ram_bytes=0), "bfloat16").activation_bytes
    needed = DENSE_BYTES_BF16 + KV_PER_TOKEN_BF16 * 163840 + activations + 8 * RECORD
    memory.available = needed + RECORD // 2  # the floor fits; 10% of what is left would not hold it
    code, p = plan_json(capsys, str(v3_config), "--ram", "auto", "--dtype", "bfloat16", *BANDWIDTH)
    assert code == 0 and p["ram_slots"] == 8 and p["verdict"] == "fits with <1% of experts cached"


def test_a_budget_file_is_capped_at_memavailable(v3_config, memory, capsys, tmp_path):
    budget = tmp_path / "big.toml"
    budget.write_text('[memory]\nram = "200GiB"\n')
    memory.available = 100 * GIB
    code, p = plan_json(capsys, str(v3_config), "--budget", str(budget), "--dtype", "bfloat16", *BANDWIDTH)
    activations = p["activation_bytes"]
    auto = int((100 * GIB - DENSE_BYTES_BF16 - KV_PER_TOKEN_BF16 * 163840 - activations) * 0.9)
    assert code == 0 and p["ram_budget_bytes"] == auto
    memory.available = 40 * GIB
    assert cli.main(["plan", str(v3_config), "--budget", str(budget), "--dtype", "bfloat16", *BANDWIDTH]) == 1
    assert "RAM available 40.00 GiB" in capsys.readouterr().err


def test_doctor_gives_plans_verdict_line(v3_config, memory, capsys):
    _, p = plan_json(capsys, str(v3_config), "--ram", "64GiB", "--dtype", "bfloat16", *BANDWIDTH)
    assert cli.main(["doctor", str(v3_config), "--ram", "64GiB", "--dtype", "bfloat16", "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    budget = next(c for c in report["checks"] if c["name"] == "budget")
    assert budget["detail"].startswith(p["verdict"] + ": dense")
    memory.available = 32 * GIB
    assert cli.main(["doctor", str(v3_config), "--dtype", "bfloat16"]) == 1
    out = capsys.readouterr().out
    assert "NOT READY: budget: does not fit: RAM available 32.00 GiB" in out.splitlines()[-1]


def test_not_a_model(tmp_path, capsys):
    assert cli.main(["plan", str(tmp_path), *BANDWIDTH]) == 1
    assert "neither a container, a checkpoint directory nor a config.json" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- --context


KV_PER_TOKEN_F32 = 61 * (512 + 64) * 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deepseek_v3_at_a_32k_context_on_a_64gb_machine(v3_config, memory, capsys, dtype):
    """KV sized for the 32768 tokens asked, not the model's 163,840; prefill activations under 2 GiB (the
    key-blocked prefill: the whole-cache expanded path needed 4.3 GiB here, 20 GiB at 163,840)."""
    memory.total, memory.available = 64 * 10**9, int(0.9 * 64 * 10**9)
    argv = [str(v3_config), "--context", "32768", "--ram", "16GiB", "--dtype", dtype, *BANDWIDTH]
    code, p = plan_json(capsys, *argv)
    kv_per_token = KV_PER_TOKEN_F32 if dtype == "float32" else KV_PER_TOKEN_BF16
    assert p["max_context"] == 32768 and p["kv_bytes_at_max_context"] == kv_per_token * 32768
    assert 0 < p["activation_bytes"] <= 2 * GIB
    if dtype == "bfloat16":  # float32's dense part depends on this CPU's bf16 kernel
        assert code == 0 and p["fits"] and p["ram_budget_bytes"] == 16 * GIB
        assert p["expected_peak_rss_bytes"] < 64 * 10**9
    _, full = plan_json(capsys, str(v3_config), "--ram", "16GiB", "--dtype", dtype, *BANDWIDTH)
    assert full["max_context"] == 163840 and full["kv_bytes_at_max_context"] == kv_per_token * 163840
    assert full["activation_bytes"] <= 2 * GIB  # bounded whatever the context


def test_a_context_beyond_the_models_is_refused_in_one_line(v3_config, memory, capsys):
    assert cli.main(["plan", str(v3_config), "--context", "163841", *BANDWIDTH]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "colibri-stream plan: error: --context 163841 is longer than this model's context: "
        "max_position_embeddings is 163840"
    )


def test_a_budget_files_kv_context_sizes_the_plan_and_the_flag_wins(v3_config, memory, capsys, tmp_path):
    budget = tmp_path / "long.toml"
    budget.write_text('[memory]\nram = "16GiB"\n[kv]\ncontext = 4096\n')
    _, p = plan_json(capsys, str(v3_config), "--budget", str(budget), "--dtype", "bfloat16", *BANDWIDTH)
    assert p["max_context"] == 4096 and p["kv_bytes_at_max_context"] == KV_PER_TOKEN_BF16 * 4096
    flagged = [str(v3_config), "--budget", str(budget), "--context", "8192", "--dtype", "bfloat16", *BANDWIDTH]
    assert plan_json(capsys, *flagged)[1]["max_context"] == 8192
    for text, message in [
        ("[kv]\ncontext = 0\n", "kv.context must be >= 1"),
        ("[kv]\ncontext = 200000\n", "kv.context 200000 is longer than this model's context"),
        ("[kv]\ncontxt = 4096\n", "unknown key kv.contxt (did you mean kv.context?)"),
        ('[kv]\ncontext = "4096"\n', "kv.context must be int"),
    ]:
        budget.write_text(text)
        assert cli.main(["plan", str(v3_config), "--budget", str(budget), *BANDWIDTH]) == 1
        assert message in capsys.readouterr().err
