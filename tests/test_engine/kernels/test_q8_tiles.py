"""A prompt's rows as tile GEMMs (engine/csrc/q8_tiles.c): the products are the numbers q8_tiles.h states, the
AVX-512 and AMX paths give the plain C loop's bytes, a row's result is its own whatever else is in the call, and the
tile products differ from q8_gemm's (decoded rows) only in the order of the float sum."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine.kernels.modes import prompt_rows, rows_are_prompt
from engine.kernels.q8 import (
    BLOCK,
    ISA_AMX,
    ISA_BEST,
    ISA_SCALAR,
    TILES,
    amx_tiles,
    interleave,
    q8_isa,
    q8_matmul,
    quantized_blocks,
    tiles_fast,
)
from engine.kernels.quant import KERNEL_SCALES, QuantizedMatrix, int4_kernel_available, quantized_matrix

needs_kernel = pytest.mark.skipif(not int4_kernel_available(), reason="the C kernels are not built")

# (out, in, group, rows): partial last tile (37 outputs) with a partial last chunk and an odd width; rows past one
# pass of 64 (70); a width the interleaved layout takes; a single decode-sized row; one group per 512 columns
SHAPES = [(37, 101, 32, 5), (33, 130, 64, 70), (64, 1024, 64, 9), (20, 2048, 128, 1), (16, 512, 512, 3)]


def stated_numbers(x: torch.Tensor, m: QuantizedMatrix) -> torch.Tensor:
    """q8_tiles.h: acc = fma(float(dot_b), d[r, b] * s[o, g(b)], acc) block by block, in float32 (the product
    exact in float64, the sum rounded once there, then to float32)."""
    q, d = quantized_blocks(x)  # d [rows, blocks, 1]
    xq, d = q.to(torch.int64), d[..., 0]
    out, in_dim = m.out_dim, m.in_dim
    blocks = xq.shape[1]
    codes = m.q.to(torch.int64)
    if m.code == "int4":  # column 2j in the low nibble of byte j, value n - 8
        codes = torch.stack([(codes & 15) - 8, (codes >> 4) - 8], dim=-1).view(out, -1)[:, :in_dim]
    w = codes
    w = torch.nn.functional.pad(w, (0, blocks * BLOCK - in_dim)).view(out, blocks, BLOCK)
    scales = m.scales.float()
    acc = np.zeros((x.shape[0], out), dtype=np.float32)
    for b in range(blocks):
        dot = (xq[:, b] @ w[:, b].T).numpy().astype(np.float64)  # [rows, out], exact integers
        scale = (d[:, b, None] * scales[None, :, b * BLOCK // m.group_size]).numpy()  # float32 products
        acc = (dot * scale.astype(np.float64) + acc.astype(np.float64)).astype(np.float32)
    return torch.from_numpy(acc)


def run(x: torch.Tensor, m: QuantizedMatrix, isa: int, interleaved: bool = False) -> torch.Tensor:
    if not interleaved:
        return q8_matmul(x, m.q, m.scales, m.code, m.group_size, KERNEL_SCALES[m.scales.dtype], isa=isa)
    packed = interleave(m.q, m.scales, m.code, m.group_size)
    return q8_matmul(x, packed, m.scales, m.code, m.group_size, KERNEL_SCALES[m.scales.dtype], isa, m.out_dim)


def matrix(out: int, in_dim: int, group: int, bits: int, seed: int, bf16: bool = False) -> QuantizedMatrix:
    m = quantized_matrix(torch.randn(out, in_dim, generator=torch.Generator().manual_seed(seed)) * 0.02, bits, group)
    return QuantizedMatrix(m.q, m.scales.to(torch.bfloat16), m.code, group, in_dim) if bf16 else m


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("out", "in_dim", "group", "rows"), SHAPES)
def test_tile_products_are_the_stated_numbers_on_every_path(out, in_dim, group, rows, bits):
    m = matrix(out, in_dim, group, bits, seed=out * in_dim + rows, bf16=out % 2 == 1)
    x = torch.randn(rows, in_dim, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, : min(BLOCK, in_dim)] = 0  # an all-zero block: d = 0
    plain = run(x, m, ISA_SCALAR | TILES)
    assert torch.equal(plain, stated_numbers(x, m))
    assert torch.equal(run(x, m, ISA_BEST | TILES), plain)  # AVX-512 VNNI where the CPU has it
    assert torch.equal(run(x, m, ISA_AMX | TILES), plain)  # AMX where the CPU has it
    if in_dim % 512 == 0 and out % 4 == 0:  # the interleaved layout: the same codes, the same bytes
        assert torch.equal(run(x, m, ISA_BEST | TILES, interleaved=True), plain)
        assert torch.equal(run(x, m, ISA_AMX | TILES, interleaved=True), plain)


@needs_kernel
@pytest.mark.parametrize("isa", [ISA_BEST, ISA_AMX])
@pytest.mark.parametrize("bits", [4, 8])
def test_each_row_is_its_own_whatever_else_is_in_the_call(bits, isa):
    """130 rows: two full passes of 64 (AMX: eight groups of 16) and a ragged one, against 100 output rows (six
    tiles and a partial one)."""
    m = matrix(100, 1024, 64, bits, seed=bits)
    x = torch.randn(130, 1024, generator=torch.Generator().manual_seed(7))
    together = run(x, m, isa | TILES, interleaved=True)
    for r in (0, 5, 15, 16, 63, 64, 65, 127, 128, 129):
        assert torch.equal(together[r : r + 1], run(x[r : r + 1], m, isa | TILES, interleaved=True)), r
        assert torch.equal(together[r : r + 1], run(x[r : r + 1], m, isa | TILES)), r


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_tile_products_differ_from_decoded_rows_only_in_the_order_of_the_sum(bits):
    m = matrix(64, 2048, 64, bits, seed=3)
    x = torch.randn(24, 2048, generator=torch.Generator().manual_seed(3))
    tiles, decoded = run(x, m, ISA_BEST | TILES), run(x, m, ISA_BEST)
    assert not torch.equal(tiles, decoded)  # the other order really ran
    assert (tiles - decoded).abs().max() <= 2e-6 * decoded.abs().max()


def test_the_isa_carries_tiles_only_inside_prompt_rows():
    assert q8_isa() == ISA_BEST and not rows_are_prompt()
    with prompt_rows():
        assert q8_isa() == ISA_AMX | TILES
        with prompt_rows(False):
            assert q8_isa() == ISA_BEST
    assert q8_isa() == ISA_BEST


@needs_kernel
@pytest.mark.skipif(not tiles_fast(), reason="no AVX-512 VNNI: the tile GEMMs' vector path is not built for this CPU")
@pytest.mark.parametrize("isa", [ISA_BEST, ISA_AMX])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_vector_path_reads_nothing_past_the_matrix(bits, isa, guarded):
    """Codes and scales of a row-major matrix with a partial last chunk end on an unreadable page: the gathers and
    the tail copies must stay inside (an over-read kills the forked child)."""
    m = matrix(21, 119, 32, bits, seed=11)
    x = torch.randn(70, 119)  # AMX takes 64 rows or more
    want = run(x, m, ISA_SCALAR | TILES)
    pid = os.fork()
    if pid == 0:
        try:
            area_q, q = guarded(m.q.numel() * m.q.element_size())
            area_s, s = guarded(m.scales.numel() * m.scales.element_size())
            q.copy_(m.q.contiguous().view(torch.uint8).flatten())
            s.copy_(m.scales.contiguous().view(torch.uint8).flatten())
            codes = q.view(m.q.dtype).view(m.q.shape)
            at_edge = QuantizedMatrix(codes, s.view(m.scales.dtype).view(m.scales.shape), m.code, 32, 119)
            os._exit(0 if torch.equal(run(x, at_edge, isa | TILES), want) else 3)
        except BaseException:  # noqa: BLE001 - any failure in the child is reported by its exit code
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@needs_kernel
@pytest.mark.skipif(not amx_tiles(), reason="no AMX-INT8 here: the tile products' AMX path does not run")
def test_amx_gives_the_vector_paths_bytes_at_a_prompts_shapes():
    """A routed expert's rows at a 1024-token prompt's shapes (many rows, odd counts) and a dense projection (AMX
    takes calls of 64 rows or more: q8_tiles.c AMX_MIN_ROWS)."""
    for out, in_dim, rows, bits in ((1024, 2048, 97, 4), (2048, 1024, 65, 4), (576, 2048, 250, 8), (37, 101, 70, 8)):
        m = matrix(out, in_dim, 64, bits, seed=rows)
        x = torch.randn(rows, in_dim, generator=torch.Generator().manual_seed(out))
        assert torch.equal(run(x, m, ISA_AMX | TILES), run(x, m, ISA_BEST | TILES)), (out, in_dim, rows)
