"""A long prompt's running top-k of the DSA indexer in C (engine/kernels/decode_ops.py index_tile_choose,
engine/csrc/index_choose.c): slabs of scores merged in key order must leave each row the positions one ranking of
its whole causal row gives (higher score first, a NaN above every number, -0 equal to +0, ties to the lower
position, keys after the row's own position as -inf fillers). Against a Python sort of the whole row, on scores
full of ties, infinities and NaNs, slabs that divide nothing, first slabs long enough for the chunk cut, rows that
see fewer than topk keys, and a slab narrower than its stride."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kernels import decode_ops, native

pytestmark = pytest.mark.skipif(not native.BUILT, reason="engine.kernels._kernels was not built")


def expected_choice(scores: torch.Tensor, position: int, topk: int) -> torch.Tensor:
    """Per row (at position + r) its topk positions by one sort of the whole row: keys after it count as -inf."""
    chosen = []
    for r, row in enumerate(scores.tolist()):
        own = position + r
        values = [v if t <= own else -math.inf for t, v in enumerate(row)]
        order = sorted(range(len(values)), key=lambda t: (not math.isnan(values[t]), -nan_free(values[t]), t))
        chosen.append(order[:topk])
    return torch.tensor(chosen)


def nan_free(value: float) -> float:
    return 0.0 if math.isnan(value) else value


def run_choice(scores: torch.Tensor, position: int, topk: int, widths: list[int]) -> torch.Tensor:
    """scores [S, T] merged slab by slab (widths, in key order) -> [S, topk] positions."""
    ranks = torch.empty(scores.shape[0], topk, dtype=torch.int64)
    first = 0
    for width in widths:
        decode_ops.index_tile_choose(scores[:, first : first + width], first, position, ranks, merged=first > 0)
        first += width
    assert first == scores.shape[1]
    return decode_ops.index_positions(ranks)


def tied_scores(rows: int, keys: int, seed: int) -> torch.Tensor:
    """Few distinct values (ties everywhere), some -inf, +0 and -0, a NaN or two."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (rows, keys), generator=gen).float()
    scores[torch.rand(rows, keys, generator=gen) < 0.05] = -math.inf
    scores[torch.rand(rows, keys, generator=gen) < 0.05] = -0.0
    scores[torch.rand(rows, keys, generator=gen) < 0.01] = math.nan
    return scores


# (rows, keys, position of row 0, topk, slab widths): one slab; several that divide nothing; a first slab long
# enough for the chunk cut (keys >= 16 topk) then short ones; rows from position 0 (fewer than topk keys seen:
# fillers); a whole slab after some rows' positions; topk = the first slab's width
CASES = [
    (6, 40, 34, 8, [40]),
    (5, 103, 98, 7, [30, 30, 30, 13]),
    (9, 900, 891, 11, [600, 250, 50]),
    (12, 20, 0, 9, [9, 11]),
    (4, 300, 100, 5, [200, 100]),
    (3, 17, 14, 17, [17]),
]


@pytest.mark.parametrize(("rows", "keys", "position", "topk", "widths"), CASES)
def test_slabs_merged_give_one_sorts_choice(rows, keys, position, topk, widths):
    scores = tied_scores(rows, keys, seed=keys + topk)
    assert torch.equal(run_choice(scores, position, topk, widths), expected_choice(scores, position, topk))


def test_real_valued_scores_through_the_chunk_cut_and_on_one_thread():
    """Normal scores over 5000 keys (a first slab of 4000: chunks of 62 keys, then 1000), 33 rows; the same
    positions on one thread as on the kernels' threads."""
    scores = torch.randn(33, 5000, generator=torch.Generator().manual_seed(3))
    expected = expected_choice(scores, 4967, 40)
    assert torch.equal(run_choice(scores, 4967, 40, [4000, 1000]), expected)
    threads = torch.get_num_threads()  # the kernels' threads where no forward pass set them
    torch.set_num_threads(1)
    try:
        assert torch.equal(run_choice(scores, 4967, 40, [4000, 1000]), expected)
    finally:
        torch.set_num_threads(threads)


def test_a_slab_narrower_than_its_stride_and_bad_shapes_are_refused():
    wide = tied_scores(4, 60, seed=1)
    scores = wide[:, 5:55]  # stride 60, width 50
    assert torch.equal(run_choice(scores, 46, 6, [50]), expected_choice(scores.contiguous(), 46, 6))
    ranks = torch.empty(4, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match="index_tile_choose"):
        decode_ops.index_tile_choose(scores[:, :5], 0, 46, ranks, merged=False)  # a first slab under topk
    with pytest.raises(ValueError, match="index_tile_choose"):
        decode_ops.index_tile_choose(scores, 0, 46, ranks[:3], merged=False)  # ranks for other rows
