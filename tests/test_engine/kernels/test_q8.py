"""int8 activations (engine/kernels/q8.py, engine/csrc/q8.c): the integer kernel computes exactly the function its
torch reference defines (x quantised per block of 32 columns, times the dequantised records), on the
widths and groups real checkpoints have and the ragged ones nobody planned for; each row is computed as
alone; the models that ask for it hold int8 dense records and route every int4/int8 matmul through it."""

from __future__ import annotations

import pytest
import torch

from colibri_stream.errors import ColibriError
from colibri_stream.runtime.loader import load, load_container
from engine.kernels.int8_dense import CodedLinear
from engine.kernels.modes import activations_are_int8, int8_activations
from engine.kernels.q8 import ISA_AVX2, ISA_BEST, ISA_SCALAR, q8_kernel_handles, q8_matmul, quantize_rows
from engine.kernels.quant import KERNEL_SCALES, QuantizedMatrix, int4_kernel_available, kernel_matmul, quantized_matrix

needs_kernel = pytest.mark.skipif(not int4_kernel_available(), reason="the C kernels are not built")

# (out, in, group, rows): a decode GEMV, odd widths with a partial last group and a partial last chunk, a group
# of 96 (blocks of two groups in one chunk), a prompt-sized batch beyond the float kernel's row limit
SHAPES = [(64, 2048, 64, 1), (130, 200, 32, 3), (7, 96, 96, 8), (33, 1000, 64, 5), (5, 40, 64, 2), (12, 256, 128, 19)]


def reference(x: torch.Tensor, m: QuantizedMatrix) -> torch.Tensor:
    return (quantize_rows(x).double() @ m.dequantize().double().T).float()


def run_q8(x, m, isa=ISA_BEST):
    return q8_matmul(x, m.q, m.scales, m.code, m.group_size, KERNEL_SCALES[m.scales.dtype], isa=isa)


