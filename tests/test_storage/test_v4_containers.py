"""DeepSeek-V4 containers: experts stream like V3's (placement changes speed, never tokens), the
token -> experts table converts exactly, and the MTP modules are kept in the container, never loaded."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools import fixtures
from colibri_stream.errors import CheckpointError
from colibri_stream.planning.geometry import geometry_from_container
from colibri_stream.planning.placement import plan
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint, load_container
from engine.bf16 import bf16_kernel_available
from storage.container import Container
from storage.tiered import StoreConfig
from storage.verify import verify_container

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    return fixtures.build_tiny_checkpoint("deepseek_v4", tmp_path_factory.mktemp("v4c") / "hf")


@pytest.fixture(scope="module")
def v4_container(v4_checkpoint, tmp_path_factory):
    dst = tmp_path_factory.mktemp("v4c") / "int4.cstream"
    Converter(v4_checkpoint, dst, ConvertOptions(experts="int4", dense="f32"), progress=False).run()
    return dst


def test_a_quarter_of_the_expert_bytes_gives_the_resident_tokens(v4_container):
    container = Container(v4_container)
    prompt = fixtures.make_prompt(container.model_config["vocab_size"], 30, seed=4)
    resident = load_container(v4_container)
    expected = generate(resident.model, prompt, NEW_TOKENS, resident.experts).ids
    quarter = container.expert_bytes // 4 // container.layout.record_bytes * container.layout.record_bytes
    loaded = load_container(v4_container, store=StoreConfig(ram_bytes=quarter))
    try:
        assert generate(loaded.model, prompt, NEW_TOKENS, loaded.experts).ids == expected
        stats = loaded.experts.snapshot()
    finally:
        loaded.experts.close()
    assert stats.misses > 0 and stats.hits_ram > 0


def test_the_hash_table_converts_exactly(v4_checkpoint, v4_container):
    shipped = load_checkpoint(v4_checkpoint).model
    converted = load_container(v4_container).model
    for ours, theirs in zip(converted.layers, shipped.layers, strict=True):
        if ours.ffn.hashed:
            assert ours.ffn.gate.tid2eid.dtype == torch.long
            assert torch.equal(ours.ffn.gate.tid2eid, theirs.ffn.gate.tid2eid)


MTP = {  # DeepSeek-V4's hub names for its multi-token-prediction module (a few of them)
    "mtp.0.enorm.weight": (80,),
    "mtp.0.e_proj.weight": (80, 160),
    "mtp.0.attn.wq_a.weight": (48, 80),
    "mtp.0.ffn.experts.0.w1.weight": (40, 80),
}


def test_mtp_modules_are_kept_in_the_container_and_never_loaded(v4_checkpoint, v4_container, tmp_path):
    source = tmp_path / "with-mtp"
    shutil.copytree(v4_checkpoint, source)
    tensors = load_file(source / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    mtp = {name: torch.randn(shape, generator=gen) for name, shape in MTP.items()}
    save_file({**tensors, **mtp}, source / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))

    dst = tmp_path / "with-mtp.cstream"
    Converter(source, dst, ConvertOptions(experts="int4", dense="f32"), progress=False).run()
    container = Container(dst)
    assert sorted(container.kept) == sorted(f"kept.{name}" for name in MTP)
    for name, tensor in mtp.items():
        assert torch.equal(torch.from_numpy(container.read_dense(f"kept.{name}")), tensor)
    assert verify_container(dst) == []

    prompt = fixtures.make_prompt(config["vocab_size"], 12, seed=2)
    with_mtp, without = load_container(dst), load_container(v4_container)
    assert (
        generate(with_mtp.model, prompt, 8, with_mtp.experts).ids
        == generate(without.model, prompt, 8, without.experts).ids
    )
    assert load_checkpoint(source).model.state_dict().keys() == load_checkpoint(v4_checkpoint).model.state_dict().keys()
    placed = [
        plan(geometry_from_container(Container(p)), StoreConfig(ram_bytes=1 << 30), "float32")
        for p in (dst, v4_container)
    ]
    assert placed[0].dense_bytes == placed[1].dense_bytes


@pytest.mark.skipif(not bf16_kernel_available(), reason="no bf16 kernel on this CPU: bf16 weights are upcast at load")
def test_a_float32_model_holds_the_grouped_output_projection_in_bf16(v4_checkpoint, tmp_path):
    """wo_a of a bf16 container stays bf16 in a float32 model (half its memory; plan counts it so) and
    computes through the bf16 kernel group by group: the logits of the same weights upcast to float32."""
    dst = tmp_path / "bf16-dense.cstream"
    Converter(v4_checkpoint, dst, ConvertOptions(experts="int4", dense="bf16"), progress=False).run()
    loaded = load_container(dst)
    layers = [layer.attn.wo_a for layer in loaded.model.layers]
    assert all(wo_a.weight.dtype == torch.bfloat16 for wo_a in layers)
    ids = torch.tensor([fixtures.make_prompt(loaded.args.vocab_size, 12, seed=9)])
    held = loaded.model(ids, 0, loaded.model.new_cache(), loaded.experts)[0]
    for wo_a in layers:
        wo_a.weight.data = wo_a.weight.data.float()
    upcast = loaded.model(ids, 0, loaded.model.new_cache(), loaded.experts)[0]
    assert (held - upcast).abs().max().item() <= 1e-5


def test_a_hash_table_naming_an_expert_the_model_lacks_is_refused(v4_checkpoint, tmp_path):
    source = tmp_path / "doctored"
    shutil.copytree(v4_checkpoint, source)
    tensors = load_file(source / "model.safetensors")
    name = "model.layers.1.ffn.gate.tid2eid"
    tensors[name] = tensors[name].clone()
    tensors[name][7, 2] = 16  # the fixture has experts 0..15
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.gate\.tid2eid holds expert ids 0\.\.16.*0\.\.15"):
        load_checkpoint(source)
    dst = tmp_path / "doctored.cstream"
    Converter(source, dst, ConvertOptions(experts="int4", dense="f32"), progress=False).run()
    with pytest.raises(CheckpointError, match="tid2eid holds expert ids"):
        load_container(dst)
