"""The C kernels for every 4-bit record kind (int4 / fp4 codes; float16 / bfloat16 / e8m0 scales) and
any width (odd, ragged last group, whole groups) against the torch reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from colibri_stream.bench.kernels import random_kind_matrix
from engine.kernels import quant
from engine.kernels.quant import (
    E8M0,
    QuantizedMatrix,
    _kernel_handles,
    dequantize_torch,
    int4_kernel_available,
    kernel_matmul,
)

needs_kernel = pytest.mark.skipif(not int4_kernel_available(), reason="engine.kernels._kernels was not built")

# (code, scale dtype, group): our int4, compressed-tensors pack-quantized, MXFP4, and fp4 with float16
KINDS = {
    "int4-f16-g64": ("int4", torch.float16, 64),
    "int4-bf16-g32": ("int4", torch.bfloat16, 32),
    "fp4-e8m0-g32": ("fp4", E8M0, 32),
    "fp4-f16-g16": ("fp4", torch.float16, 16),
}
# odd: a padding nibble, and a last group of 55 / 23 / 7 columns; ragged: a last group of 8 columns
WIDTHS = {"odd": 119, "ragged": 200, "whole": 256}


def random_matrix(
    kind: str, in_dim: int, out_dim: int = 96, seed: int = 0, group: int | None = None
) -> QuantizedMatrix:
    """Random codes (the padding nibble of an odd width random too) and random scales."""
    code, scale_dtype, kind_group = KINDS[kind]
    return random_kind_matrix(
        code, scale_dtype, group or kind_group, out_dim, in_dim, torch.Generator().manual_seed(seed)
    )


@pytest.fixture(scope="module")
def matrices() -> dict[tuple[str, str], QuantizedMatrix]:
    return {(kind, w): random_matrix(kind, width, seed=len(w)) for kind in KINDS for w, width in WIDTHS.items()}


@needs_kernel
@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_kernel_takes_every_4bit_kind_and_width(matrices, kind, width):
    assert _kernel_handles(matrices[kind, width])


def test_int8_stays_on_the_torch_path():
    m = quant.quantized_matrix(torch.randn(8, 64), 8, 32)
    assert not _kernel_handles(m)


@needs_kernel
@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_c_dequantiser_is_bit_identical_for_every_kind(matrices, kind, width):
    m = matrices[kind, width]
    assert torch.equal(m.dequantize(), dequantize_torch(m))
    assert torch.equal(m.dequantize(torch.bfloat16), dequantize_torch(m, torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("isa", ["best", "scalar"], ids=["simd", "scalar"])
@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_kernel_matmul_equals_linear_over_the_reference(matrices, kind, width, isa, rows):
    m = matrices[kind, width]
    x = torch.randn(rows, m.in_dim, generator=torch.Generator().manual_seed(rows))
    expected = F.linear(x, dequantize_torch(m))
    got = kernel_matmul(x, m, isa=isa)
    assert got.shape == (rows, m.out_dim)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


# Group sizes by how a 64-column chunk meets its scales (engine/csrc/nibble.c scale_layout): 128 spans
# two chunks, 48 and 8 change scale inside a chunk at other places than 16 / 32 do, 6 is no multiple
# of 8 (the scalar path even when SIMD is asked for), 120 at width 119 is one group per row.
GROUPS = [256, 128, 48, 8, 6, 120]  # 256 and 128: one scale per 128-column chunk (broadcast)
# 119: odd, one chunk and a tail; 2113: odd, past the column block of 2+ rows (2048 columns or fewer);
# 8259: past the single row's block (8192 columns)
WIDE = [119, 2113, 8259]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("width", WIDE)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("kind", ["int4-bf16-g32", "fp4-e8m0-g32"])
def test_kernel_matmul_any_group_and_column_blocks(kind, group, width, rows):
    """Odd output counts (a lone last output row) and several column blocks, SIMD against scalar and
    the reference."""
    m = random_matrix(kind, width, out_dim=5, seed=group, group=group)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(width + rows))
    expected = F.linear(x, dequantize_torch(m))
    tolerance = {"rtol": 1e-5, "atol": 1e-5 * expected.abs().max().item()}
    torch.testing.assert_close(kernel_matmul(x, m), expected, **tolerance)
    torch.testing.assert_close(kernel_matmul(x, m, isa="scalar"), expected, **tolerance)


@needs_kernel
@pytest.mark.parametrize("kind", ["int4-f16-g64", "fp4-e8m0-g32"])
def test_padding_nibble_of_an_odd_row_contributes_nothing(kind):
    m = random_matrix(kind, 119, seed=3)
    other = m.q.clone()
    other[:, -1] ^= 0xF0  # only the high (padding) nibble of each row's last byte changes
    flipped = QuantizedMatrix(other, m.scales, m.code, m.group_size, m.in_dim)
    x = torch.randn(3, 119)
    assert torch.equal(flipped.dequantize(), m.dequantize())
    for isa in ("best", "scalar"):
        assert torch.equal(kernel_matmul(x, flipped, isa=isa), kernel_matmul(x, m, isa=isa))


@needs_kernel
def test_e8m0_extremes_decode_as_the_reference():
    """e = 0 is 2^-127 (a float32 subnormal), 254 is 2^127, 255 is NaN."""
    m = random_matrix("fp4-e8m0-g32", 64, out_dim=4)
    scales = torch.tensor([[0, 1], [127, 254], [255, 128], [126, 0]], dtype=torch.uint8)
    m = QuantizedMatrix(m.q, scales, "fp4", 32, 64)
    torch.testing.assert_close(m.dequantize(), dequantize_torch(m), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(kernel_matmul(torch.ones(1, 64), m)[0, 2])


@needs_kernel
@pytest.mark.parametrize("kind", ["int4-bf16-g32", "fp4-e8m0-g32"])
def test_kernel_reads_nothing_past_the_matrix(kind, guarded):
    """Codes and scales end on an unreadable page: an over-read would kill the (forked) child."""
    m = random_matrix(kind, 119, out_dim=5)
    pid = os.fork()
    if pid == 0:
        try:
            area_q, q = guarded(m.q.numel())
            area_s, s = guarded(m.scales.numel() * m.scales.element_size())
            q.copy_(m.q.flatten())
            s.copy_(m.scales.contiguous().view(torch.uint8).flatten())
            at_edge = QuantizedMatrix(q.view(m.q.shape), s.view(m.scales.dtype).view(m.scales.shape), m.code, 32, 119)
            x = torch.randn(8, 119)
            ok = torch.equal(at_edge.dequantize(), m.dequantize()) and all(
                torch.equal(kernel_matmul(x[:rows], at_edge, fs), kernel_matmul(x[:rows], m, fs))
                for rows in (1, 4, 8)
                for fs in (False, True)
            )
            os._exit(0 if ok else 3)
        except BaseException:  # noqa: BLE001 - any failure in the child is reported by its exit code
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@needs_kernel
def test_two_threads_split_a_ragged_fp4_matrix():
    m = random_matrix("fp4-e8m0-g32", 119, out_dim=1024, seed=5)
    x = torch.randn(2, 119)
    expected = F.linear(x, dequantize_torch(m))
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.testing.assert_close(
                kernel_matmul(x, m), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item()
            )
    finally:
        torch.set_num_threads(previous)


def _cpu_has_avx512vl() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return {"avx512f", "avx512vl", "avx512bw"} <= set(flags)


@needs_kernel
@pytest.mark.skipif(not _cpu_has_avx512vl(), reason="no AVX-512VL: 'best' is the AVX2 build itself")
@pytest.mark.parametrize("alone", [False, True])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_avx512_loops_give_the_avx2_loops_bits(matrices, kind, alone):
    """The 16-lane AVX-512 loops and the AVX2 loops (two 8-lane halves) do the same float operations per
    lane in the same order, so they give the same bits, for every scale layout (group 64, 32, 16, 24:
    lanes of two or more groups in a chunk; 256: one scale a chunk), width and row count; the scalar
    loops sum in another order (a check that the two builds really differ in path)."""
    ms = [matrices[kind, w] for w in WIDTHS]
    ms += [random_matrix(kind, 200, group=24), random_matrix(kind, 600, group=256)]
    gen = torch.Generator().manual_seed(5)
    for m in ms:
        for rows in range(1, 9):
            x = torch.randn(rows, m.in_dim, generator=gen)
            best = kernel_matmul(x, m, alone=alone)
            assert torch.equal(best, kernel_matmul(x, m, alone=alone, isa="avx2"))
    scalar = kernel_matmul(x, ms[-1], isa="scalar")
    assert not torch.equal(scalar, kernel_matmul(x, ms[-1], isa="avx2"))
