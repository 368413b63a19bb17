"""A MoE layer's routed experts with int8 activations in one C call (engine/kernels/q8_experts.py)."""

from __future__ import annotations

import pytest
import torch

import engine.core.moe as moe
import engine.kernels.q8_experts as q8_experts
from engine.core.sources import ExpertWeights, ResidentExperts
from engine.kernels.modes import int8_activations
from engine.kernels.q8 import quantize_rows
from engine.kernels.quant import SCALE_DTYPE, QuantizedExpert, QuantizedMatrix, int4_kernel_available, quantized_matrix

needs_kernel = pytest.mark.skipif(not int4_kernel_available(), reason="engine.kernels._kernels was not built")
DIM, INTER, N_EXPERTS, TOPK = 200, 96, 10, 3  # widths that are no multiple of 64: partial chunks


def matrix(out_dim: int, in_dim: int, bits: int, gen: torch.Generator, scales=SCALE_DTYPE) -> QuantizedMatrix:
    m = quantized_matrix(torch.randn(out_dim, in_dim, generator=gen) * 0.05, bits, 32)
    return QuantizedMatrix(m.q, m.scales.to(scales), m.code, m.group_size, m.in_dim)


def make_experts(bits: int = 4, down_bits: int | None = None, scales=SCALE_DTYPE) -> ResidentExperts:
    gen = torch.Generator().manual_seed(bits)
    down_bits = down_bits or bits
    return ResidentExperts(
        {
            0: {
                e: QuantizedExpert(
                    matrix(INTER, DIM, bits, gen, scales),
                    matrix(DIM, INTER, down_bits, gen, scales),
                    matrix(INTER, DIM, bits, gen, scales),
                )
                for e in range(N_EXPERTS)
            }
        }
    )


def routing(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, DIM, generator=gen)
    ids = torch.stack([torch.randperm(N_EXPERTS, generator=gen)[:TOPK] for _ in range(rows)])
    return x, torch.rand(rows, TOPK, generator=gen), ids


def reference(x, weights, ids, experts: ResidentExperts, limit=None) -> torch.Tensor:
    """The same arithmetic in torch: x and h rounded to int8 per block of 32, dequantised weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        for slot, e in enumerate(ids[r].tolist()):
            ex = experts.acquire(0, [e])[e]
            xq = quantize_rows(x[r : r + 1])
            g, u = xq @ ex.w1.dequantize().T, xq @ ex.w3.dequantize().T
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            h = quantize_rows(torch.nn.functional.silu(g) * u)
            out[r] += (h @ ex.w2.dequantize().T)[0].double() * weights[r, slot].item()
    return out


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize(
    "bits, down_bits, scales", [(4, 4, SCALE_DTYPE), (8, 8, SCALE_DTYPE), (4, 8, SCALE_DTYPE), (4, 4, torch.bfloat16)]
)
def test_one_call_computes_the_reference_and_each_row_as_alone(rows, bits, down_bits, scales):
    experts = make_experts(bits, down_bits, scales)
    x, weights, ids = routing(rows)
    calls = []
    add = q8_experts.add_experts
    with int8_activations():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(moe, "add_experts", lambda *a, **k: calls.append(len(a[4])) or add(*a, **k))
            fused, _ = moe.routed_sum(x, weights, ids, experts, 0)

        def one_row(r):
            return moe.routed_sum(x[r : r + 1], weights[r : r + 1], ids[r : r + 1], experts, 0)[0]

        alone = torch.cat([one_row(r) for r in range(rows)])
    assert calls == [len(ids.unique())]  # one call for the layer's experts
    assert torch.equal(fused, alone)
    expected = reference(x, weights, ids, experts)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_kernel
def test_the_swiglu_limit_clamps_as_the_per_expert_path_does(monkeypatch):
    experts = make_experts()
    x, weights, ids = routing(6, seed=3)
    x = x * 40  # gate and up values beyond the limit
    with int8_activations():
        fused, _ = moe.routed_sum(x, weights, ids, experts, 0, limit=0.5)
        monkeypatch.setattr(moe, "fused_experts_handle", lambda *a: False)
        plain, _ = moe.routed_sum(x, weights, ids, experts, 0, limit=0.5)
    unclamped, _ = moe.routed_sum(x, weights, ids, experts, 0)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6 * plain.abs().max().item())
    torch.testing.assert_close(fused, reference(x, weights, ids, experts, limit=0.5), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(fused, unclamped, rtol=1e-2)


@needs_kernel
def test_a_prefill_too_big_for_one_work_area_is_split_over_calls_with_the_same_sum(monkeypatch):
    experts = make_experts()
    x, weights, ids = routing(40, seed=5)
    with int8_activations():
        whole, _ = moe.routed_sum(x, weights, ids, experts, 0)
        monkeypatch.setattr(q8_experts, "MAX_WORK_BYTES", 8 * 4 * (2 * INTER + DIM))  # ~8 rows per call
        sizes = []
        call = q8_experts._kernels.q8_moe
        monkeypatch.setattr(q8_experts._kernels, "q8_moe", lambda *a: sizes.append(a[8]) or call(*a))
        split, _ = moe.routed_sum(x, weights, ids, experts, 0)
    assert len(sizes) > 2 and sum(sizes) == len(ids.unique())
    assert torch.equal(whole, split)


class Streaming(ResidentExperts):
    """Experts 'still loading' until they are indexed: the MoE layer computes what is here first.
    ``loading(ids)`` picks the misses among an acquire's ids (default: all but the first two)."""

    def __init__(self, experts, loading=lambda ids: ids[2:]):
        super().__init__(experts)
        self.loading = loading

    def acquire(self, layer, expert_ids):
        got = super().acquire(layer, expert_ids)
        pending = set(self.loading(list(expert_ids)))

        class Acquired(dict):
            def ready(self, expert):
                return expert not in pending

            def __getitem__(self, expert):
                pending.discard(expert)
                return dict.__getitem__(self, expert)

        return Acquired(got)


