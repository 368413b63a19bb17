"""Routed experts held in the q8 kernel's interleaved layout (engine/kernels/interleaved_expert.py): a record's bytes
rearranged in place, the row-major matrices recoverable byte for byte, and every product of the one C call
per layer (engine/kernels/q8_experts.py) bit-equal to the row-major experts' for any rows, codes, scales and clamp."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from colibri_stream.experts.codec import Settler, expert_from_record, record_from_quantized, settled_expert
from engine.kernels import _kernels
from engine.kernels.interleaved_expert import InterleavedExpert, interleave_into, interleaves, scratch_bytes
from engine.kernels.modes import int8_activations
from engine.kernels.q8_experts import add_experts, fused_experts_handle
from engine.kernels.quant import QuantizedExpert, QuantizedMatrix
from storage.container.layout import ExpertRecordLayout

pytest.importorskip("engine.kernels._kernels")

DIM, INTER = 1024, 512  # w1/w3 [512, 1024], w2 [1024, 512]: both interleave


def record_of(scheme: str, group: int, seed: int) -> tuple[ExpertRecordLayout, np.ndarray, dict[str, QuantizedMatrix]]:
    """A record of random codes and scales (a scheme's own), and the matrices packed into it."""
    layout = ExpertRecordLayout.build(scheme, DIM, INTER, group)
    g = torch.Generator().manual_seed(seed)
    code, scale_tag = layout.quant_kind or ("", "")
    matrices = {}
    for name, (out_dim, in_dim) in {"w1": (INTER, DIM), "w2": (DIM, INTER), "w3": (INTER, DIM)}.items():
        if code == "int4":
            q = torch.randint(0, 256, (out_dim, in_dim // 2), dtype=torch.uint8, generator=g)
        else:
            q = torch.randint(-127, 128, (out_dim, in_dim), dtype=torch.int8, generator=g)
        scales = (torch.rand(out_dim, in_dim // group, generator=g) * 0.02 + 1e-3).to(
            torch.bfloat16 if scale_tag == "bfloat16" else torch.float16
        )
        matrices[name] = QuantizedMatrix(q, scales, code, group, in_dim)
    return layout, record_from_quantized(layout, matrices), matrices


CASES = [("int4", 64), ("int4", 128), ("int8", 64), ("int4-bf16scale", 512)]


@pytest.mark.parametrize(("scheme", "group"), CASES)
def test_a_settled_record_is_rearranged_in_place_and_gives_its_matrices_back(scheme, group):
    layout, record, matrices = record_of(scheme, group, seed=1)
    before = record.copy()
    expert = settled_expert(layout, record)
    assert isinstance(expert, InterleavedExpert)
    start, end = record.ctypes.data, record.ctypes.data + record.nbytes
    assert all(start <= t.data_ptr() < end for t in expert.tensors())  # views of the record itself
    assert not np.array_equal(record, before)  # the bytes moved
    again = expert.row_major()
    for name, m in matrices.items():
        back = getattr(again, name)
        assert torch.equal(back.q.view(torch.uint8), m.q.view(torch.uint8))
        assert torch.equal(back.scales.view(torch.uint8), m.scales.contiguous().view(torch.uint8))
    # the three matrices, w1 then w3 then w2, back to back from the record's start
    w1, w3, w2 = expert.tensors()
    assert w1.data_ptr() == start and w3.data_ptr() == start + w1.nbytes and w2.data_ptr() == w3.data_ptr() + w3.nbytes


def test_a_settler_reuses_its_scratch_and_gives_the_same_bytes():
    layout, record_a, _ = record_of("int4", 64, seed=2)
    record_b = record_a.copy()
    settler = Settler(layout)
    assert settler.scratch.numel() >= scratch_bytes(layout_expert(layout, record_a.copy()))
    settler(record_a)
    settled_expert(layout, record_b)  # a scratch of its own
    assert np.array_equal(record_a, record_b)


def layout_expert(layout: ExpertRecordLayout, record: np.ndarray) -> QuantizedExpert:
    expert = expert_from_record(layout, record)
    assert isinstance(expert, QuantizedExpert)
    return expert


def test_records_that_do_not_tile_stay_row_major():
    layout = ExpertRecordLayout.build("int4", 256, 96, 32)  # 256 < one span, group 32 < a chunk
    record = np.zeros(layout.record_bytes, dtype=np.uint8)
    assert isinstance(settled_expert(layout, record), QuantizedExpert)
    mx = ExpertRecordLayout.build("mxfp4", DIM, INTER, 32)  # fp4 codes: not the q8 kernel's
    assert isinstance(settled_expert(mx, np.zeros(mx.record_bytes, dtype=np.uint8)), QuantizedExpert)


def test_interleave_into_refuses_memory_too_small():
    layout, record, _ = record_of("int4", 64, seed=3)
    expert = layout_expert(layout, record)
    assert interleaves(expert)
    with pytest.raises(ValueError, match="needs"):
        interleave_into(expert, torch.empty(1000, dtype=torch.uint8))


def experts_both_ways(scheme: str, group: int, n: int) -> tuple[list[QuantizedExpert], list[InterleavedExpert]]:
    row_major, interleaved = [], []
    for e in range(n):
        layout, record, _ = record_of(scheme, group, seed=10 + e)
        row_major.append(layout_expert(layout, record.copy()))
        settled = settled_expert(layout, record)
        assert isinstance(settled, InterleavedExpert)
        interleaved.append(settled)
    return row_major, interleaved


@pytest.mark.parametrize(("scheme", "group"), CASES)
@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("limit", [None, 0.05])
def test_the_one_call_gives_the_row_major_bytes(scheme, group, rows, limit):
    row_major, interleaved = experts_both_ways(scheme, group, 4)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, DIM, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2, generator=g)
    sums = []
    with int8_activations():
        for experts in (row_major, interleaved):
            assert fused_experts_handle(experts, x)
            out = torch.zeros(rows, DIM, dtype=torch.float64)
            add_experts(out, x, ids, weights, [0, 1, 2, 3], experts, limit)
            sums.append(out)
    assert sums[0].abs().sum() > 0 and torch.equal(sums[0], sums[1])


def test_layouts_do_not_mix_in_one_call():
    row_major, interleaved = experts_both_ways("int4", 64, 2)
    with int8_activations():
        assert not fused_experts_handle([row_major[0], interleaved[1]], torch.randn(1, DIM))


def test_an_interleaved_expert_called_alone_gives_the_row_major_bits():
    row_major, interleaved = experts_both_ways("int8", 64, 1)
    x = torch.randn(5, DIM)
    assert torch.equal(row_major[0](x, 0.1), interleaved[0](x, 0.1))
    with int8_activations():
        assert torch.equal(row_major[0](x), interleaved[0](x))


def test_the_kernel_refuses_an_interleaved_layout_that_does_not_tile():
    x, ids, w = torch.randn(1, 256), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    out = torch.zeros(1, 256, dtype=torch.float64)
    expert_ids, mats = torch.zeros(1, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    with pytest.raises(ValueError, match="interleaved=1"):
        _kernels.q8_moe(
            x.data_ptr(), 1, 256, 512, ids.data_ptr(), w.data_ptr(), 1, expert_ids.data_ptr(), 1, mats.data_ptr(),
            0, 0, 0, 64, 64, True, False, 0.0, out.data_ptr(), 2, 1,
        )  # fmt: skip
