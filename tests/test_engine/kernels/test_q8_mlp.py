"""One SwiGLU MLP in one C call (engine/kernels/q8.py q8_mlp): what a shared expert or a dense layer's FFN computes
on the int8 path, at odd widths, row by row as alone, clamped as V4's; and on the float32 path's decode rows
with bf16 weights (the bf16 kernel's products, C's SwiGLU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.kernels.q8
from engine.core.layers import MLP
from engine.kernels import decode_ops
from engine.kernels.bf16 import Bf16Linear, bf16_kernel_available
from engine.kernels.int8_dense import CodedLinear
from engine.kernels.modes import int8_activations
from engine.kernels.q8 import q8_mlp
from engine.kernels.quant import int4_kernel_available, quantized_matrix
from engine.kernels.rows import rows_alone

needs_kernel = pytest.mark.skipif(not int4_kernel_available(), reason="engine.kernels._kernels was not built")


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
def test_it_declines_float_weights_and_int8_records_without_int8_activations():
    mlp = int8_mlp(64, 96, 32)
    x = torch.randn(1, 64)
    assert q8_mlp(mlp.w1, mlp.w2, mlp.w3, x) is None  # int8 activations off: the modules compute in float
    float_mlp = MLP(64, 96)
    with int8_activations():
        assert q8_mlp(float_mlp.w1, float_mlp.w2, float_mlp.w3, x) is None
        assert q8_mlp(mlp.w1, mlp.w2, mlp.w3, x.double()) is None
        assert q8_mlp(mlp.w1, mlp.w2, mlp.w3, x) is not None


def bf16_mlp(dim: int, inter: int, limit: float | None = None) -> MLP:
    gen = torch.Generator().manual_seed(dim + inter)
    mlp = MLP(dim, inter, limit)
    for name, shape in (("w1", (inter, dim)), ("w3", (inter, dim)), ("w2", (dim, inter))):
        setattr(mlp, name, Bf16Linear((torch.randn(*shape, generator=gen) * 0.05).bfloat16()))
    return mlp


@needs_kernel
@pytest.mark.skipif(not bf16_kernel_available(), reason="no SIMD path for the bf16 kernel: bf16 weights stay float32")
@pytest.mark.parametrize(("dim", "inter", "limit"), [(200, 136, None), (256, 96, None), (128, 64, 0.05)])
def test_a_float_decode_row_of_bf16_weights_takes_one_call_with_the_bf16_kernels_products(
    dim, inter, limit, monkeypatch
):
    """The float32 path's shared expert / dense MLP: gate, up and down are the kernel's products
    Bf16Linear computes (bit for bit), the SwiGLU C's; a prompt's rows keep torch's."""
    mlp = bf16_mlp(dim, inter, limit)
    x = torch.randn(1, 1, dim, generator=torch.Generator().manual_seed(dim)) * (20 if limit else 2)
    calls = []
    real = engine.kernels.q8._kernels.q8_mlp
    monkeypatch.setattr(engine.kernels.q8._kernels, "q8_mlp", lambda *a: calls.append(a) or real(*a))
    fused = mlp(x)
    assert len(calls) == 1
    gate, up = mlp.w1(x), mlp.w3(x)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    h = (gate.double() / (1 + torch.exp(-gate.double())) * up.double()).float()  # SwiGLU to float rounding
    expected = mlp.w2(h)
    assert (fused - expected).abs().max() <= 1e-5 * expected.abs().max()
    with decode_ops.torch_ops():
        assert torch.equal(mlp(x), module_path(mlp, x))  # the module path: torch's silu
    rows = torch.cat([x, x * 0.5, x * -1.5], dim=1)  # a prompt's three rows: torch's ops
    assert torch.equal(mlp(rows), module_path(mlp, rows))
    with rows_alone():  # three decode rows of a batch: each its solo bits
        together = mlp(rows)
    for r in range(3):
        assert torch.equal(together[:, r : r + 1], mlp(rows[:, r : r + 1]))


@needs_kernel
def test_int8_records_on_a_float_decode_row_keep_the_module_path():
    """Without int8 activations CodedLinear computes in float; the C call would quantise x."""
    mlp = int8_mlp(200, 136, 32)
    x = torch.randn(1, 1, 200, generator=torch.Generator().manual_seed(3))
    assert torch.equal(mlp(x), module_path(mlp, x))
