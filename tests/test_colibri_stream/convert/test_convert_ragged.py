"""Any tensor geometry converts at the default group size: widths the group does not divide (the last
group of a row is partial and has its own scale) and odd widths (a row ends in a padding nibble)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_container
from engine.kernels.quant import quantized_matrix
from storage.container.verify import verify_container

NEW_TOKENS = 16
# The shape: hidden 120, expert width 40 (the default group 64 divides neither), and an odd one.
GEOMETRIES = {
    "h120-e40": dict(hidden_size=120, moe_intermediate_size=40, intermediate_size=88),
    "h120-e41": dict(hidden_size=120, moe_intermediate_size=41, intermediate_size=90),
}


@pytest.fixture(scope="module", params=list(GEOMETRIES))
def ragged(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    return fixtures.build_tiny_checkpoint("deepseek_v3", root / "hf", config_overrides=GEOMETRIES[request.param])


def _reference(path: Path):
    """transformers' eager experts: its grouped_mm kernel needs 16-byte row strides (width 41 fails
    there with "strides should be multiple of 16 bytes"); eager is the same math, one expert at a time."""
    return fixtures.load_reference(path, experts_implementation="eager")


def _convert(src: Path, dst: Path, experts: str, dense: str) -> Path:
    Converter(src, dst, ConvertOptions(experts=experts, dense=dense), progress=False).run()
    assert verify_container(dst) == []
    return dst


def _prompt() -> list[int]:
    return fixtures.make_prompt(512, 20)


def test_lossless_container_of_a_ragged_model_is_token_exact(ragged, tmp_path):
    loaded = load_container(_convert(ragged, tmp_path / "f32", "f32", "f32"))
    expected = fixtures.oracle_greedy(_reference(ragged), _prompt(), NEW_TOKENS)
    assert generate(loaded.model, _prompt(), NEW_TOKENS, loaded.experts).ids == expected


def test_int4_container_at_the_default_group_runs_the_int4_model(ragged, tmp_path):
    """Converted at the default group size (64 divides no width here): transformers on the container's
    dequantised experts == our run, tokens and float32 logits."""
    loaded = load_container(_convert(ragged, tmp_path / "int4", "int4", "f32"))
    reference = _reference(fixtures.dequantised_experts_checkpoint(loaded, ragged, tmp_path / "deq"))
    expected = fixtures.oracle_greedy(reference, _prompt(), NEW_TOKENS)
    assert generate(loaded.model, _prompt(), NEW_TOKENS, loaded.experts).ids == expected
    forced = fixtures.oracle_teacher_forced(reference, _prompt() + expected)
    logits = loaded.model(torch.tensor([_prompt() + expected]), 0, loaded.model.new_cache(), loaded.experts)[0]
    assert (logits - forced.logits).abs().max().item() <= 1e-4


def test_int8_dense_weights_of_any_width_are_quantised_and_load(ragged, tmp_path):
    dst = _convert(ragged, tmp_path / "int8", "int8", "int8")
    attrs = json.loads((dst / "zarr.json").read_text())["attributes"]["colibri"]
    q_b = attrs["dense"]["layers.0.attn.wq_b.weight"]  # input width q_lora_rank 48: one partial group
    assert q_b["dtype"] == "int8" and q_b["group_size"] == 64 and q_b["scales"]["shape"][1] == 1
    source = load_file(ragged / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]  # width 88 / 90
    loaded = load_container(dst)
    held = loaded.model.state_dict()["layers.0.ffn.w2.weight"]
    assert torch.equal(held, quantized_matrix(source, 8, 64).dequantize())
    assert len(generate(loaded.model, _prompt(), 4, loaded.experts).ids) == 4


def test_the_partial_group_has_its_own_scale():
    """A row of 70 at group 64: the 6-column tail's scale is its own absmax / 7, not the first group's."""
    w = torch.zeros(1, 70)
    w[0, :64], w[0, 64:] = 7.0, 0.7
    m = quantized_matrix(w, 4, 64)
    assert m.scales.shape == (1, 2) and m.q.shape == (1, 35)
    assert m.scales.float().tolist()[0] == pytest.approx([1.0, 0.1], rel=1e-3)
    assert torch.allclose(m.dequantize(), w, rtol=1e-3)
    odd = quantized_matrix(torch.full((2, 5), -7.0), 4, 4)  # 5 = a group of 4 + a group of 1; padding nibble
    assert odd.q.shape == (2, 3) and (odd.q[:, 2] >> 4).tolist() == [8, 8]
    assert odd.dequantize().tolist() == [[-7.0] * 5] * 2
