"""bf16 dense weights computed in float32: the C kernel, Bf16Linear, and a bf16 container's model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import bf16
from engine.kernels.bf16 import Bf16Linear, bf16_kernel_available, bf16_matmul

needs_kernel = pytest.mark.skipif(not bf16_kernel_available(), reason="engine.kernels._kernels was not built")


def _weight(out_dim: int, in_dim: int, seed: int) -> torch.Tensor:
    return (torch.randn(out_dim, in_dim, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()


@needs_kernel
@pytest.mark.parametrize("in_dim", [256, 160, 200])  # a multiple of 64 (AVX-512), of 32 (AVX2), neither
@pytest.mark.parametrize("out_dim", [96, 1024])  # 1024: the helper thread takes half the outputs
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("isa", ["best", "avx2", "scalar"])
def test_kernel_equals_float32_matmul_of_the_upcast_weight(in_dim, out_dim, rows, isa):
    w = _weight(out_dim, in_dim, rows)
    x = torch.randn(rows, in_dim, generator=torch.Generator().manual_seed(7))
    expected = F.linear(x, w.float())
    got = bf16_matmul(x, w, isa=isa)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("alone", [False, True])
def test_kernel_takes_any_rows_with_the_bits_of_one_call_per_8_rows(alone):
    w = _weight(1030, 200, 3)  # the helper thread takes part of the outputs, a lone last block row
    x = torch.randn(21, 200, generator=torch.Generator().manual_seed(4))
    by_8 = torch.cat([bf16_matmul(rows, w, alone=alone) for rows in x.split(8)])
    assert torch.equal(bf16_matmul(x, w, alone=alone), by_8)
    assert torch.equal(bf16_matmul(x[8:], w, alone=alone)[:8], by_8[8:16])  # a row's bits: its group of 8
    with pytest.raises(ValueError, match="unsupported shape"):
        bf16._kernels.bf16_gemm(w.data_ptr(), x.data_ptr(), 0, 0, 200, 1030, 2)


@needs_kernel
def test_a_prompts_rows_take_the_kernel_up_to_its_limit_and_the_upcast_matmul_beyond(monkeypatch):
    w = _weight(64, 96, 5)
    x = torch.randn(bf16.PROMPT_KERNEL_ROWS + 1, 96, generator=torch.Generator().manual_seed(6))
    within = x[: bf16.PROMPT_KERNEL_ROWS]
    assert torch.equal(Bf16Linear(w)(within), bf16_matmul(within, w))
    assert torch.equal(Bf16Linear(w)(x), F.linear(x, w.float()))


@pytest.mark.parametrize("shape", [(1, 1, 128), (2, 5, 128), (1, 40, 128)], ids=["decode", "few-rows", "prefill"])
def test_bf16_linear_equals_linear_over_the_upcast_weight(shape, monkeypatch):
    """Any rows, any leading dims; the prefill path upcasts blocks of 7 output rows here."""
    monkeypatch.setattr(bf16, "UPCAST_BLOCK_BYTES", 7 * 128 * 4)
    w = _weight(50, 128, 1)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    expected = F.linear(x, w.float())
    got = Bf16Linear(w)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_bf16_linear_refuses_other_dtypes():
    with pytest.raises(TypeError, match="bfloat16"):
        Bf16Linear(torch.zeros(4, 4))


@needs_kernel
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "glm_moe_dsa"])
def test_bf16_container_keeps_linears_in_bf16_with_the_same_tokens(make_container, family, monkeypatch):
    """A container with bf16 dense arrays (convert's default): its Linears stay bf16 (wkv_b and the
    indexer's weights_proj excepted), half the bytes, and logits/greedy ids equal the model whose
    weights were upcast at load."""
    from colibri_stream.devtools import fixtures
    from colibri_stream.runtime.generate import generate
    from colibri_stream.runtime.loader import load_container

    path = make_container(family, dense="bf16")
    held = load_container(path)
    monkeypatch.setattr("colibri_stream.planning.placement.bf16_kernel_available", lambda: False)
    upcast = load_container(path)
    kinds = {name: type(m).__name__ for name, m in held.model.named_modules() if name.endswith(("wkv_b", "wo", "head"))}
    assert kinds["head"] == "Bf16Linear" and kinds["layers.0.attn.wo"] == "Bf16Linear"
    assert kinds["layers.0.attn.wkv_b"] == "Linear"
    held_bytes, upcast_bytes = (sum(p.nbytes for p in m.model.parameters()) for m in (held, upcast))
    assert held_bytes < 0.7 * upcast_bytes
    ids = fixtures.make_prompt(held.args.vocab_size, 24, seed=5)
    with torch.no_grad():
        logits = [m.model(torch.tensor([ids]), 0, m.model.new_cache(), m.experts)[0] for m in (held, upcast)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert generate(held.model, ids, 12, held.experts).ids == generate(upcast.model, ids, 12, upcast.experts).ids
