"""A decode step's routed 4-bit experts with float32 activations in one C call (engine/kernels/nibble_experts.py)."""

from __future__ import annotations

import pytest
import torch

import engine.core.moe as moe
import engine.kernels.nibble_experts as nibble_experts
import engine.kernels.quant as quant
from colibri_stream.bench.kernels import KINDS, random_kind_matrix
from engine.core.sources import ExpertWeights, ResidentExperts
from engine.kernels.modes import int8_activations
from engine.kernels.quant import QuantizedExpert, int4_kernel_available, kernel_matmul
from engine.kernels.rows import rows_alone

needs_kernel = pytest.mark.skipif(not int4_kernel_available(), reason="engine.kernels._kernels was not built")
DIM, INTER, N_EXPERTS, TOPK = 200, 90, 10, 3  # no multiple of 64: partial chunks, a lone last block row


def make_experts(kind: str = "int4-f16-g64", seed: int = 0) -> ResidentExperts:
    code, scales, group = KINDS[kind]
    gen = torch.Generator().manual_seed(seed)

    def matrix(out_dim: int, in_dim: int):
        return random_kind_matrix(code, scales, group, out_dim, in_dim, gen)

    experts = {e: QuantizedExpert(matrix(INTER, DIM), matrix(DIM, INTER), matrix(INTER, DIM)) for e in range(N_EXPERTS)}
    return ResidentExperts({0: experts})


def routing(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, DIM, generator=gen)
    ids = torch.stack([torch.randperm(N_EXPERTS, generator=gen)[:TOPK] for _ in range(rows)])
    return x, torch.rand(rows, TOPK, generator=gen), ids


def reference(x, weights, ids, experts: ResidentExperts, limit=None) -> torch.Tensor:
    """The kernel's one-row products with torch's SwiGLU between them, each row alone, summed in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        for slot, e in enumerate(ids[r].tolist()):
            ex = experts.acquire(0, [e])[e]
            row = x[r : r + 1]
            g, u = kernel_matmul(row, ex.w1, alone=True), kernel_matmul(row, ex.w3, alone=True)
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            y = kernel_matmul(torch.nn.functional.silu(g) * u, ex.w2, alone=True)
            out[r] += (y[0] * weights[r, slot]).double()
    return out


def fused_calls(monkeypatch) -> list[int]:
    """The experts each fused call was given, as calls happen."""
    calls: list[int] = []
    add = nibble_experts.add_nibble_experts
    monkeypatch.setattr(moe, "add_nibble_experts", lambda *a, **k: calls.append(len(a[5])) or add(*a, **k))
    return calls


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 19])  # 19: three groups of the kernel's 8 rows, the last partial
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_one_call_computes_the_reference_and_each_row_as_alone(monkeypatch, rows, kind):
    experts = make_experts(kind)
    x, weights, ids = routing(rows)
    calls = fused_calls(monkeypatch)
    with rows_alone():
        fused, _ = moe.routed_sum(x, weights, ids, experts, 0)
        alone = torch.cat(
            [moe.routed_sum(x[r : r + 1], weights[r : r + 1], ids[r : r + 1], experts, 0)[0] for r in range(rows)]
        )
    assert calls[0] == len(ids.unique()) and len(calls) == 1 + rows  # one call a layer, alone or batched
    assert torch.equal(fused, alone)  # a row's bits do not depend on the rows beside it
    expected = reference(x, weights, ids, experts)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


@needs_kernel
def test_the_swiglu_limit_clamps_as_the_per_expert_path_does(monkeypatch):
    experts = make_experts()
    x, weights, ids = routing(6, seed=3)
    x = x * 40  # gate and up values beyond the limit
    with rows_alone():
        fused, _ = moe.routed_sum(x, weights, ids, experts, 0, limit=0.5)
        unclamped, _ = moe.routed_sum(x, weights, ids, experts, 0)
        monkeypatch.setattr(moe, "in_one_call", lambda *a: [])
        plain, _ = moe.routed_sum(x, weights, ids, experts, 0, limit=0.5)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6 * plain.abs().max().item())
    torch.testing.assert_close(fused, reference(x, weights, ids, experts, limit=0.5), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fused, unclamped, rtol=1e-2)


@needs_kernel
def test_a_batch_too_big_for_one_work_area_is_split_over_calls_with_the_same_sum(monkeypatch):
    experts = make_experts()
    x, weights, ids = routing(40, seed=5)
    with rows_alone():
        whole, _ = moe.routed_sum(x, weights, ids, experts, 0)
        monkeypatch.setattr(nibble_experts, "MAX_WORK_BYTES", 8 * 4 * 3 * (INTER + DIM))  # ~8 rows per call
        sizes = []
        call = nibble_experts._kernels.nibble_moe
        monkeypatch.setattr(nibble_experts._kernels, "nibble_moe", lambda *a: sizes.append(a[6]) or call(*a))
        split, _ = moe.routed_sum(x, weights, ids, experts, 0)
    assert len(sizes) > 2 and sum(sizes) == len(ids.unique())
    assert torch.equal(whole, split)


@needs_kernel
def test_only_4bit_experts_with_float_activations_take_it(monkeypatch):
    x, weights, ids = routing(6)
    experts = make_experts()
    calls = fused_calls(monkeypatch)
    moe.routed_sum(x[:1], weights[:1], ids[:1], experts, 0)  # one row: a decode step, alone or not
    assert calls == [TOPK]
    with rows_alone(), int8_activations():
        moe.routed_sum(x, weights, ids, experts, 0)  # int8 activations: engine/kernels/q8_experts.py's call
    gen = torch.Generator().manual_seed(1)
    shapes = [(INTER, DIM), (DIM, INTER), (INTER, DIM)]
    floats = ResidentExperts(
        {0: {e: ExpertWeights(*(torch.randn(s, generator=gen) for s in shapes)) for e in range(N_EXPERTS)}}
    )
    with rows_alone():
        moe.routed_sum(x, weights, ids, floats, 0)  # float experts: not the 4-bit kernel's
        mixed = [(0, experts.acquire(0, [0])[0]), (1, floats.acquire(0, [0])[0])]
        assert [i for i, _ in nibble_experts.in_one_call(mixed, x, lambda e: 1)] == [0]  # the float one is not
    assert calls == [TOPK]


def prompt_reference(x, weights, ids, experts: ResidentExperts) -> torch.Tensor:
    """Each expert on the rows routed to it, in ascending order, through the matrices' own matmul (the kernel
    MAX_ROWS rows a call up to PROMPT_KERNEL_ROWS rows), torch's SwiGLU between them, summed in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in ids.unique().tolist():
        rows, slots = torch.where(ids == e)
        out.index_add_(0, rows, (experts.acquire(0, [e])[e](x[rows]) * weights[rows, slots, None]).double())
    return out


