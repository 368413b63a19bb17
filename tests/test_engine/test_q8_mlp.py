"""One SwiGLU MLP with int8 activations in one C call (engine/q8.py q8_mlp): what a shared expert or a
dense layer's FFN computes on the int8 path, at odd widths, row by row as alone, clamped as V4's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.int8_dense import CodedLinear
from engine.layers import MLP
from engine.q8 import int8_activations, q8_mlp
from engine.quant import int4_kernel_available, quantized_matrix

needs_kernel = pytest.mark.skipif(not int4_kernel_available(), reason="engine._kernels was not built")


def int8_linear(out_dim: int, in_dim: int, group: int, gen: torch.Generator) -> CodedLinear:
    m = quantized_matrix(torch.randn(out_dim, in_dim, generator=gen) * 0.05, 8, group)
    return CodedLinear(m.q, m.scales, group)


def int8_mlp(dim: int, inter: int, group: int, limit: float | None = None) -> MLP:
    gen = torch.Generator().manual_seed(dim + inter)
    mlp = MLP(dim, inter, limit)
    mlp.w1, mlp.w3 = int8_linear(inter, dim, group, gen), int8_linear(inter, dim, group, gen)
    mlp.w2 = int8_linear(dim, inter, group, gen)
    return mlp


def module_path(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    """The three CodedLinear calls and torch's SwiGLU, as before the fused call."""
    gate, up = mlp.w1(x), mlp.w3(x)
    if mlp.limit is not None:
        gate, up = gate.clamp(max=mlp.limit), up.clamp(-mlp.limit, mlp.limit)
    return mlp.w2(F.silu(gate) * up)


@needs_kernel
@pytest.mark.parametrize(("dim", "inter", "group", "rows"), [(200, 136, 32, 1), (200, 136, 64, 5), (64, 96, 32, 3)])
def test_the_fused_mlp_computes_the_module_paths_function(dim, inter, group, rows):
    mlp = int8_mlp(dim, inter, group)
    x = torch.randn(1, rows, dim, generator=torch.Generator().manual_seed(rows)) * 2
    with int8_activations():
        fused, expected = mlp(x), module_path(mlp, x)
    assert fused.shape == x.shape
    # C's expf against torch's silu: a last-bit difference in h can move one int8 step of w2's input
    assert (fused - expected).abs().max() <= 2e-3 * expected.abs().max()
    assert not torch.equal(fused, torch.zeros_like(fused))


@needs_kernel
def test_each_row_gets_the_bits_it_gets_alone():
    mlp = int8_mlp(200, 136, 32)
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(1))
    with int8_activations():
        together = mlp(x)
        for r in range(4):
            assert torch.equal(together[r : r + 1], mlp(x[r : r + 1]))


@needs_kernel
def test_the_clamp_limits_gate_and_up_first():
    mlp = int8_mlp(64, 96, 32, limit=0.05)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2)) * 20  # large: the clamp bites
    with int8_activations():
        clamped, expected = mlp(x), module_path(mlp, x)
        mlp.limit = None
        unclamped = mlp(x)
    assert (clamped - expected).abs().max() <= 2e-3 * expected.abs().max()
    assert (clamped - unclamped).abs().max() > 10 * (clamped - expected).abs().max()


@needs_kernel
def test_it_declines_float_weights_and_float_activations():
    mlp = int8_mlp(64, 96, 32)
    x = torch.randn(1, 64)
    assert q8_mlp(mlp.w1, mlp.w2, mlp.w3, x) is None  # int8 activations off
    float_mlp = MLP(64, 96)
    with int8_activations():
        assert q8_mlp(float_mlp.w1, float_mlp.w2, float_mlp.w3, x) is None
        assert q8_mlp(mlp.w1, mlp.w2, mlp.w3, x.double()) is None
        assert q8_mlp(mlp.w1, mlp.w2, mlp.w3, x) is not None
