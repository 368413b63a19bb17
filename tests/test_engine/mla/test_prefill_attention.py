"""Prefill attention in key blocks (engine/mla/prefill.py) against the whole-cache expanded path
and against transformers: odd widths, contexts that are no multiple of the block, DSA selections of
fewer positions than the context and of all of them, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

import engine.mla.prefill as prefill_attention
from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from engine.config.args import ModelArgs
from engine.core.cache import KVCache
from engine.core.rope import rope_tables
from engine.mla.attention import MLA
from engine.mla.prefill import absorbed_is_cheaper, key_block

from .conftest import BLOCK  # small_blocks: every key block BLOCK positions

PATHS = {"auto": None, "expanded": False, "absorbed": True}

# Widths that divide neither 64 nor 32 (nor each other); rope even, as RoPE needs.
ODD = dict(
    fixtures._COMMON,
    model_type="deepseek_v3",
    hidden_size=40,
    num_attention_heads=3,
    num_key_value_heads=3,
    kv_lora_rank=37,
    q_lora_rank=19,
    qk_nope_head_dim=11,
    qk_rope_head_dim=6,
    v_head_dim=13,
)


def _mla(dtype: torch.dtype = torch.float32, **changes) -> tuple[ModelArgs, MLA]:
    args = ModelArgs.from_hf_config(dict(ODD, **changes))
    torch.manual_seed(0)
    attn = MLA(args, 0)
    for p in attn.parameters():
        p.data.normal_(0, 0.3)
    return args, attn.to(dtype).eval()


def _attend(args, attn, x, split, selection=None, absorb=None) -> torch.Tensor:
    """x [1, T, dim]: positions [0, split) then [split, T) through ``attn`` with a fresh cache; the
    second part's output [1, T - split, dim]."""
    cache = KVCache.empty(args, 1, x.dtype).layers[0]
    with torch.no_grad():
        if split:
            attn(x[:, :split], 0, rope_tables(args, 0, split, x.device), cache, None, absorb=False)
        rope = rope_tables(args, split, x.shape[1] - split, x.device)
        chosen = None if selection is None else selection[:, split:]
        return attn(x[:, split:], split, rope, cache, chosen, absorb=absorb)[0]