@needs_kernel
@pytest.mark.parametrize("rows", [2, 13, 40])  # 40 x 3 slots over 10 experts: some with more than 8 rows
def test_a_prompts_experts_go_in_one_call_with_the_products_of_their_own_matmul(monkeypatch, rows):
    experts = make_experts()
    x, weights, ids = routing(rows, seed=rows)
    calls = fused_calls(monkeypatch)
    fused, _ = moe.routed_sum(x, weights, ids, experts, 0)
    assert calls == [len(ids.unique())]
    expected = prompt_reference(x, weights, ids, experts)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    with rows_alone():  # the same rows each computed as alone
        alone, _ = moe.routed_sum(x, weights, ids, experts, 0)
    # a row's products do not depend on the rows beside it; at DIM and INTER (one column block for any
    # row count) not even the column blocks differ, so the bits are the decode rows'
    assert torch.equal(fused, alone)


@needs_kernel
def test_a_prompts_expert_routed_more_rows_than_the_kernel_takes_keeps_the_dequantised_matmul(monkeypatch):
    experts = make_experts()
    x, weights, ids = routing(40, seed=4)
    counts = {e: int((ids == e).sum()) for e in ids.unique().tolist()}
    limit = sorted(counts.values())[len(counts) // 2]  # about half the experts are routed more rows
    monkeypatch.setattr(nibble_experts, "PROMPT_KERNEL_ROWS", limit)
    monkeypatch.setattr(quant, "PROMPT_KERNEL_ROWS", limit)
    taken: list[list[int]] = []
    call = nibble_experts.add_nibble_experts
    monkeypatch.setattr(moe, "add_nibble_experts", lambda *a, **k: taken.append(list(a[4])) or call(*a, **k))
    fused, _ = moe.routed_sum(x, weights, ids, experts, 0)
    assert taken == [sorted(e for e, n in counts.items() if n <= limit)] and len(taken[0]) < len(counts)
    expected = prompt_reference(x, weights, ids, experts)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


@needs_kernel
def test_a_prompts_rows_up_to_the_kernels_limit_take_the_kernel_8_rows_a_call_and_more_the_dequantised_matmul():
    matrix = make_experts().acquire(0, [0])[0].w1
    x = torch.randn(quant.PROMPT_KERNEL_ROWS + 1, DIM, generator=torch.Generator().manual_seed(9))
    within = x[: quant.PROMPT_KERNEL_ROWS]
    by_kernel = torch.cat([kernel_matmul(rows, matrix) for rows in within.split(8)])
    assert torch.equal(matrix.matmul(within), by_kernel)
    assert torch.equal(matrix.matmul(x), torch.nn.functional.linear(x, matrix.dequantize()))
    assert not torch.equal(matrix.matmul(x)[:8], by_kernel[:8])  # the two give other bits


@needs_kernel
def test_a_batch_with_other_experts_still_computes_its_4bit_ones_in_one_call(monkeypatch):
    """A layer whose experts are partly elsewhere (float weights here; VRAM slots on a GPU machine): the 4-bit
    CPU experts still go through the one call, so their terms do not depend on where the others are."""
    quantised = make_experts()._experts[0]
    gen = torch.Generator().manual_seed(7)
    shapes = [(INTER, DIM), (DIM, INTER), (INTER, DIM)]
    floats = {e: ExpertWeights(*(torch.randn(s, generator=gen) * 0.05 for s in shapes)) for e in range(5, N_EXPERTS)}
    mixed = ResidentExperts({0: {**{e: quantised[e] for e in range(5)}, **floats}})
    x, weights, ids = routing(4, seed=2)
    calls = fused_calls(monkeypatch)
    with rows_alone():
        got, _ = moe.routed_sum(x, weights, ids, mixed, 0)
    assert calls == [len([e for e in ids.unique().tolist() if e < 5])]
    expected = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        for slot, e in enumerate(ids[r].tolist()):
            if e >= 5:
                expected[r] += (floats[e](x[r : r + 1])[0] * weights[r, slot]).double()
    keep = ids < 5  # the 4-bit experts' terms: the reference with the others' weights at zero
    expected += reference(x, weights * keep, ids.where(keep, 0), make_experts())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def segment_sums(x, weights, ids, experts, sizes) -> torch.Tensor:
    """Each segment's routed sum on its own rows, as its own prompt chunk's forward computes it."""
    parts = zip(x.split(sizes), weights.split(sizes), ids.split(sizes), strict=True)
    return torch.cat([moe.routed_sum(*part, experts, 0)[0] for part in parts])


def segmented_sum(x, weights, ids, experts, sizes) -> torch.Tensor:
    routed = moe.RoutedSum(x, weights, ids, segments=sizes)
    moe.add_routed([routed], experts, 0)
    return routed.total()


@needs_kernel
@pytest.mark.parametrize("sizes", [[13, 5, 22], [3, 1, 9, 27]])  # boundaries inside an expert's groups of 8
def test_several_segments_go_in_one_call_each_with_its_own_sums_bits(monkeypatch, sizes):
    experts = make_experts()
    x, weights, ids = routing(sum(sizes), seed=len(sizes))
    calls = fused_calls(monkeypatch)
    got = segmented_sum(x, weights, ids, experts, sizes)
    assert calls == [len(ids.unique())]  # every expert once, for all the segments
    assert torch.equal(got, segment_sums(x, weights, ids, experts, sizes))
    whole, _ = moe.routed_sum(x, weights, ids, experts, 0)
    assert torch.equal(got, whole)  # a row's products do not depend on the rows beside it (one column block here)


@needs_kernel
def test_an_expert_past_the_kernels_rows_in_one_segment_takes_the_dequantised_matmul_there_only(monkeypatch):
    """The limit on rows per expert is each segment's (what its own sum sees): an expert routed more rows in
    one segment goes to the dequantised matmul for that segment's rows, and to the one call for the others
    (whose SwiGLU is C's: the two paths differ in bits, so the wrong one fails the comparison)."""
    experts = make_experts()
    sizes = [30, 6]
    x, weights, ids = routing(sum(sizes), seed=11)
    first = {e: int((ids[: sizes[0]] == e).sum()) for e in range(N_EXPERTS)}
    limit = sorted(first.values())[N_EXPERTS // 2]  # about half the experts are over it in segment 1
    assert max(int((ids[sizes[0] :] == e).sum()) for e in range(N_EXPERTS)) <= limit  # none in segment 2
    monkeypatch.setattr(nibble_experts, "PROMPT_KERNEL_ROWS", limit)
    monkeypatch.setattr(quant, "PROMPT_KERNEL_ROWS", limit)
    taken: list[list[int]] = []
    call = nibble_experts.add_nibble_experts
    monkeypatch.setattr(moe, "add_nibble_experts", lambda *a, **k: taken.append(list(a[4])) or call(*a, **k))
    got = segmented_sum(x, weights, ids, experts, sizes)
    over = {e for e, n in first.items() if n > limit}
    assert over and taken == [sorted(ids.unique().tolist())]  # segment 2 has every expert within the limit
    assert torch.equal(got, segment_sums(x, weights, ids, experts, sizes))


@needs_kernel
def test_segments_that_do_not_cover_the_rows_are_refused():
    experts = make_experts()
    x, weights, ids = routing(10)
    expert = experts.acquire(0, [0])[0]
    out = torch.zeros(x.shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="segments"):
        nibble_experts.add_nibble_experts(out, x, ids, weights, [0], [expert], segments=[4, 5])
    assert not out.any()  # nothing added