@needs_kernel
@pytest.mark.parametrize("isa", [ISA_BEST, ISA_AVX2, ISA_SCALAR], ids=["best", "avx2", "scalar"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("out", "in_dim", "group", "rows"), SHAPES)
def test_kernel_computes_its_reference(out, in_dim, group, rows, bits, isa):
    gen = torch.Generator().manual_seed(out * in_dim + rows)
    m = quantized_matrix(torch.randn(out, in_dim, generator=gen) * 0.02, bits, group)
    x = torch.randn(rows, in_dim, generator=gen) * 3
    x[0, : min(32, in_dim)] = 0  # an all-zero block: scale 0, nothing divided by it
    expected = reference(x, m)
    got = run_q8(x, m, isa)
    assert (got - expected).abs().max() <= 2e-6 * expected.abs().max()
    if isa == ISA_AVX2:  # maddubs and VNNI's dpbusd sum the same exact integers: the same bytes
        assert torch.equal(got, run_q8(x, m))


@needs_kernel
def test_bf16_scales_and_every_row_alone():
    """bf16 group scales (compressed-tensors pack-quantized) and batch invariance: each row of a 9-row
    call is bit-identical to that row computed alone."""
    gen = torch.Generator().manual_seed(1)
    fp16 = quantized_matrix(torch.randn(100, 160, generator=gen) * 0.02, 4, 32)
    m = QuantizedMatrix(fp16.q, fp16.scales.to(torch.bfloat16), "int4", 32, 160)
    x = torch.randn(9, 160, generator=gen)
    together = run_q8(x, m)
    assert (together - reference(x, m)).abs().max() <= 2e-6 * together.abs().max()
    for r in range(9):
        assert torch.equal(together[r : r + 1], run_q8(x[r : r + 1], m))


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_rows_past_a_tile_are_each_computed_as_alone(bits):
    """A prompt window's rows go through the kernel a tile at a time (q8.c Q8_ROW_TILE, 16): 37 rows are
    two full tiles and a ragged one (odd for both row steps, 2 and 4), and each row's bytes are its own
    call's, AVX2's and VNNI's alike, over 70 output rows (not a multiple of the 4-row blocks)."""
    gen = torch.Generator().manual_seed(bits)
    m = quantized_matrix(torch.randn(70, 1000, generator=gen) * 0.02, bits, 64)
    x = torch.randn(37, 1000, generator=gen)
    together = run_q8(x, m)
    assert (together - reference(x, m)).abs().max() <= 2e-6 * together.abs().max()
    assert torch.equal(run_q8(x, m, ISA_AVX2), together)  # maddubs and dpbusd: the same exact integer sums
    for r in (0, 15, 16, 17, 31, 32, 36):
        assert torch.equal(together[r : r + 1], run_q8(x[r : r + 1], m)), r


@needs_kernel
def test_matmul_takes_the_integer_kernel_only_inside_the_context():
    gen = torch.Generator().manual_seed(2)
    m = quantized_matrix(torch.randn(48, 192, generator=gen) * 0.02, 4, 64)
    x = torch.randn(3, 192, generator=gen)
    assert not activations_are_int8()
    assert torch.equal(m.matmul(x), kernel_matmul(x, m))
    with int8_activations():
        assert activations_are_int8()
        assert torch.equal(m.matmul(x), run_q8(x, m))
        with int8_activations(False):
            assert torch.equal(m.matmul(x), kernel_matmul(x, m))
    assert not activations_are_int8()
    # groups the kernel's blocks cannot hold (16) and bf16 activations keep the float paths
    assert not q8_kernel_handles("int4", 16, x)
    assert not q8_kernel_handles("int4", 64, x.bfloat16())
    assert not q8_kernel_handles("fp4", 32, x)


@needs_kernel
def test_int8_linear_kernel_equals_its_torch_fallback(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    m = quantized_matrix(torch.randn(70, 136, generator=gen) * 0.02, 8, 64)
    layer = CodedLinear(m.q, m.scales, 64)
    x = torch.randn(2, 5, 136, generator=gen)
    fast = layer(x)
    monkeypatch.setattr("engine.kernels.int8_dense.q8_kernel_handles", lambda *a: False)
    slow = layer(x)
    assert fast.shape == (2, 5, 70)
    assert (fast - slow).abs().max() <= 2e-6 * slow.abs().max()
    with pytest.raises(TypeError, match="int8"):
        CodedLinear(m.q.float(), m.scales, 64)


@needs_kernel
def test_a_model_with_int8_activations_holds_int8_dense_and_stays_close(make_container):
    """int8 dense records stay int8 (every bias-free Linear but the attention's wkv_b), the float path of
    the same container dequantises them, and the two models' logits agree to activation rounding
    (deepseek_v3: no DSA top-k for the rounding to flip)."""
    path = make_container("deepseek_v3", "int4", "int8")
    exact, fast = load_container(path), load_container(path, int8_activations=True)
    held = {name for name, module in fast.model.named_modules() if isinstance(module, CodedLinear)}
    assert "head" in held and "layers.0.attn.wq_a" in held and "layers.1.ffn.shared_experts.w2" in held
    assert not any(name.endswith("wkv_b") for name in held)
    assert not any(isinstance(module, CodedLinear) for module in exact.model.modules())
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    a = exact.model(tokens, 0, exact.model.new_cache(), exact.experts)
    b = fast.model(tokens, 0, fast.model.new_cache(), fast.experts)
    assert not torch.equal(a, b)  # the int8 path really ran
    assert (a - b).abs().max() <= 0.1 * a.abs().max()


def test_int8_activations_need_float32_and_a_known_name(make_container):
    path = make_container("deepseek_v3", "int4", "int8")
    with pytest.raises(ColibriError, match="--dtype float32"):
        load(path, "bfloat16", activations="int8")
    with pytest.raises(ColibriError, match="expected one of float32, int8"):
        load(path, "float32", activations="int4")
