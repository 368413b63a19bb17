"""Checkpoints whose routed experts ship quantised by compressed-tensors (built with its own compressor:
colibri_stream/devtools/quantized_fixtures.py): converted without re-quantising, the records hold the
shipped codes and scales byte for byte, and the container runs like transformers on the weights
compressed-tensors dequantises them to. Bad configs and tensors are refused with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from colibri_stream import cli
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools import fixtures
from colibri_stream.devtools import quantized_fixtures as qf
from colibri_stream.errors import USER_ERRORS, CheckpointError, ColibriError
from colibri_stream.experts.codec import record_views
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_container
from engine.kernels.quant import QuantizedExpert, packed_width
from storage.container.reader import Container

PROMPT_LEN, NEW_TOKENS, LOGIT_TOL = 20, 16, 1e-4
PACK, MX = "pack-quantized", "mxfp4-pack-quantized"
# hidden 120 and expert width 36 at group 12: a row of 36 nibbles ships 5 int32 words (20 bytes) where a
# record row holds 18; compressed-tensors refuses a width that is not a multiple of the group, so the
# ragged case (hidden 120 at group 32) cannot be made by it.
ODD = dict(hidden_size=120, moe_intermediate_size=36)
CASES = {"pack": (PACK, 32, None), "mxfp4": (MX, 32, None), "pack-odd": (PACK, 12, ODD)}
KINDS = {"pack": "int4-bf16scale", "mxfp4": "mxfp4", "pack-odd": "int4-bf16scale"}


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_checkpoints):
    """case -> (quantised checkpoint, its converted container, its compressed-tensors-dequantised twin)."""
    root = tmp_path_factory.mktemp("quantized")
    cache: dict[str, tuple[Path, Path, Path]] = {}

    def build(case: str) -> tuple[Path, Path, Path]:
        if case not in cache:
            fmt, group, overrides = CASES[case]
            source = tiny_checkpoints["deepseek_v3"]
            if overrides:
                source = fixtures.build_tiny_checkpoint("deepseek_v3", root / f"{case}-f32", config_overrides=overrides)
            quantized = qf.build_quantized_checkpoint(source, root / f"{case}-ct", fmt, group)
            container = root / f"{case}.cstream"
            Converter(quantized, container, ConvertOptions(dense="f32"), progress=False).run()
            cache[case] = quantized, container, qf.build_dequantized_checkpoint(quantized, root / f"{case}-dequant")
        return cache[case]

    return build


def _record(container: Path, layer: int, expert: int) -> dict[str, torch.Tensor]:
    opened = Container(container)
    data = np.fromfile(opened.expert_path(layer, expert), dtype=np.uint8)[: opened.layout.record_bytes]
    return record_views(opened.layout, data)


@pytest.mark.parametrize("case", ["pack", "mxfp4", "pack-odd"])
def test_records_hold_the_shipped_codes_and_scales(built, case):
    quantized, container, _ = built(case)
    shipped = load_file(quantized / "model.safetensors")
    layout = Container(container).layout
    assert (layout.scheme, layout.group_size) == (KINDS[case], CASES[case][1])
    for layer, expert in [(1, 0), (2, 15)]:
        views = _record(container, layer, expert)
        for matrix, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            base = f"model.layers.{layer}.mlp.experts.{expert}.{proj}"
            packed, scale = shipped[base + ".weight_packed"], shipped[base + ".weight_scale"]
            width = packed_width(layout.in_dim(matrix))
            assert torch.equal(views[f"{matrix}.q"], packed.view(torch.uint8).view(packed.shape[0], -1)[:, :width])
            assert torch.equal(views[f"{matrix}.scale"].view(torch.uint8), scale.view(torch.uint8))


@pytest.mark.parametrize("case", ["pack", "mxfp4", "pack-odd"])
def test_container_runs_like_transformers_on_the_dequantised_source(built, case):
    _, container, dequantised = built(case)
    reference, ours = fixtures.load_reference(dequantised), load_container(container)
    prompt = fixtures.make_prompt(ours.args.vocab_size, PROMPT_LEN)
    expected = fixtures.oracle_greedy(reference, prompt, NEW_TOKENS)
    assert generate(ours.model, prompt, NEW_TOKENS, ours.experts).ids == expected
    forced = fixtures.oracle_teacher_forced(reference, prompt + expected)
    logits = ours.model(torch.tensor([prompt + expected]), 0, ours.model.new_cache(), ours.experts)[0]
    assert (logits - forced.logits).abs().max().item() <= LOGIT_TOL


def _plan_json(capsys, *argv: str) -> dict:
    bandwidths = ["--memory-bandwidth", "40GB", "--disk-bandwidth", "2GB"]  # not measured here
    assert cli.main(["plan", *argv, *bandwidths, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("case", ["pack", "mxfp4"])
def test_plan_sizes_the_quantised_source_at_its_passthrough_kind(built, case, capsys):
    quantized, container, _ = built(case)
    planned = _plan_json(capsys, str(quantized), "--dense", "f32", "--ram", "1GiB")
    assert f"experts {KINDS[case]} g32 (as shipped)" in planned["model"]
    converted = _plan_json(capsys, str(container), "--ram", "1GiB")
    for key in ("expert_record_bytes", "expert_bytes", "dense_bytes"):
        assert planned[key] == converted[key], key


def test_explicit_int4_requantises_the_dequantised_experts_and_runs(built, tmp_path):
    quantized, passthrough, _ = built("pack")
    dst = tmp_path / "int4.cstream"
    Converter(quantized, dst, ConvertOptions(experts="int4", dense="f32"), progress=False).run()
    layout = Container(dst).layout
    assert (layout.scheme, layout.group_size) == ("int4", 64)
    ours = load_container(dst)
    prompt = fixtures.make_prompt(ours.args.vocab_size, PROMPT_LEN)
    assert len(generate(ours.model, prompt, NEW_TOKENS, ours.experts).ids) == NEW_TOKENS
    requantised = ours.experts.acquire(1, [3])[3]
    shipped = load_container(passthrough).experts.acquire(1, [3])[3].w1.dequantize()
    assert isinstance(requantised, QuantizedExpert) and requantised.w1.scales.dtype == torch.float16
    error = ((requantised.w1.dequantize() - shipped).norm() / shipped.norm()).item()
    assert 0 < error < 0.15, error  # a second rounding, at group 64: close, not the same weights


def test_group_size_contradicting_the_source_is_refused_under_auto(built, tmp_path):
    quantized, _, _ = built("pack")
    with pytest.raises(ColibriError, match="--group-size 64 contradicts the source's group size 32"):
        Converter(quantized, tmp_path / "x", ConvertOptions(group_size=64), progress=False)
    assert Converter(quantized, tmp_path / "y", ConvertOptions(group_size=32), progress=False).layout.group_size == 32


# ------------------------------------------------------------------------------------------ refusals


def _refused(source: Path, tmp_path: Path) -> str:
    with pytest.raises(USER_ERRORS) as caught:
        Converter(source, tmp_path / "out.cstream", ConvertOptions(), progress=False)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        (dict(symmetric=False), r"weights.symmetric=False, expected True"),
        (dict(num_bits=8), r"weights.num_bits=8, expected 4"),
    ],
    ids=["asymmetric", "8-bit"],
)
def test_schemes_that_change_the_math_are_refused(tiny_checkpoints, tmp_path, weights, expected):
    source = qf.build_quantized_checkpoint(tiny_checkpoints["deepseek_v3"], tmp_path / "ct", PACK, 32, **weights)
    assert "config.json: quantization_config config_groups.group_0" in (message := _refused(source, tmp_path))
    assert expected in message


def _copy(quantized: Path, dst: Path) -> Path:
    shutil.copytree(quantized, dst)
    return dst


def test_an_unknown_format_is_refused_naming_config_json(built, tmp_path):
    source = _copy(built("pack")[0], tmp_path / "nvfp4")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (source / "config.json").write_text(json.dumps(config))
    message = _refused(source, tmp_path)
    assert "config.json: quantization_config format 'nvfp4-pack-quantized' is not supported" in message


def test_a_packed_tensor_contradicting_weight_shape_is_refused_naming_it(built, tmp_path):
    source = _copy(built("pack")[0], tmp_path / "doctored")
    tensors = load_file(source / "model.safetensors")
    name = "model.layers.2.mlp.experts.7.down_proj.weight_shape"
    tensors[name] = torch.tensor([64, 96], dtype=tensors[name].dtype)  # the packed rows hold 64 columns
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    message = _refused(source, tmp_path)
    assert "tensor model.layers.2.mlp.experts.7.down_proj.weight_packed has shape [64, 8]" in message
    assert "weight_shape [64, 96] at group size 32 needs [64, 12]" in message


def test_the_cli_prints_a_refusal_as_one_line(built, tmp_path, capsys):
    source = _copy(built("pack")[0], tmp_path / "dtype")
    tensors = load_file(source / "model.safetensors")
    name = "model.layers.1.mlp.experts.0.up_proj.weight_packed"
    tensors[name] = tensors[name].view(torch.float32)  # same bytes, a dtype the format does not ship
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    assert cli.main(["convert", str(source), str(tmp_path / "out"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"tensor {name} is F32, expected one of ['I32']" in err


def test_float32_scales_are_refused_under_auto_and_convert_when_requantised(built, tmp_path):
    source = _copy(built("pack")[0], tmp_path / "f32-scales")
    tensors = load_file(source / "model.safetensors")
    tensors = {n: t.float() if n.endswith(".weight_scale") else t for n, t in tensors.items()}
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    assert "scales are F32, which no record kind holds as shipped" in _refused(source, tmp_path)
    Converter(source, tmp_path / "bf16.cstream", ConvertOptions(experts="bf16", dense="f32"), progress=False).run()
    assert Container(tmp_path / "bf16.cstream").layout.scheme == "bf16"


def test_a_config_quantising_activations_is_refused(built, tmp_path):
    source = _copy(built("pack")[0], tmp_path / "w4a8")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="input_activations is set: quantised activations are not supported"):
        Converter(source, tmp_path / "out", ConvertOptions(), progress=False)


def test_running_a_quantised_directory_directly_says_to_convert_it(built):
    from colibri_stream.runtime.loader import load_checkpoint
    from engine.config.checks import ConfigError

    with pytest.raises(ConfigError, match="compressed-tensors.*read by `colibri-stream convert`, not loaded directly"):
        load_checkpoint(built("pack")[0])
