"""The int4 C kernel against dequantise-then-matmul, and the torch fallback when it is missing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import quant
from engine.kernels.quant import (
    QuantizedExpert,
    dequantize_torch,
    int4_kernel_available,
    kernel_matmul,
    quantized_matrix,
)

needs_kernel = pytest.mark.skipif(not int4_kernel_available(), reason="engine.kernels._kernels was not built")


@needs_kernel
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("isa", ["best", "scalar"], ids=["simd", "scalar"])
def test_kernel_equals_dequantise_then_matmul(group, rows, isa):
    gen = torch.Generator().manual_seed(group * 10 + rows)
    w = torch.distributions.StudentT(4.0).sample((96, 256)) * 0.05
    m = quantized_matrix(w, 4, group)
    x = torch.randn(rows, 256, generator=gen)
    expected = F.linear(x, m.dequantize())
    got = kernel_matmul(x, m, isa=isa)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_kernel
def test_kernel_rejects_shapes_it_cannot_do():
    m = quantized_matrix(torch.randn(8, 64), 4, 32)
    with pytest.raises(ValueError, match="unsupported shape"):
        kernel_matmul(torch.randn(9, 64), m)  # more rows than the kernel blocks


def test_quantised_expert_without_the_kernel_gives_the_same_output(monkeypatch):
    gen = torch.Generator().manual_seed(0)

    def matrix(out_dim, in_dim):
        return quantized_matrix(torch.randn(out_dim, in_dim, generator=gen) * 0.05, 4, 64)

    expert = QuantizedExpert(matrix(128, 64), matrix(64, 128), matrix(128, 64))
    x = torch.randn(1, 64, generator=gen)
    fast = expert(x)
    monkeypatch.setattr(quant, "_kernels", None)
    slow = expert(x)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    many = torch.randn(20, 64, generator=gen)  # prefill-sized: always the dequantise path
    torch.testing.assert_close(expert(many)[:1], expert(many[:1]), rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("group", [32, 64, 128])
def test_c_dequantiser_is_bit_identical_to_the_torch_reference(group):
    m = quantized_matrix(torch.distributions.StudentT(4.0).sample((64, 256)) * 0.05, 4, group)
    assert torch.equal(m.dequantize(), dequantize_torch(m))
    assert torch.equal(m.dequantize(torch.bfloat16), dequantize_torch(m, torch.bfloat16))


@needs_kernel
def test_kernel_splits_rows_across_threads_and_survives_fork():
    """Two threads give the same result as one; a forked child (no helper thread) still computes."""
    import os

    m = quantized_matrix(torch.randn(1024, 512) * 0.05, 4, 64)
    x = torch.randn(1, 512)
    expected = F.linear(x, m.dequantize())
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.testing.assert_close(kernel_matmul(x, m), expected, rtol=1e-5, atol=1e-5)
        pid = os.fork()
        if pid == 0:  # child: must not wait for the parent's helper thread
            ok = torch.allclose(kernel_matmul(x, m), expected, rtol=1e-5, atol=1e-5)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(previous)


@needs_kernel
def test_split_calls_from_several_python_threads_each_get_their_own_result():
    """Four Python threads call the kernels at once (the GIL is released inside): the split's jobs are
    taken one at a time and a helper never computes a block of another call's job."""
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(7)
    mats = [quantized_matrix(torch.randn(1024 + 64 * i, 256, generator=gen) * 0.05, 4, 64) for i in range(4)]
    xs = [torch.randn(1, 256, generator=gen) for _ in mats]
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [kernel_matmul(x, m) for x, m in zip(xs, mats, strict=True)]
        torch.set_num_threads(2)

        def repeat(i: int) -> bool:
            return all(torch.equal(kernel_matmul(xs[i], mats[i]), alone[i]) for _ in range(200))

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(repeat, range(4)))
    finally:
        torch.set_num_threads(previous)
