"""The DSA indexer's choice over a long context as blocked GEMMs with a running top-k (engine/mla/indexer.py).

index[s, t] = sum_h w[s, h] * ReLU(scale * q[s, h] . k[t]) for queries at positions start.. against T keys,
then per query the topk positions, highest first, ties to the lower position, future positions -inf (so a
query that sees fewer than topk gets the lowest future ones as fillers, which attention masks out).

Per block of queries (Sq) the scores go into a slab of SLAB_KEYS keys, and each full slab is merged into the
running top-k, which gives the same positions in the same order as one stable sort of the whole row: in C where
the kernels run (engine/csrc/index_choose.c: per row only the scores that can enter ranked), else in torch (a
stable sort over the running K then the slab's positions). A slab is scored by the C kernel where it runs
(engine/csrc/index_select.c index_tile_scores: products, ReLU and the head sum in registers, the keys read as
columns of one transposed copy [D, T]), else by torch per key block (Tk): one matmul [Sq * H, D] x [D, Tk],
ReLU in place, the heads summed by one batched matmul with the weights [Sq, 1, H], the scale folded into the
weights (ReLU(scale x) = scale ReLU(x), scale > 0). The two are a rounding apart, and both a rounding apart
from the per-query kernel (engine/kernels decode_ops.index_select), which short contexts and decode keep
(Indexer.choose: BLOCKED_FROM_KEYS). Key blocks past a query block's last position are never computed.
Memory: one slab [Sq, SLAB_KEYS], the running [Sq, K] values and positions, the keys' copy [D, T] for the
kernel, one score block (<= SCORE_BYTES) for torch's, whatever T is.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.kernels import decode_ops
from engine.kernels.rows import products_on_threads

KEY_BLOCK = 256  # keys per score block
SCORE_BYTES = 2 << 20  # a score block [Sq, H, KEY_BLOCK] float32 within this (Sq at least 1)
# index scores held between merges into the running top-k: a demo-sized context (32k) is one slab, so one
# sort per query block; a compare and a compaction per slab past it (a slab's own sort would cost ~20 ns a
# score against the ~35 of its products)
SLAB_KEYS = 32768


def query_block(heads: int) -> int:
    """Queries per score block: [Sq, H, KEY_BLOCK] float32 within SCORE_BYTES."""
    return max(1, SCORE_BYTES // (heads * KEY_BLOCK * 4))


def slabs(seen: int, topk: int) -> list[slice]:
    """Keys [0, seen) in slabs of max(SLAB_KEYS, 4 x topk): within it one sort per query block (the first
    slab's); past it the running top-k's last scores filter each later slab."""
    width = max(SLAB_KEYS, 4 * topk)
    return [slice(start, min(start + width, seen)) for start in range(0, seen, width)]


def blocked_choice(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start_pos: int, scale: float, topk: int
) -> torch.Tensor:
    """One sequence: q [S, H, D] float32 (roped) at positions start_pos.., weights [S, H], keys [T, D] ->
    int64 [S, topk]; topk < T, start_pos + S <= T."""
    seqlen, heads, _ = q.shape
    in_c = decode_ops.index_select_takes(q, keys)
    scorer: SlabScores = _KernelScores(keys, scale) if in_c else _TorchScores(keys, scale)
    step = query_block(heads)
    chosen = []
    for first in range(0, seqlen, step):
        rows = min(step, seqlen - first)
        choice: RunningChoice = _KernelChoice(rows, topk) if in_c else _TorchChoice(topk)
        _choose_rows(q[first : first + rows], weights[first : first + rows], scorer, choice, start_pos + first)
        chosen.append(choice.positions())
    return torch.cat(chosen)


class SlabScores(Protocol):
    """Who fills a slab with index scores: over ``total`` keys, a slab [Sq, W] of keys first.. first + W."""

    total: int

    def fill(self, slab: torch.Tensor, q: torch.Tensor, weights: torch.Tensor, first: int) -> None: ...


class _KernelScores:
    """Slabs scored by the C kernel over one transposed copy of the keys."""

    def __init__(self, keys: torch.Tensor, scale: float):
        self.keys_t, self.scale = keys.t().contiguous(), scale  # [D, T]: a key block loads whole vectors
        self.total = keys.shape[0]

    def fill(self, slab: torch.Tensor, q: torch.Tensor, weights: torch.Tensor, first: int) -> None:
        decode_ops.index_tile_scores(q, weights, self.keys_t[:, first : first + slab.shape[1]], self.scale, slab)


class _TorchScores:
    """Slabs scored by torch's matmuls, KEY_BLOCK keys at a time."""

    def __init__(self, keys: torch.Tensor, scale: float):
        self.keys, self.scale, self.total = keys, scale, keys.shape[0]

    def fill(self, slab: torch.Tensor, q: torch.Tensor, weights: torch.Tensor, first: int) -> None:
        rows, heads, dim = q.shape
        flat, weighted = q.reshape(rows * heads, dim), (weights.float() * self.scale)[:, None, :]  # [Sq, 1, H]
        for begin in range(first, first + slab.shape[1], KEY_BLOCK):
            end = min(begin + KEY_BLOCK, first + slab.shape[1])
            with products_on_threads(rows * heads * (end - begin) * dim):
                scores = torch.mm(flat, self.keys[begin:end].t()).relu_().view(rows, heads, -1)
                slab[:, begin - first : end - first] = torch.bmm(weighted, scores)[:, 0]


class RunningChoice(Protocol):
    """A block of query rows' running top-k: slabs of their scores merged in key order."""

    topk: int

    def merge(self, slab: torch.Tensor, slab_start: int, start_pos: int) -> None:
        """slab [Sq, W] float32: the scores of keys slab_start.. (after every key merged before) for rows at
        positions start_pos..; a key after a row's position counts as -inf."""

    def positions(self) -> torch.Tensor:
        """int64 [Sq, topk]: each row's chosen positions, highest score first, ties to the lower position."""
        ...


class _KernelChoice:
    """The running top-k in C (engine/csrc/index_choose.c): rank keys [Sq, topk], only a slab's scores that
    can enter ranked."""

    def __init__(self, rows: int, topk: int):
        self.topk, self.merged = topk, False
        self.ranks = torch.empty(rows, topk, dtype=torch.int64)

    def merge(self, slab: torch.Tensor, slab_start: int, start_pos: int) -> None:
        decode_ops.index_tile_choose(slab, slab_start, start_pos, self.ranks, self.merged)
        self.merged = True

    def positions(self) -> torch.Tensor:
        return decode_ops.index_positions(self.ranks)


class _TorchChoice:
    """The running top-k in torch: (values, positions) [Sq, <= topk], a stable sort per merge."""

    def __init__(self, topk: int):
        self.topk = topk
        self.best: tuple[torch.Tensor, torch.Tensor] | None = None

    def merge(self, slab: torch.Tensor, slab_start: int, start_pos: int) -> None:
        if slab_start + slab.shape[1] > start_pos:  # the rows' own positions and those after: -inf past each
            _mask_future(slab, start_pos, slab_start)
        self.best = _merge(self.best, slab, slab_start, self.topk)

    def positions(self) -> torch.Tensor:
        assert self.best is not None, "no slab merged"
        return self.best[1]


def _choose_rows(
    q: torch.Tensor, weights: torch.Tensor, scorer: SlabScores, choice: RunningChoice, start_pos: int
) -> None:
    """A block of queries q [Sq, H, D] at positions start_pos.., every slab they may see merged into ``choice``."""
    rows = q.shape[0]
    # keys any of these rows may see, and at least topk (a row that sees fewer takes future fillers)
    seen = min(scorer.total, max(start_pos + rows, choice.topk))
    for keys_of_slab in slabs(seen, choice.topk):
        slab = torch.empty(rows, keys_of_slab.stop - keys_of_slab.start, dtype=torch.float32, device=q.device)
        scorer.fill(slab, q, weights, keys_of_slab.start)
        choice.merge(slab, keys_of_slab.start, start_pos)


def _mask_future(slab: torch.Tensor, start_pos: int, slab_start: int) -> None:
    """slab [Sq, W] of keys slab_start.. for rows at positions start_pos..: -inf where key > row (only keys
    after start_pos can be)."""
    rows, width = slab.shape
    first = max(start_pos + 1 - slab_start, 0)
    row_pos = torch.arange(start_pos, start_pos + rows, device=slab.device)[:, None]
    key_pos = torch.arange(slab_start + first, slab_start + width, device=slab.device)[None, :]
    slab[:, first:].masked_fill_(key_pos > row_pos, float("-inf"))


def _merge(
    best: tuple[torch.Tensor, torch.Tensor] | None, slab: torch.Tensor, slab_start: int, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The running top-k with a slab of keys slab_start.. (all after the running positions). Candidates in
    (running, in its order; the slab, by position): a stable sort over them ranks equal scores by position.

    Before that sort the slab is cut to the scores that can enter, in position order, so the sort sees a few
    per row, not the slab: past the first slab (every row holding topk finite scores) those above a row's
    last (an equal one loses to it on position); in the first, those at least the topk-th largest of the
    maxima of chunks of keys (topk distinct scores reach it, so the topk-th largest score does too)."""
    rows = slab.shape[0]
    positions = torch.arange(slab_start, slab_start + slab.shape[1], device=slab.device).expand(rows, -1)
    if best is None:
        floor = _chunk_floor(slab, topk)
        if floor is not None:
            slab, positions = _compact(slab.ge(floor[:, None]), slab, positions)
    elif best[0].shape[1] == topk and bool(best[0][:, -1].isfinite().all()):
        slab, positions = _compact(slab.gt(best[0][:, -1, None]), slab, positions)
    if best is not None:
        slab = torch.cat([best[0], slab], dim=1)
        positions = torch.cat([best[1], positions], dim=1)
    # a stable sort: equal scores keep their order (engine/core/layers.py stable_topk_indices' rule); cut,
    # the rows are short, so it sorts a few scores each
    keep = torch.sort(slab, dim=1, descending=True, stable=True).indices[:, :topk]
    return slab.gather(1, keep), positions.gather(1, keep)


CHUNK = 64  # keys per chunk maximum in the first slab's cut, at most


def _chunk_floor(slab: torch.Tensor, topk: int) -> torch.Tensor | None:
    """Per row the topk-th largest of the slab's chunk maxima [Sq] (no more than the row's topk-th largest
    score), chunks of up to CHUNK keys, at least 4 x topk of them; None when chunks would be under 4 keys
    (the cut would not pay) or a row has a NaN."""
    chunk = min(CHUNK, slab.shape[1] // (4 * topk))
    if chunk < 4:
        return None
    whole = slab.shape[1] // chunk
    maxima = slab[:, : whole * chunk].unfold(1, chunk, chunk).amax(-1)  # [Sq, whole]
    if slab.shape[1] > whole * chunk:
        maxima = torch.cat([maxima, slab[:, whole * chunk :].amax(1, keepdim=True)], dim=1)
    floor = maxima.topk(topk, dim=1).values[:, -1]
    return None if bool(floor.isnan().any()) else floor


def _compact(keep: torch.Tensor, slab: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the slab's scores where ``keep`` [Sq, W] and their positions, in position order, padded with
    -inf to the longest row: [Sq, <= W] each. A padded row has at least topk kept scores, all finite or all
    of it kept, so a pad never enters."""
    row, col = keep.nonzero(as_tuple=True)  # row-major: each row's in position order
    counts = torch.bincount(row, minlength=slab.shape[0])
    width = int(counts.max()) if row.numel() else 0
    rank = torch.arange(row.numel(), device=slab.device) - (counts.cumsum(0) - counts)[row]
    values = slab.new_full((slab.shape[0], width), float("-inf"))
    values[row, rank] = slab[row, col]
    kept = positions.new_zeros((slab.shape[0], width))
    kept[row, rank] = positions[row, col]
    return values, kept
