"""The container as a zarr v3 store, the record layout, and the fast read path against zarr."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr

from storage.container.layout import RECORD_ALIGN, ExpertRecordLayout
from storage.container.reader import Container, ExpertReader, expert_array_name
from storage.errors import FormatError
from storage.files.buffers import aligned_empty, is_aligned


def test_stock_zarr_opens_attributes_dense_arrays_and_expert_chunks(make_container):
    path = make_container("deepseek_v3")
    root = zarr.open_group(path, mode="r")
    attrs = root.attrs["colibri"]
    assert attrs["format"] == "colibri-stream-container" and attrs["complete"] is True
    assert attrs["model_config"]["model_type"] == "deepseek_v3"
    assert attrs["experts"]["layout"]["scheme"] == "int4" and attrs["experts"]["layout"]["group_size"] == 64
    assert attrs["converter_version"] and len(attrs["source"]["shards_sha256"]["model.safetensors"]) == 64
    assert set(attrs["files"]) >= {"config.json", "tokenizer.json", "generation_config.json"}
    embed = root["dense/embed.weight"]
    assert embed.shape == (512, 64) and embed.dtype == np.float32
    experts = root[f"experts/{expert_array_name(1)}"]
    assert experts.shape == (16, attrs["experts"]["layout"]["record_bytes"]) and experts.chunks == (1, experts.shape[1])


def test_fast_path_returns_exactly_zarrs_bytes_for_every_expert(make_container):
    container = Container(make_container("glm_moe_dsa"))
    reader = ExpertReader(container)
    buffer = aligned_empty(container.layout.record_bytes)
    for layer in container.moe_layers:
        array = zarr.open_array(container.path / "experts" / expert_array_name(layer), mode="r")
        for expert in range(container.n_experts):
            assert reader.read_into(layer, expert, buffer) == container.layout.record_bytes
            assert np.array_equal(buffer, array[expert])


def test_aligned_buffers_and_records():
    for alignment in (64, 4096):
        assert all(is_aligned(aligned_empty(n, alignment), alignment) for n in (1, 4095, 10000))
    layout = ExpertRecordLayout.build("int4", 7168, 2048, 64)  # DeepSeek-V3 expert
    assert layout.record_bytes % RECORD_ALIGN == 0
    assert all(f.offset % 64 == 0 for f in layout.fields)
    # 3 matrices of 2048x7168 at 4 bits plus float16 scales per 64 inputs
    assert layout.payload_bytes == pytest.approx(3 * 2048 * 7168 * (0.5 + 2 / 64), rel=1e-3)


@pytest.mark.parametrize("scheme", ["int4", "int8", "bf16", "f32"])
def test_layout_pack_and_views_round_trip(scheme):
    layout = ExpertRecordLayout.build(scheme, 128, 64, 32)
    rng = np.random.default_rng(0)
    arrays = {
        f.name: rng.integers(0, 200, size=f.shape).astype(np.dtype(f.dtype) if f.dtype != "bfloat16" else np.uint16)
        for f in layout.fields
    }
    views = layout.views(layout.pack(arrays))
    assert all(np.array_equal(views[name], value) for name, value in arrays.items())
    assert layout.from_attrs(json.loads(json.dumps(layout.to_attrs())), 128, 64) == layout


def test_layout_holds_ragged_groups_and_refuses_only_impossible_ones():
    layout = ExpertRecordLayout.build("int4", 120, 41, 64)  # w2's input width 41 is odd
    assert layout.field("w1.q").shape == (41, 60) and layout.field("w1.scale").shape == (41, 2)
    assert layout.field("w2.q").shape == (120, 21) and layout.field("w2.scale").shape == (120, 1)
    assert ExpertRecordLayout.build("int8", 120, 41, 7).field("w2.scale").shape == (120, 6)
    with pytest.raises(FormatError, match="group size 7 is odd"):
        ExpertRecordLayout.build("int4", 120, 41, 7)
    with pytest.raises(FormatError, match="positive integer group size"):
        ExpertRecordLayout.build("int4", 120, 41, 0)
    with pytest.raises(FormatError, match="blocks are 32"):
        ExpertRecordLayout.build("mxfp4", 128, 64, 64)