def _selection(total: int, k: int, seed: int) -> torch.Tensor:
    """[1, T, K] distinct positions per query, drawn from the whole context (future ones included, as the
    indexer's fillers are; attention masks them causally), the query's own position always among them."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for query in range(total):
        others = [t for t in torch.randperm(total, generator=gen).tolist() if t != query][: k - 1]
        rows.append([query, *others])
    return torch.tensor([rows])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("total, split", [(23, 0), (40, 17), (9, 3)])
def test_key_blocks_equal_the_whole_cache_on_odd_widths(small_blocks, monkeypatch, path, total, split):
    args, attn = _mla()
    x = torch.randn(1, total, args.dim, generator=torch.Generator().manual_seed(total))
    blocked = _attend(args, attn, x, split, absorb=PATHS[path])
    monkeypatch.setattr(prefill_attention, "MIN_KEY_BLOCK", 10**6)  # one block: the whole-cache paths
    whole = _attend(args, attn, x, split, absorb=False)
    assert blocked.shape == whole.shape
    assert (blocked - whole).abs().max().item() <= 1e-5 * whole.abs().max().item()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k", [5, 31])  # fewer positions than the context, and all of them
def test_key_blocks_equal_the_whole_cache_under_a_dsa_selection(small_blocks, monkeypatch, path, k):
    args, attn = _mla()
    total, split = 31, 12
    x = torch.randn(1, total, args.dim, generator=torch.Generator().manual_seed(k))
    selection = _selection(total, k, seed=k)
    blocked = _attend(args, attn, x, split, selection, absorb=PATHS[path])
    monkeypatch.setattr(prefill_attention, "MIN_KEY_BLOCK", 10**6)
    whole = _attend(args, attn, x, split, selection, absorb=False)
    assert (blocked - whole).abs().max().item() <= 1e-5 * whole.abs().max().item()
    if k == total:  # every position chosen == no selection
        dense = _attend(args, attn, x, split, None, absorb=False)
        assert (whole - dense).abs().max().item() <= 1e-5 * dense.abs().max().item()


def test_a_block_no_query_chose_is_skipped_and_changes_nothing(small_blocks, monkeypatch):
    """Every query of the second part chooses positions of blocks 0 and 3 only (and itself, causally
    masked where it is not visible): blocks 1 and 2 are never expanded."""
    args, attn = _mla()
    total, split = 30, 24
    x = torch.randn(1, total, args.dim, generator=torch.Generator().manual_seed(1))
    chosen = [0, 3, 6, 21, 22, 23]
    selection = torch.tensor([[[*chosen, q] for q in range(total)]])
    rows: list[int] = []
    hook = attn.wkv_b.register_forward_hook(lambda module, inputs, out: rows.append(inputs[0].shape[-2]))
    blocked = _attend(args, attn, x, split, selection, absorb=False)
    hook.remove()
    monkeypatch.setattr(prefill_attention, "MIN_KEY_BLOCK", 10**6)
    whole = _attend(args, attn, x, split, selection, absorb=False)
    assert (blocked - whole).abs().max().item() <= 1e-5 * whole.abs().max().item()
    # the first part (no selection) expands its 24 positions block by block; the second blocks 0, 3, 4
    assert rows == [BLOCK, BLOCK, BLOCK, split - 3 * BLOCK] + [BLOCK, BLOCK, total - 4 * BLOCK]


def test_bfloat16_key_blocks_stay_near_the_whole_cache(small_blocks, monkeypatch):
    args, attn = _mla(torch.bfloat16)
    x = torch.randn(1, 40, args.dim, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    outputs = {name: _attend(args, attn, x, 17, absorb=absorb).float() for name, absorb in PATHS.items()}
    monkeypatch.setattr(prefill_attention, "MIN_KEY_BLOCK", 10**6)
    whole = _attend(args, attn, x, 17, absorb=False).float()
    for out in outputs.values():
        assert (out - whole).abs().max().item() <= 2e-2 * whole.abs().max().item()


def test_the_expansion_never_covers_more_than_a_key_block(small_blocks):
    """The memory bound itself: wkv_b sees at most one key block of latents at a time."""
    args, attn = _mla()
    rows: list[int] = []
    hook = attn.wkv_b.register_forward_hook(lambda module, inputs, out: rows.append(inputs[0].shape[-2]))
    x = torch.randn(1, 45, args.dim, generator=torch.Generator().manual_seed(3))
    _attend(args, attn, x, 0, absorb=False)
    hook.remove()
    assert rows == [BLOCK] * 6 + [45 - 6 * BLOCK]


def test_auto_takes_the_absorbed_form_for_short_chunks_and_expanded_for_long_ones(small_blocks, monkeypatch):
    args, attn = _mla()
    dims = (args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim)
    short = next(s for s in range(2, 200) if absorbed_is_cheaper(s, args.n_heads, *dims))
    long = next(s for s in range(2, 200) if not absorbed_is_cheaper(s, args.n_heads, *dims))
    used: list[str] = []
    for name in ("absorbed_blocks", "expanded_blocks"):
        original = getattr(prefill_attention, name)
        monkeypatch.setattr("engine.mla.attention." + name, lambda *a, _n=name, _f=original: used.append(_n) or _f(*a))
    picked = []
    for seqlen in (short, long):
        x = torch.randn(1, 20 + seqlen, args.dim, generator=torch.Generator().manual_seed(seqlen))
        _attend(args, attn, x, 20)
        picked.append(used[-1])  # the second part's (the first is forced expanded)
    assert picked == ["absorbed_blocks", "expanded_blocks"]


def test_key_block_bounds_the_scores():
    """A full chunk of DeepSeek-V3's 128 heads: scores [S, H, Tk] float32 within KEY_BLOCK_BYTES."""
    block = key_block(256, 128)
    assert block >= prefill_attention.MIN_KEY_BLOCK
    assert 256 * 128 * block * 4 <= prefill_attention.KEY_BLOCK_BYTES


# ---------------------------------------------------------------------------------- whole models


def _mla_family(loaded) -> None:
    if loaded.args.v4 is not None:
        pytest.skip("MLA's prefill paths; DeepSeek-V4 has its own attention")


@pytest.mark.parametrize("path", PATHS)
def test_key_blocked_models_equal_transformers(loaded, reference, small_blocks, path):
    """Teacher-forced logits in one forward (52 positions: 8 blocks, the last of 3), every family's DSA
    selecting 8 of them, against the oracle."""
    _mla_family(loaded)
    prompt = fixtures.make_prompt(loaded.args.vocab_size, 20)
    ids = prompt + fixtures.oracle_greedy(reference, prompt, 32)
    expected = fixtures.oracle_teacher_forced(reference, ids)
    logits = loaded.model(torch.tensor([ids]), 0, loaded.model.new_cache(), loaded.experts, absorb=PATHS[path])[0]
    assert logits.argmax(-1).tolist() == expected.argmax
    assert (logits - expected.logits).abs().max().item() <= 1e-4


def test_key_blocked_chunked_generation_gives_the_oracles_tokens(loaded, reference, small_blocks):
    """generate's prefill in chunks of 6 over a 45-token prompt (each chunk after the first against
    several key blocks, in the form auto picks), then decode: the oracle's greedy tokens."""
    _mla_family(loaded)
    prompt = fixtures.make_prompt(loaded.args.vocab_size, 45, seed=5)
    expected = fixtures.oracle_greedy(reference, prompt, 12)
    assert generate(loaded.model, prompt, 12, loaded.experts, prefill_chunk=6).ids == expected
