"""DeepSeek-V4 as DeepSeek ships it (FP8 dense with ue8m0 block scales, FP4 routed experts, every scale
under `<module>.scale`): `convert` copies the experts' codes into mxfp4 records and dequantises the FP8
weights, and the container computes what transformers computes on the checkpoint those bytes mean."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools import fixtures
from colibri_stream.devtools.v4_native_fixture import build_v4_native_checkpoint, dequantised_v4_checkpoint
from colibri_stream.errors import CheckpointError
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_container
from storage.container.reader import Container, ExpertReader

LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4native")
    float_model = fixtures.build_tiny_checkpoint(
        "deepseek_v4", root / "float", config_overrides={"hidden_size": 96, "moe_intermediate_size": 64}
    )
    shipped = build_v4_native_checkpoint(float_model, root / "native")
    container = root / "native.cstream"
    Converter(shipped, container, ConvertOptions(), progress=False).run()
    return shipped, container, dequantised_v4_checkpoint(shipped, root / "dequantised")


def test_the_container_computes_what_transformers_computes_on_the_shipped_bytes(native):
    _, container, dequantised = native
    reference, loaded = fixtures.load_reference(dequantised), load_container(container)
    prompt = fixtures.make_prompt(loaded.args.vocab_size, 20, seed=3)
    expected = fixtures.oracle_greedy(reference, prompt, 16)
    assert generate(loaded.model, prompt, 16, loaded.experts).ids == expected
    forced = fixtures.oracle_teacher_forced(reference, prompt + expected)
    logits = loaded.model(torch.tensor([prompt + expected]), 0, loaded.model.new_cache(), loaded.experts)[0]
    assert (logits - forced.logits).abs().max().item() <= LOGIT_TOL


def test_expert_codes_and_scales_are_copied_as_shipped(native):
    shipped, container, _ = native
    tensors = load_file(shipped / "model.safetensors")
    opened = Container(container)
    assert opened.layout.scheme == "mxfp4" and opened.layout.group_size == 32
    record = np.empty(opened.layout.record_bytes, dtype=np.uint8)
    ExpertReader(opened).read_into(2, 5, record)
    fields = {f.name: f for f in opened.layout.fields}
    for proj in ("w1", "w2", "w3"):
        for part, shipped_name in (("q", "weight"), ("scale", "scale")):
            field = fields[f"{proj}.{part}"]
            stored = bytes(record[field.offset : field.offset + field.shape[0] * field.shape[1]])
            expected = tensors[f"layers.2.ffn.experts.5.{proj}.{shipped_name}"].contiguous().view(torch.uint8)
            assert stored == expected.numpy().tobytes(), (proj, part)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("layers.1.ffn.experts.3.w2.scale", "FP4 codes"),  # codes without their scales
        ("layers.0.attn.wq_b.scale", "FP8 weight layers.0.attn.wq_b.weight has no scales"),
        ("layers.0.attn.wq_b.weight", "has no weight"),  # a scale without its weight
    ],
)
def test_a_missing_half_is_refused_naming_it(native, tmp_path, drop, message):
    shipped, _, _ = native
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in shipped.iterdir():
        if file.suffix != ".safetensors":
            (broken / file.name).write_bytes(file.read_bytes())
    tensors = load_file(shipped / "model.safetensors")
    del tensors[drop]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        Converter(broken, tmp_path / "out.cstream", ConvertOptions(), progress=False).run()
