"""The DSA indexer in C (engine/kernels/decode_ops.py): its choice in one call (index_select), decode rows and a
prompt's; a decode row's key and query heads normed and roped in one call (index_finish)."""

from __future__ import annotations

import json

import pytest
import torch

from colibri_stream.checkpoint.demo_model import demo_model_dir
from engine.config.args import ModelArgs
from engine.core.cache import LayerCache
from engine.core.layers import stable_topk_indices
from engine.core.rope import apply_rope, rope_at, rope_tables
from engine.kernels import decode_ops, native
from engine.kernels.rows import rows_alone
from engine.mla.indexer import Indexer

needs_kernel = needs_finish = pytest.mark.skipif(not native.BUILT, reason="engine.kernels._kernels was not built")


def demo_args() -> ModelArgs:
    """The demo model's geometry (a GLM-5 layout: 16 indexer heads of 32, top-k 128)."""
    return ModelArgs.from_hf_config(json.loads((demo_model_dir() / "config.json").read_text()))


def reference_choice(q, keys, weights, start: int, scale: float, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's masked scores [B, S, T] in float64 (sum_h weights[h] * relu(scale * q[h] . k[t]), -inf
    after each row's position) and their stable top-k, as the torch path takes it."""
    q, keys, weights = q.double(), keys.double(), weights.double()
    scores = torch.einsum("bsh,bsht->bst", weights, (torch.einsum("bshd,btd->bsht", q, keys) * scale).relu())
    future = torch.arange(keys.shape[1])[None, :] > torch.arange(start, start + q.shape[1])[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    return scores, stable_topk_indices(scores, topk)


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "dim", "rows", "start", "total", "topk"),
    [
        (16, 32, 1, 299, 300, 128),  # a decode row
        (13, 37, 1, 699, 700, 100),  # odd heads, a head's tail
        (8, 5, 30, 10, 40, 24),  # a prompt's block whose first rows see fewer keys than topk
        (3, 200, 70, 930, 1000, 999),  # rows that see just enough, and one that sees too few
        (16, 32, 300, 0, 300, 128),  # a whole prompt from position 0
    ],
)
def test_each_row_chooses_the_top_k_of_the_keys_it_sees_highest_first(heads, dim, rows, start, total, topk):
    gen = torch.Generator().manual_seed(heads * dim + rows)
    q, keys = torch.randn(2, rows, heads, dim, generator=gen), torch.randn(2, total, dim, generator=gen)
    weights = torch.randn(2, rows, heads, generator=gen)
    chosen = decode_ops.index_select(q, keys, weights, start, dim**-0.5, topk)
    assert chosen.shape == (2, rows, topk) and chosen.dtype == torch.int64
    scores, expected = reference_choice(q, keys, weights, start, dim**-0.5, topk)
    for b in range(2):
        for r in range(rows):
            seen = start + r + 1
            ranked = min(seen, topk)
            assert set(chosen[b, r, :ranked].tolist()) == set(expected[b, r, :ranked].tolist())
            assert torch.equal(chosen[b, r, ranked:], expected[b, r, ranked:])  # fillers after its own position
            picked = scores[b, r, chosen[b, r, :ranked]]
            assert torch.all(picked[:-1] >= picked[1:] - 1e-5 * scores[b, r, :seen].abs().max())  # highest first


@needs_kernel
def test_ties_nans_and_zeros_are_ordered_as_stable_topk_orders_them():
    """One head of one dim: each score is relu(key) exactly, so the order can be compared bit for bit."""
    values = [0.5, -1.0, float("nan"), 0.5, 2.0, -0.0, 0.0, float("inf"), -3.0, 0.5, float("nan"), 1e-30, 2.0]
    keys = torch.tensor(values * 3).view(1, -1, 1)
    q, weights = torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1)
    for topk in (1, 5, 13, keys.shape[1]):
        chosen = decode_ops.index_select(q, keys, weights, keys.shape[1] - 1, 1.0, topk)
        assert torch.equal(chosen[0, 0], stable_topk_indices(keys[0, :, 0].relu(), topk))


@needs_kernel
def test_a_prompts_rows_and_a_decode_row_take_the_one_call_and_choose_what_torch_chooses(monkeypatch):
    args = demo_args()
    torch.manual_seed(1)
    indexer = Indexer(args)
    for parameter in indexer.parameters():
        parameter.data.normal_(0, 0.5)
    context = args.index_topk + 77
    prompt, prompt_latent = torch.randn(1, context, args.dim), torch.randn(1, context, args.q_lora_rank)
    x, q_latent = torch.randn(1, 1, args.dim), torch.randn(1, 1, args.q_lora_rank)
    calls: list[tuple[int, ...]] = []
    select = decode_ops.index_select
    monkeypatch.setattr(decode_ops, "index_select", lambda *a: calls.append(tuple(a[0].shape)) or select(*a))

    def prompt_then_a_decode_row() -> tuple[torch.Tensor, torch.Tensor]:
        cache = LayerCache.empty(args, 0, 1, torch.float32, torch.device("cpu"))
        cache.append(torch.zeros(1, context, args.kv_lora_rank), torch.zeros(1, context, args.qk_rope_head_dim))
        read = indexer(prompt, prompt_latent, 0, rope_tables(args, 0, context, prompt.device), cache)
        cache.append(torch.zeros(1, 1, args.kv_lora_rank), torch.zeros(1, 1, args.qk_rope_head_dim))
        return read, indexer(x, q_latent, context, rope_tables(args, context, 1, x.device), cache)

    with torch.inference_mode():
        with decode_ops.torch_ops():
            by_torch = prompt_then_a_decode_row()
        assert calls == []
        in_c = prompt_then_a_decode_row()
    heads = (args.index_n_heads, args.index_head_dim)
    assert calls == [(1, context, *heads), (1, 1, *heads)]
    for got, expected in zip(in_c, by_torch, strict=True):
        assert got.shape == expected.shape and got.shape[-1] == args.index_topk
        same = [set(a.tolist()) == set(b.tolist()) for a, b in zip(got[0], expected[0], strict=True)]
        assert sum(same) >= 0.99 * len(same)  # the same choice but where C's sums break a near tie otherwise


