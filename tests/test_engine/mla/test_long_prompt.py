"""Long-prompt prefill (engine/mla/index_blocks.py, engine/mla/prefill.py selected_blocks) against the unblocked
computations and against transformers.

- The indexer in blocked GEMMs with a running top-k, its slabs scored by the C kernel and by torch's matmuls
  (both forms each time): on integer-valued inputs (every product and sum exact in float32, ties everywhere)
  the same positions in the same order as one stable sort of the whole row; on
  real-valued inputs every chosen position within a rounding of the reference's top-k; odd lengths, key and
  query blocks that divide nothing, rows that see fewer than topk; its temporaries bounded by construction.
- MLA under a DSA selection (each query against its K chosen positions, gathered) against the whole-cache
  masked expanded path, in query blocks of 1 and more.
- Whole models with both paths forced on from the first key (and small blocks): transformers' logits and
  greedy tokens on the DSA families.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import engine.mla.index_blocks as index_blocks
import engine.mla.indexer as indexer_module
import engine.mla.prefill as prefill_attention
from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from engine.config.args import ModelArgs
from engine.core.cache import KVCache
from engine.core.layers import stable_topk_indices
from engine.core.rope import rope_tables
from engine.kernels import decode_ops, native
from engine.mla.attention import MLA
from engine.mla.index_blocks import blocked_choice, query_block, slabs
from tests.test_engine.mla.test_prefill_attention import ODD  # widths that divide neither 64 nor 32

HEADS, DIM = 16, 32


def _reference_scores(q, weights, keys, start_pos, scale):
    """The indexer's score rows as engine/mla/indexer.py's einsum form: [S, T], future positions -inf."""
    scores = torch.einsum("shd,td->sht", q, keys).mul_(scale).relu_()
    index = torch.einsum("sh,sht->st", weights, scores)
    rows = torch.arange(start_pos, start_pos + q.shape[0])[:, None]
    return index.masked_fill(torch.arange(keys.shape[0])[None] > rows, float("-inf"))


@pytest.fixture(params=["kernel", "torch"])
def scorer(request):
    """The blocked indexer's slabs scored and merged into the running top-k by the C kernels (index_tile_scores,
    index_tile_choose), then by torch."""
    if request.param == "kernel" and not native.BUILT:
        pytest.skip("engine.kernels._kernels was not built")
    with decode_ops.torch_ops() if request.param == "torch" else contextlib.nullcontext():
        yield request.param


@pytest.fixture
def odd_blocks(scorer, monkeypatch):
    """Key blocks of 37, slabs of 100 (or 4 x topk), query blocks of 11: no length below is a multiple."""
    monkeypatch.setattr(index_blocks, "KEY_BLOCK", 37)
    monkeypatch.setattr(index_blocks, "SLAB_KEYS", 100)
    monkeypatch.setattr(index_blocks, "SCORE_BYTES", 11 * HEADS * 37 * 4)
    return scorer


# (keys T, new positions S, topk): one key past topk; S = T from position 0 (rows seeing fewer than topk
# take future fillers); a chunk at the end of 1000+ keys; a single query
CASES = [(9, 9, 8), (65, 65, 8), (63, 1, 50), (1001, 63, 50), (1100, 40, 8)]


@pytest.mark.parametrize("total, seqlen, topk", CASES)
def test_integer_scores_give_the_stable_sorts_positions_in_its_order(odd_blocks, total, seqlen, topk):
    """Small integers: every score exact in both forms, many equal (ReLU's zeros and repeats), so the merge's
    tie order is what is tested; scale 1/4 is exact too."""
    gen = torch.Generator().manual_seed(total + seqlen)
    q = torch.randint(-2, 3, (seqlen, HEADS, DIM), generator=gen).float()
    keys = torch.randint(-1, 2, (total, DIM), generator=gen).float()
    weights = torch.randint(-2, 3, (seqlen, HEADS), generator=gen).float()
    start = total - seqlen
    expected = stable_topk_indices(_reference_scores(q, weights, keys, start, 0.25), topk)
    assert torch.equal(blocked_choice(q, weights, keys, start, 0.25, topk), expected)


@pytest.mark.parametrize("total, seqlen, topk", CASES)
def test_real_scores_choose_the_references_top_k(odd_blocks, total, seqlen, topk):
    """Normal inputs: each chosen position's reference score is at least the reference's topk-th (less a
    rounding), and the choice is in descending order of it; with no near-tie the same positions."""
    gen = torch.Generator().manual_seed(7 * total + seqlen)
    q, keys = torch.randn(seqlen, HEADS, DIM, generator=gen), torch.randn(total, DIM, generator=gen)
    weights = torch.randn(seqlen, HEADS, generator=gen)
    start, scale = total - seqlen, DIM**-0.5
    reference = _reference_scores(q, weights, keys, start, scale)
    chosen = blocked_choice(q, weights, keys, start, scale, topk)
    expected = stable_topk_indices(reference, topk)
    got, best = reference.gather(1, chosen), reference.gather(1, expected)
    tol = 1e-5 * reference[reference.isfinite()].abs().max().item()
    visible = best.isfinite()  # rows seeing fewer than topk: their fillers are -inf in both
    assert torch.equal(got.isfinite(), visible)
    assert (got[visible] - best[visible]).abs().max().item() <= tol
    assert ((got[:, 1:] <= got[:, :-1] + tol) | ~got[:, 1:].isfinite()).all()
    assert (chosen == expected).float().mean().item() >= 0.99


@pytest.mark.parametrize("integers", [True, False], ids=["integers", "normal"])
@pytest.mark.parametrize("total, seqlen", [(1001, 63), (1100, 300)])
def test_the_first_slabs_chunk_cut_keeps_the_stable_sorts_choice(scorer, monkeypatch, integers, total, seqlen):
    """One slab of 1000+ keys cut to the scores at least the topk-th largest of chunk maxima before its sort
    (torch: 7-key chunks; C: 31 or fewer, visible // (4 topk)), and 300 rows from position 800 (some rows see
    fewer keys than others): the same positions in the same order as the stable sort of the whole row."""
    monkeypatch.setattr(index_blocks, "CHUNK", 7)
    cuts: list[bool] = []
    floor = index_blocks._chunk_floor
    monkeypatch.setattr(index_blocks, "_chunk_floor", lambda *a: cuts.append(True) or floor(*a))
    gen = torch.Generator().manual_seed(total + seqlen)
    if integers:
        q = torch.randint(-2, 3, (seqlen, HEADS, DIM), generator=gen).float()
        keys = torch.randint(-1, 2, (total, DIM), generator=gen).float()
        weights = torch.randint(-2, 3, (seqlen, HEADS), generator=gen).float()
    else:
        q, keys = torch.randn(seqlen, HEADS, DIM, generator=gen), torch.randn(total, DIM, generator=gen)
        weights = torch.randn(seqlen, HEADS, generator=gen)
    start, topk = total - seqlen, 8
    chosen = blocked_choice(q, weights, keys, start, 0.25, topk)
    # the reference in the blocked form's order of operations (scale in the weights)
    scores = torch.bmm((weights * 0.25)[:, None], torch.einsum("shd,td->sht", q, keys).relu_())[:, 0]
    rows = torch.arange(start, total)[:, None]
    scores = scores.masked_fill(torch.arange(total)[None] > rows, float("-inf"))
    expected = stable_topk_indices(scores, topk)
    assert bool(cuts) == (scorer == "torch")  # the kernel's choice is C's (engine/csrc/index_choose.c)
    if integers:  # exact scores: exactly the stable sort's choice
        assert torch.equal(chosen, expected)
    else:  # the einsum's bits may differ from the blocked products' on another CPU: a near-tie at most
        assert (chosen == expected).all(-1).float().mean().item() >= 0.99


def test_the_indexer_takes_the_blocked_form_past_the_threshold_and_agrees_with_the_kernel(monkeypatch):
    """Indexer.choose on a 300-key chunk: the per-query path (kernel or einsum) within BLOCKED_FROM_KEYS,
    the blocked one past it; the same positions (a rounding apart, so a near-tie could swap one: 95% of rows
    whole)."""
    args = ModelArgs.from_hf_config(dict(fixtures._COMMON, model_type="glm_moe_dsa", **fixtures._DSA))
    torch.manual_seed(0)
    indexer = indexer_module.Indexer(args)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 40, args.index_n_heads, args.index_head_dim, generator=gen)
    weights, keys = torch.randn(1, 40, args.index_n_heads, generator=gen), torch.randn(1, 300, args.index_head_dim)
    used: list[int] = []
    original = index_blocks.blocked_choice
    monkeypatch.setattr(indexer_module, "blocked_choice", lambda *a: used.append(1) or original(*a))
    per_query = indexer.choose(q, weights, keys, 260)
    monkeypatch.setattr(indexer_module, "BLOCKED_FROM_KEYS", 299)
    blocked = indexer.choose(q, weights, keys, 260)
    assert used == [1] and blocked.shape == per_query.shape == (1, 40, args.index_topk)
    assert (blocked == per_query).all(-1).float().mean().item() >= 0.95


def test_the_blocked_indexers_temporaries_are_bounded(odd_blocks, monkeypatch):
    """Every score block [Sq * H, Tk] within SCORE_BYTES, every slab within max(SLAB_KEYS, 4 x topk) keys, the
    running top-k topk wide: none grows with T."""
    blocks: list[tuple[int, ...]] = []
    original_mm = torch.mm

    def recording_mm(a, b):
        out = original_mm(a, b)
        blocks.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "mm", recording_mm)
    merged: list[tuple[int, int]] = []  # every slab either running top-k took, with the top-k's own width
    for choice in (index_blocks._KernelChoice, index_blocks._TorchChoice):
        original = choice.merge
        monkeypatch.setattr(
            choice, "merge", lambda self, slab, *a, m=original: merged.append(tuple(slab.shape)) or m(self, slab, *a)
        )
    total, topk = 1001, 20
    q, keys = torch.randn(30, HEADS, DIM), torch.randn(total, DIM)
    blocked_choice(q, torch.randn(30, HEADS), keys, total - 30, 1.0, topk)
    if odd_blocks == "torch":  # the kernel holds its products in registers: no score block at all
        assert blocks and max(rows * width * 4 for rows, width in blocks) <= index_blocks.SCORE_BYTES
    else:
        assert not blocks
    assert merged and max(width for _, width in merged) <= max(index_blocks.SLAB_KEYS, 4 * topk)
    assert query_block(HEADS) * HEADS * index_blocks.KEY_BLOCK * 4 <= index_blocks.SCORE_BYTES
    assert [s.stop - s.start for s in slabs(total, topk)] == [100] * 10 + [1]


# ---------------------------------------------------------------------------------- MLA under a selection


def _attend(args, attn, x, split, selection, absorb=None):
    """Positions [0, split) (no selection, expanded) then [split, T) under ``selection`` -> the second
    part's output."""
    cache = KVCache.empty(args, 1, x.dtype).layers[0]
    with torch.no_grad():
        attn(x[:, :split], 0, rope_tables(args, 0, split, x.device), cache, None, absorb=False)
        rope = rope_tables(args, split, x.shape[1] - split, x.device)
        return attn(x[:, split:], split, rope, cache, selection[:, split:], absorb=absorb)[0]


@pytest.mark.parametrize("block_bytes", [1, 3000, 8 << 20])  # 1 query per block, a few, all
@pytest.mark.parametrize("total, split, k", [(70, 5, 9), (1030, 1000, 63)])
def test_selected_attention_equals_the_masked_whole_cache(monkeypatch, block_bytes, total, split, k):
    """Each query against its K gathered positions (fillers after its own masked) equals the whole cache
    expanded with the other positions masked out; the auto form takes it past one key block."""
    monkeypatch.setattr(prefill_attention, "KEY_BLOCK_BYTES", 1)
    monkeypatch.setattr(prefill_attention, "MIN_KEY_BLOCK", 7)
    monkeypatch.setattr(prefill_attention, "SELECTED_BLOCK_BYTES", block_bytes)
    args = ModelArgs.from_hf_config(ODD)
    torch.manual_seed(0)
    attn = MLA(args, 0)
    for p in attn.parameters():
        p.data.normal_(0, 0.3)
    gen = torch.Generator().manual_seed(total)
    x = torch.randn(1, total, args.dim, generator=gen)
    # distinct positions per query, its own first, later ones too (as the indexer's fillers)
    rows = []
    for query in range(total):
        others = torch.randperm(total - 1, generator=gen)[: k - 1]
        rows.append(torch.cat([torch.tensor([query]), others + (others >= query)]))
    selection = torch.stack(rows)[None]
    used: list[int] = []
    original = prefill_attention.selected_blocks
    monkeypatch.setattr("engine.mla.attention.selected_blocks", lambda *a: used.append(1) or original(*a))
    selected = _attend(args, attn, x, split, selection)
    monkeypatch.setattr(prefill_attention, "MIN_KEY_BLOCK", 10**6)  # one block: the whole-cache paths
    whole = _attend(args, attn, x, split, selection, absorb=False)
    assert used == [1]
    assert (selected - whole).abs().max().item() <= 1e-5 * whole.abs().max().item()


def test_the_selected_query_block_bounds_its_gather():
    """DeepSeek-V3.2's geometry: gathered keys and scores of a query block within SELECTED_BLOCK_BYTES."""
    heads, topk, rank, rope = 128, 2048, 512, 64
    assert prefill_attention.selected_block(heads, topk, rank, rope, 4) == 1  # 8.3 MB a query: one at a time
    heads, topk = 4, 128  # the demo's
    block = prefill_attention.selected_block(heads, topk, 64, 16, 4)
    per_query = topk * (64 + 16) * 4 + 2 * heads * 64 * 4 + heads * topk * 12
    assert block > 1 and block * per_query <= prefill_attention.SELECTED_BLOCK_BYTES


# ---------------------------------------------------------------------------------- whole models


@pytest.fixture
def long_paths_everywhere(monkeypatch):
    """Both long-prompt paths from the first key on, in small odd blocks."""
    monkeypatch.setattr(indexer_module, "BLOCKED_FROM_KEYS", 0)
    monkeypatch.setattr(index_blocks, "KEY_BLOCK", 7)
    monkeypatch.setattr(index_blocks, "SLAB_KEYS", 9)
    monkeypatch.setattr(index_blocks, "SCORE_BYTES", 1)
    monkeypatch.setattr(prefill_attention, "KEY_BLOCK_BYTES", 1)
    monkeypatch.setattr(prefill_attention, "MIN_KEY_BLOCK", 7)
    monkeypatch.setattr(prefill_attention, "SELECTED_BLOCK_BYTES", 1)


def _dsa_family(loaded) -> None:
    if loaded.args.v4 is not None or not loaded.args.has_dsa:
        pytest.skip("the MLA families with a DSA indexer")


def test_long_prompt_paths_give_transformers_logits(loaded, reference, long_paths_everywhere):
    """Teacher-forced logits in one forward of 52 positions (DSA choosing 8) against the oracle."""
    _dsa_family(loaded)
    prompt = fixtures.make_prompt(loaded.args.vocab_size, 20)
    ids = prompt + fixtures.oracle_greedy(reference, prompt, 32)
    expected = fixtures.oracle_teacher_forced(reference, ids)
    logits = loaded.model(torch.tensor([ids]), 0, loaded.model.new_cache(), loaded.experts)[0]
    assert logits.argmax(-1).tolist() == expected.argmax
    assert (logits - expected.logits).abs().max().item() <= 1e-4


def test_long_prompt_paths_in_chunks_give_the_oracles_tokens(loaded, reference, long_paths_everywhere):
    """Prefill in chunks of 6 over a 45-token prompt, then decode: the oracle's greedy tokens."""
    _dsa_family(loaded)
    prompt = fixtures.make_prompt(loaded.args.vocab_size, 45, seed=5)
    expected = fixtures.oracle_greedy(reference, prompt, 12)
    assert generate(loaded.model, prompt, 12, loaded.experts, prefill_chunk=6).ids == expected
