"""DeepSeek-V4 containers: experts stream like V3's (placement changes speed, never tokens), the
token -> experts table converts exactly, and the MTP module converts, streams and drafts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools import fixtures
from colibri_stream.devtools.mtp_fixture import add_v4_mtp_module
from colibri_stream.errors import CheckpointError
from colibri_stream.planning.geometry import geometry_from_container
from colibri_stream.planning.placement import plan
from colibri_stream.runtime.batching import ContinuousBatch, GenerationRequest
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint, load_container
from colibri_stream.runtime.mtp_governor import MTPOptions
from colibri_stream.runtime.sampling import SamplingParams
from colibri_stream.runtime.speculation import Speculation
from engine.kernels.bf16 import bf16_kernel_available
from storage.container.reader import Container
from storage.container.verify import verify_container
from storage.tiers.config import StoreConfig

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


def test_the_mtp_module_converts_streams_and_drafts_without_changing_a_token(v4_checkpoint, v4_container, tmp_path):
    """mtp.0 (DeepSeek-V4's hub names) converts to engine arrays and expert records of layer n_layers, `plan`
    counts it, --no-mtp leaves it out, and drafting with it under a quarter of the expert bytes (its own
    experts streamed too) gives the plain greedy tokens."""
    source = tmp_path / "with-mtp"
    shutil.copytree(v4_checkpoint, source)
    add_v4_mtp_module(source, seed=5)
    n_layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    held, left_out = tmp_path / "mtp.cstream", tmp_path / "no-mtp.cstream"
    Converter(source, held, ConvertOptions(experts="int4", dense="f32"), progress=False).run()
    Converter(source, left_out, ConvertOptions(experts="int4", dense="f32", mtp=False), progress=False).run()
    container = Container(held)
    own = {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.hc_head.fn", "mtp.0.block.attn.wq_a.weight"}
    assert own <= set(container.dense) and container.moe_layers[-1] == n_layers
    assert not any(name.startswith("mtp.") for name in Container(left_out).dense)
    assert Container(left_out).moe_layers[-1] == n_layers - 1
    assert verify_container(held) == []
    placed = [
        plan(geometry_from_container(Container(p)), StoreConfig(ram_bytes=1 << 30), "float32") for p in (held, left_out)
    ]
    assert (placed[0].mtp_layers, placed[1].mtp_layers, placed[1].mtp_left_out) == (1, 0, 1)
    assert placed[0].dense_bytes == placed[1].dense_bytes + placed[0].mtp_dense_bytes > placed[1].dense_bytes
    assert placed[0].mtp_expert_bytes == container.expert_bytes - Container(left_out).expert_bytes > 0

    prompt = fixtures.make_prompt(container.model_config["vocab_size"], 30, seed=4)
    plain = load_container(left_out)
    expected = generate(plain.model, prompt, NEW_TOKENS, plain.experts).ids
    quarter = container.expert_bytes // 4 // container.layout.record_bytes * container.layout.record_bytes
    loaded = load_container(held, store=StoreConfig(ram_bytes=quarter))
    try:
        speculation = Speculation(loaded.drafter, MTPOptions("on", 2))
        batch = ContinuousBatch(loaded.model, loaded.experts, speculation=speculation)
        drafted = batch.add(GenerationRequest(prompt, NEW_TOKENS, SamplingParams()))
        while batch:
            batch.step()
        stats = loaded.experts.snapshot()
    finally:
        loaded.experts.close()
    assert drafted.error is None and drafted.result.ids == expected
    assert speculation.governor.report()["drafted"] > 0
    assert stats.misses > 0 and loaded.experts.routed.table()[n_layers] != [0] * loaded.args.n_routed_experts


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