def torch_finish(x, heads: int, norm, rope: int, interleaved: bool, cos, sin) -> torch.Tensor:
    """The torch path's key / query ops: the LayerNorm (keys), then apply_rope on each head's first values."""
    x = x.view(*x.shape[:2], heads, -1)
    x = norm(x) if norm is not None else x
    rotated = apply_rope(x[..., :rope], cos, sin, interleaved)
    return torch.cat([rotated, x[..., rope:]], dim=-1)


@needs_finish
@pytest.mark.parametrize(
    ("heads", "dim", "rope", "interleaved", "normed", "rows", "start"),
    [
        (1, 128, 64, False, True, 1, 299),  # a decode row's key (GLM-5 / V3.2 geometry)
        (64, 128, 64, True, False, 1, 4095),  # its query heads, interleaved pairs
        (1, 37, 10, True, True, 5, 17),  # odd width: the rows of a one-call step at consecutive positions
        (3, 22, 22, False, False, 4, 0),  # the whole head roped
        (2, 9, 0, False, True, 3, 5),  # nothing roped: the norm alone
    ],
)
def test_the_key_and_query_heads_are_normed_and_roped_as_torch_does(heads, dim, rope, interleaved, normed, rows, start):
    torch.manual_seed(heads * dim + rows)
    x = torch.randn(1, rows, heads * dim) * 3 + 0.5
    norm = torch.nn.LayerNorm(dim, eps=1e-6) if normed else None
    if norm is not None:
        norm.weight.data.normal_(1, 0.3), norm.bias.data.normal_(0, 0.3)
    args = demo_args()
    cos, sin = rope_at(args.rope, max(rope, 2), torch.arange(start, start + rows))
    cos, sin = cos[:, : rope // 2], sin[:, : rope // 2]
    with torch.inference_mode():
        got = decode_ops.index_finish(x, heads, norm, rope, interleaved, cos, sin)
        expected = torch_finish(x, heads, norm, rope, interleaved, cos, sin)
    assert got.shape == (1, rows, heads, dim) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if not normed:  # the rotation alone: each product rounded as torch's separate ops round it
        assert torch.equal(got, expected)


@needs_finish
def test_decode_rows_take_the_one_call_and_a_prompt_keeps_torch(monkeypatch):
    args = demo_args()
    indexer = Indexer(args)
    calls: list[int] = []
    finish = decode_ops.index_finish
    monkeypatch.setattr(decode_ops, "index_finish", lambda x, heads, *a: calls.append(heads) or finish(x, heads, *a))
    prompt, latent = torch.randn(1, 6, args.dim), torch.randn(1, 6, args.q_lora_rank)
    with torch.inference_mode():
        indexer.keys(prompt, *rope_tables(args, 0, 6, prompt.device))
        indexer.queries(prompt, latent, rope_tables(args, 0, 6, prompt.device))
        assert calls == []
        indexer.keys(prompt[:, :1], *rope_tables(args, 6, 1, prompt.device))
        indexer.queries(prompt[:, :1], latent[:, :1], rope_tables(args, 6, 1, prompt.device))
        with rows_alone():  # a one-call step's rows as one sequence
            indexer.keys(prompt, *rope_tables(args, 0, 6, prompt.device))
    assert calls == [1, args.index_n_heads, 1]


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
def test_a_keys_score_does_not_depend_on_where_it_falls_in_a_block(seed):
    """A block of 256 keys is scored three keys at a time where the CPU has AVX-512VL, the last key alone:
    copies of the last key at positions 0, 1 and 2 (each place of a triple) score equal to it, bit for bit,
    so the four rank together in position order (equal scores: the lower position first)."""
    torch.manual_seed(seed)
    heads, dim, total = 19, 40, 256
    keys = torch.randn(1, total, dim)
    keys[0, :3] = keys[0, total - 1]
    q, weights = torch.randn(1, 1, heads, dim), torch.randn(1, 1, heads)
    order = decode_ops.index_select(q, keys, weights, total - 1, dim**-0.5, total)[0, 0].tolist()
    at = order.index(0)
    assert order[at : at + 4] == [0, 1, 2, total - 1]
