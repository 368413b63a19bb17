"""`convert --dense int4`: most 2-D dense weights as int4 codes two a byte (the embedding, output head,
router, DSA indexer and MLA's wkv_b stay int8), any width (a partial last group, an odd row ending in a
padding nibble), verified like every array, dequantised exactly by the float path and read as codes by
the int8 kernels with int8 activations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.convert.pull_space import container_bytes
from colibri_stream.devtools import fixtures
from colibri_stream.planning.geometry import geometry_from_container
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_container
from engine.kernels.int8_dense import CodedLinear
from engine.kernels.q8 import quantize_rows
from engine.kernels.quant import quantized_matrix
from storage.container.reader import Container
from storage.container.verify import verify_container

# hidden 120 and a shared-expert width of 41 (odd: its rows end in a padding nibble); group 64 divides neither
ODD = dict(hidden_size=120, moe_intermediate_size=41, intermediate_size=90)


@pytest.fixture(scope="module")
def odd_checkpoint(tmp_path_factory) -> Path:
    return fixtures.build_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("odd") / "hf", config_overrides=ODD)


@pytest.fixture(scope="module")
def int4_dense(odd_checkpoint, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("int4-dense") / "c"
    Converter(odd_checkpoint, dst, ConvertOptions(experts="int4", dense="int4"), progress=False).run()
    return dst


def test_which_weights_are_int4_and_their_packed_arrays(int4_dense):
    container = Container(int4_dense)
    dtypes = {name: entry.dtype for name, entry in container.dense.items()}
    for name in ("layers.1.attn.wq_a.weight", "layers.1.attn.wo.weight", "layers.1.ffn.shared_experts.w2.weight"):
        assert dtypes[name] == "int4", name
    for name in ("embed.weight", "head.weight", "layers.1.ffn.gate.weight", "layers.1.attn.wkv_b.weight"):
        assert dtypes[name] == "int8", name
    assert dtypes["norm.weight"] == "bfloat16"
    attrs = json.loads((int4_dense / "zarr.json").read_text())["attributes"]["colibri"]["dense"]
    odd = attrs["layers.1.ffn.shared_experts.w2.weight"]
    assert odd["shape"] == [120, 41] and odd["group_size"] == 64 and odd["scales"]["shape"] == [120, 1]
    stored = json.loads((int4_dense / "dense" / "layers.1.ffn.shared_experts.w2.weight" / "zarr.json").read_text())
    assert stored["shape"] == [120, 21] and stored["data_type"] == "uint8"  # 41 codes: 20 bytes and a half
    assert verify_container(int4_dense) == []


def test_int4_dense_is_a_quarter_of_bf16_on_disk_and_the_estimate_knows(int4_dense, odd_checkpoint, tmp_path):
    bf16 = tmp_path / "bf16"
    Converter(odd_checkpoint, bf16, ConvertOptions(experts="int4", dense="bf16"), progress=False).run()

    def dense_bytes(path: Path) -> int:
        return sum(f.stat().st_size for f in (path / "dense").rglob("*") if f.is_file() and f.name != "zarr.json")

    assert dense_bytes(int4_dense) < 0.5 * dense_bytes(bf16)
    for path in (int4_dense, bf16):  # pull's space estimate covers what convert writes
        estimate = container_bytes(geometry_from_container(Container(path)), 64, [])
        written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        assert written <= estimate < 2 * written + (1 << 20)


def test_the_float_path_dequantises_the_codes_exactly(int4_dense, odd_checkpoint):
    source = load_file(odd_checkpoint / "model.safetensors")["model.layers.1.mlp.shared_experts.down_proj.weight"]
    loaded = load_container(int4_dense)
    held = loaded.model.state_dict()["layers.1.ffn.shared_experts.w2.weight"]
    assert torch.equal(held, quantized_matrix(source, 4, 64).dequantize())
    assert not any(isinstance(m, CodedLinear) for m in loaded.model.modules())
    assert len(generate(loaded.model, fixtures.make_prompt(512, 12), 6, loaded.experts).ids) == 6


def test_int8_activations_read_the_int4_codes(int4_dense, odd_checkpoint):
    """With int8 activations the int4 Linears stay coded (a quarter of bf16's bytes per token) and the
    kernel gives the function of int8(x) times the dequantised weights; the model stays close to the
    float path on the same container."""
    fast, exact = load_container(int4_dense, int8_activations=True), load_container(int4_dense)
    coded = {name: m for name, m in fast.model.named_modules() if isinstance(m, CodedLinear)}
    assert coded["layers.1.ffn.shared_experts.w2"].code == "int4" and coded["head"].code == "int8"
    layer = coded["layers.1.ffn.shared_experts.w2"]
    x = torch.randn(3, 41, generator=torch.Generator().manual_seed(0))
    want = quantize_rows(x) @ layer.matrix.dequantize(torch.float32).T
    assert torch.allclose(layer(x), want, rtol=1e-4, atol=1e-4)
    ids = torch.tensor([fixtures.make_prompt(512, 20)])
    a = fast.model(ids, 0, fast.model.new_cache(), fast.experts)[0]
    b = exact.model(ids, 0, exact.model.new_cache(), exact.experts)[0]
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).median().item() > 0.99


def test_a_flipped_int4_byte_fails_verify(int4_dense, tmp_path, capsys):
    import shutil

    from colibri_stream import cli

    copy = Path(shutil.copytree(int4_dense, tmp_path / "flipped"))
    chunk = copy / "dense" / "layers.1.attn.wq_a.weight" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x10
    chunk.write_bytes(bytes(data))
    assert cli.main(["verify", str(copy)]) == 1
    assert "layers.1.attn.wq_a.weight: checksum mismatch" in capsys.readouterr().err


def test_plan_counts_the_codes_the_int8_path_holds(int4_dense, capsys):
    """With --activations int8 the coded Linears stay codes: plan's dense bytes are what the loaded model
    holds, not their dequantised size (which a float run holds, and plan says without the flag)."""
    from colibri_stream import cli
    from colibri_stream.planning.placement import plan
    from storage.tiers.config import StoreConfig

    geometry = geometry_from_container(Container(int4_dense))
    fast, exact = (plan(geometry, StoreConfig(ram_bytes=1 << 30), int8_activations=i) for i in (True, False))
    for int8, placement in ((True, fast), (False, exact)):
        loaded = load_container(int4_dense, int8_activations=int8)
        assert placement.dense_bytes == sum(t.nbytes for t in loaded.model.state_dict().values())
    assert fast.dense_bytes < 0.5 * exact.dense_bytes
    sizes = {}
    for activations in ("float32", "int8"):
        cli.main(["plan", str(int4_dense), "--json", "--activations", activations, "--ram", "1GiB"])
        sizes[activations] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dense_bytes"]
    assert (sizes["int8"], sizes["float32"]) == (fast.dense_bytes, exact.dense_bytes)
