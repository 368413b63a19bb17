"""Quantisation primitives and quality measures."""

from __future__ import annotations

import pytest
import torch

from colibri_stream.convert.quality import mean_kl, relative_error, top1_agreement
from engine.kernels.quant import QuantizedMatrix, quantize, quantized_matrix


@pytest.mark.parametrize("bits", [4, 8])
def test_requantising_a_dequantised_matrix_gives_the_same_bytes(bits):
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    m = quantized_matrix(w, bits, 32)
    m2 = quantized_matrix(m.dequantize(), bits, 32)
    assert torch.equal(m.q, m2.q) and torch.equal(m.scales, m2.scales)


def test_int4_packing_is_low_nibble_first():
    w = torch.tensor([[7.0, -7.0, 0.0, 7.0]])  # one group: scale 1
    q, scales = quantize(w, 4, 4)
    assert scales.item() == 1.0
    assert q.tolist() == [[(15) | (1 << 4), 8 | (15 << 4)]]
    assert QuantizedMatrix(q, scales, "int4", 4, 4).dequantize().tolist() == w.tolist()


def test_zero_groups_and_extremes_survive():
    w = torch.zeros(2, 64)
    w[1, :32] = torch.linspace(-3, 3, 32)
    out = quantized_matrix(w, 4, 32).dequantize()
    assert torch.equal(out[0], torch.zeros(64)) and out[1, 0].item() == pytest.approx(-3, rel=1e-3)


def test_smaller_groups_and_more_bits_reduce_error():
    w = torch.distributions.StudentT(4.0).sample((64, 256)) * 0.02
    assert relative_error(w, 4, 32) < relative_error(w, 4, 128) < 0.25
    assert relative_error(w, 8, 64) < relative_error(w, 4, 64) / 10


def test_agreement_and_kl():
    a = torch.randn(10, 50, generator=torch.Generator().manual_seed(1))
    assert top1_agreement(a, a) == 1.0 and mean_kl(a, a) == pytest.approx(0.0, abs=1e-6)
    b = a + torch.randn(10, 50, generator=torch.Generator().manual_seed(2))
    assert mean_kl(a, b) > 0.01 and top1_agreement(a, -a) == 0.0
