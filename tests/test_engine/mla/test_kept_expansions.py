"""Key blocks expanded once per prompt window (engine/mla/expansions.py): the same bits as expanding them for
every chunk, each full block through wkv_b once, the partial last block per chunk, and never more kept than
the limit."""

from __future__ import annotations

import torch

import engine.mla.expansions as expansions
import engine.mla.prefill as prefill_attention
from colibri_stream.devtools.fixtures import make_prompt
from engine.config.args import ModelArgs
from engine.core.cache import KVCache, LayerCache
from engine.core.rope import rope_tables
from engine.mla.attention import MLA
from engine.mla.expansions import expansions_kept

from .conftest import BLOCK  # small_blocks: every key block BLOCK positions
from .test_prefill_attention import _mla, _mla_family  # _mla: one MLA layer on odd widths


def _chunks(args: ModelArgs, attn: MLA, x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, LayerCache]:
    """x [1, T, dim] through ``attn`` ``chunk`` positions at a time, expanded form -> (outputs, cache)."""
    cache = KVCache.empty(args, 1, x.dtype).layers[0]
    outs = []
    with torch.no_grad():
        for start in range(0, x.shape[1], chunk):
            part = x[:, start : start + chunk]
            rope = rope_tables(args, start, part.shape[1], x.device)
            outs.append(attn(part, start, rope, cache, None, absorb=False)[0])
    return torch.cat(outs, dim=1), cache


def _expected_rows(ends: list[int], keep: int) -> list[int]:
    """wkv_b's input rows per call for chunks ending at ``ends`` (each past one key block): every key block,
    except that the first ``keep`` full blocks are expanded once and then kept."""
    rows: list[int] = []
    kept: set[int] = set()
    for end in ends:
        for first in range(0, end, BLOCK):
            size = min(BLOCK, end - first)
            if first in kept:
                continue
            if size == BLOCK and len(kept) < keep:
                kept.add(first)
            rows.append(size)
    return rows


def test_a_windows_chunks_expand_each_full_block_once_with_the_same_bits(small_blocks):
    """45 positions in chunks of 5 (the first within one key block: the whole-cache path, 5 rows), the rest
    against blocks of 7 with a ragged last one: the same outputs and cache bit for bit, and wkv_b's calls
    exactly the blocks not yet kept."""
    args, attn = _mla()
    x = torch.randn(1, 45, args.dim, generator=torch.Generator().manual_seed(3))
    runs = {}
    for kept in (False, True):
        rows: list[int] = []
        hook = attn.wkv_b.register_forward_hook(lambda module, inputs, out, _r=rows: _r.append(inputs[0].shape[-2]))
        if kept:
            with expansions_kept() as held:
                runs[kept] = _chunks(args, attn, x, 5)
            assert len(held.blocks) == 45 // BLOCK and held.bytes <= expansions.KEPT_EXPANSION_BYTES
        else:
            runs[kept] = _chunks(args, attn, x, 5)
        hook.remove()
        assert rows == [5] + _expected_rows(list(range(10, 46, 5)), keep=45 if kept else 0)
    (out, cache), (kept_out, kept_cache) = runs[False], runs[True]
    assert torch.equal(kept_out, out)
    assert torch.equal(kept_cache.latent[:, :45], cache.latent[:, :45])


def test_blocks_past_the_limit_are_expanded_per_chunk_as_before(small_blocks):
    """A limit of two blocks' expansions: two kept, the others expanded by every chunk, the same bits."""
    args, attn = _mla()
    x = torch.randn(1, 45, args.dim, generator=torch.Generator().manual_seed(4))
    per_block = BLOCK * attn.wkv_b.weight.shape[0] * 4
    plain = _chunks(args, attn, x, 5)[0]
    rows: list[int] = []
    hook = attn.wkv_b.register_forward_hook(lambda module, inputs, out: rows.append(inputs[0].shape[-2]))
    with expansions_kept(2 * per_block + per_block // 2) as held:
        limited = _chunks(args, attn, x, 5)[0]
    hook.remove()
    assert sorted(first for _, first, _ in held.blocks) == [0, BLOCK] and held.bytes == 2 * per_block
    assert rows == [5] + _expected_rows(list(range(10, 46, 5)), keep=2)
    assert torch.equal(limited, plain)


def test_nothing_is_kept_outside_the_context(small_blocks):
    args, attn = _mla()
    x = torch.randn(1, 30, args.dim, generator=torch.Generator().manual_seed(5))
    with expansions_kept() as held:
        _chunks(args, attn, x, 10)
    assert held.blocks
    rows: list[int] = []
    hook = attn.wkv_b.register_forward_hook(lambda module, inputs, out: rows.append(inputs[0].shape[-2]))
    _chunks(args, attn, x, 10)
    hook.remove()
    assert rows == _expected_rows([10, 20, 30], keep=0)


def test_a_prompt_window_keeps_the_chunked_bits_and_expands_less(loaded, small_blocks):
    """forward_prompt (each layer's chunks inside expansions_kept) against the same chunks one forward
    each, in chunks long enough for the expanded form: the same logits and cache rows bit for bit; on a
    family without a DSA selection, fewer latent rows through wkv_b."""
    _mla_family(loaded)
    model, experts, args = loaded.model, loaded.experts, loaded.args
    dims = (args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim)
    chunk = next(s for s in range(2, 400) if not prefill_attention.absorbed_is_cheaper(s, args.n_heads, *dims))
    tokens = torch.tensor([make_prompt(args.vocab_size, 3 * chunk + 5, seed=7)])
    rows: list[int] = []
    wkv_b = model.layers[0].attn.wkv_b
    hook = wkv_b.register_forward_hook(lambda module, inputs, out: rows.append(inputs[0].shape[-2]))
    try:
        cache = model.new_cache()
        starts = range(0, tokens.shape[1], chunk)
        chunked = torch.cat([model(tokens[:, s : s + chunk], s, cache, experts) for s in starts], dim=1)
        chunked_rows, rows[:] = sum(rows), []
        window_cache = model.new_cache()
        windowed = model.forward_prompt(tokens, 0, window_cache, experts, chunk)
        windowed_rows = sum(rows)
    finally:
        hook.remove()
    assert torch.equal(windowed, chunked)
    for ours, theirs in zip(window_cache.layers, cache.layers, strict=True):
        assert torch.equal(ours.latent[:, : tokens.shape[1]], theirs.latent[:, : tokens.shape[1]])
    if not args.has_dsa:
        assert windowed_rows < chunked_rows