@needs_kernel
def test_experts_still_loading_are_computed_after_those_in_memory_with_the_same_sum(monkeypatch):
    x, weights, ids = routing(5, seed=9)
    resident, streaming = make_experts(), Streaming(make_experts()._experts)
    batches = []
    add = q8_experts.add_experts
    monkeypatch.setattr(moe, "add_experts", lambda *a, **k: batches.append(list(a[4])) or add(*a, **k))
    with int8_activations():
        expected, _ = moe.routed_sum(x, weights, ids, resident, 0)
        batches.clear()
        got, _ = moe.routed_sum(x, weights, ids, streaming, 0)
    wanted = sorted(ids.unique().tolist())
    assert batches[0] == wanted[:2] and [e for b in batches for e in b] == wanted and len(batches) == len(wanted) - 1
    assert torch.equal(got, expected)


@needs_kernel
def test_experts_in_memory_after_one_still_loading_are_computed_before_it_is_waited_for(monkeypatch):
    x, weights, ids = routing(5, seed=9)
    wanted = sorted(ids.unique().tolist())
    streaming = Streaming(make_experts()._experts, loading=lambda chunk: chunk[0::3])  # misses: 0th, 3rd, ...
    batches = []
    add = q8_experts.add_experts
    monkeypatch.setattr(moe, "add_experts", lambda *a, **k: batches.append(list(a[4])) or add(*a, **k))
    with int8_activations():
        expected, _ = moe.routed_sum(x, weights, ids, make_experts(), 0)
        batches.clear()
        got, _ = moe.routed_sum(x, weights, ids, streaming, 0)
    misses = wanted[0::3]
    assert batches[0] == [e for e in wanted if e not in misses]  # every hit, past the loading ones
    assert batches[1:] == [[e] for e in misses]  # then each miss alone, lowest first
    assert torch.equal(got, expected)  # the float64 sum: the same bits in any order


@needs_kernel
def test_float_activations_and_float_experts_keep_their_own_path(monkeypatch):
    x, weights, ids = routing(3)
    monkeypatch.setattr(q8_experts, "add_experts", lambda *a, **k: pytest.fail("fused call outside int8 activations"))
    monkeypatch.setattr(moe, "add_experts", q8_experts.add_experts)
    quantised = make_experts()
    moe.routed_sum(x, weights, ids, quantised, 0)  # float activations
    gen = torch.Generator().manual_seed(1)
    shapes = [(INTER, DIM), (DIM, INTER), (INTER, DIM)]
    floats = ResidentExperts(
        {0: {e: ExpertWeights(*(torch.randn(s, generator=gen) for s in shapes)) for e in range(N_EXPERTS)}}
    )
    with int8_activations():
        moe.routed_sum(x, weights, ids, floats, 0)  # float experts: not the q8 kernel's
    assert not q8_experts.fused_experts_handle([quantised.acquire(0, [0])[0], floats.acquire(0, [0])[0]], x)
