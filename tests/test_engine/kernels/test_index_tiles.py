"""A long prompt's DSA indexer scores in C (engine/kernels/decode_ops.py index_tile_scores): products, ReLU and
the head sum for query rows against keys stored as columns, with no mask and no top-k (engine/mla/index_blocks.py
keeps those). Shapes off every vector width (heads past a multiple of 8, dims and key counts that divide nothing),
column slices of a wider key matrix, an output wider than the keys; against float64, and the vector paths byte
for byte against the plain C loop (tools/kernel_bits_harness.c holds NEON to the same bytes)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import decode_ops, native

pytestmark = pytest.mark.skipif(not native.BUILT, reason="engine.kernels._kernels was not built")

# (rows, heads, dim, keys): the demo's indexer (16 x 32), DeepSeek-V3.2's (64 x 128), odd ones, one of each
SHAPES = [(5, 16, 32, 300), (2, 64, 128, 513), (3, 13, 20, 7), (4, 8, 7, 33), (1, 1, 1, 1), (7, 19, 33, 40)]
SHAPES += [(3, 5, 9, 32)]  # keys exactly one AVX-512 step (2 x 16), no tail


def reference(q: torch.Tensor, weights: torch.Tensor, keys_t: torch.Tensor, scale: float) -> torch.Tensor:
    """[S, W] in float64: sum_h weights[s, h] * relu(scale * q[s, h] . keys_t[:, t])."""
    products = torch.einsum("shd,dt->sht", q.double(), keys_t.double()) * scale
    return torch.einsum("sh,sht->st", weights.double(), products.relu())


def inputs(rows: int, heads: int, dim: int, keys: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, dim, generator=gen)
    weights = torch.randn(rows, heads, generator=gen)
    wide_keys_t = torch.randn(dim, keys + 9, generator=gen)  # the keys scored are columns 4 .. 4 + keys
    return q, weights, wide_keys_t[:, 4 : 4 + keys]


@pytest.mark.parametrize(("rows", "heads", "dim", "keys"), SHAPES)
def test_scores_equal_float64_within_rounding_and_the_plain_loop_byte_for_byte(rows, heads, dim, keys):
    q, weights, keys_t = inputs(rows, heads, dim, keys, seed=rows * 1000 + keys)
    scale = dim**-0.5
    out = torch.full((rows, keys + 3), 7.0)  # wider than the keys: the columns past them stay untouched
    fast = decode_ops.index_tile_scores(q, weights, keys_t, scale, out)[:, :keys].clone()
    plain = decode_ops.index_tile_scores(q, weights, keys_t, scale, torch.empty(rows, keys), simd=False)
    want = reference(q, weights, keys_t, scale)
    assert (fast.double() - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
    assert torch.equal(fast, plain)
    assert torch.equal(out[:, keys:], torch.full((rows, 3), 7.0))


def test_the_threads_split_leaves_the_bytes_alone():
    """Blocks of (row, 256 keys) over one thread or two: the same bytes (each score is computed whole by one)."""
    q, weights, keys_t = inputs(9, 16, 32, 1000, seed=5)
    held = torch.get_num_threads()  # the kernels' threads outside a forward pass (rows.kernel_threads)
    try:
        torch.set_num_threads(1)
        one = decode_ops.index_tile_scores(q, weights, keys_t, 0.25, torch.empty(9, 1000))
        torch.set_num_threads(2)
        two = decode_ops.index_tile_scores(q, weights, keys_t, 0.25, torch.empty(9, 1000))
    finally:
        torch.set_num_threads(held)
    assert torch.equal(one, two)


def test_relu_zeroes_a_negative_head_and_a_nan_key_stays_its_own():
    """A head whose product is negative adds nothing (ReLU), in every lane of a vector and in the tail; a NaN
    in one key makes that key's score NaN and no other's."""
    heads, dim, keys = 9, 4, 37
    q = torch.ones(1, heads, dim)
    q[0, 3] = -1.0  # head 3 sees the negative of every key's sum
    weights = torch.ones(1, heads)
    keys_t = torch.ones(dim, keys)
    keys_t[:, 20] = float("nan")
    out = decode_ops.index_tile_scores(q, weights, keys_t, 1.0, torch.empty(1, keys))
    assert torch.isnan(out[0, 20])
    others = torch.cat([out[0, :20], out[0, 21:]])
    assert torch.equal(others, torch.full((keys - 1,), 8.0 * dim))  # 8 heads of +4, head 3 ReLU'd to 0


def test_keys_that_are_not_columns_are_refused():
    q, weights, keys_t = inputs(2, 8, 16, 40, seed=1)
    with pytest.raises(ValueError, match="not row-major"):
        decode_ops.index_tile_scores(q, weights, keys_t.t().contiguous().t(), 1.0, torch.empty(2, 40))
