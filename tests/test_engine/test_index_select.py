"""The DSA indexer's choice for a decode row in one C call (engine/decode_ops.py index_select)."""

from __future__ import annotations

import json

import pytest
import torch

from colibri_stream.checkpoint.demo_model import demo_model_dir
from engine import decode_ops
from engine.args import ModelArgs
from engine.cache import LayerCache
from engine.indexer import Indexer
from engine.moe import stable_topk_indices
from engine.rope import rope_tables

needs_kernel = pytest.mark.skipif(not decode_ops._SELECTS, reason="engine._kernels was not built")


def reference_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """The indexer's scores [B, 1, T] in float64: sum_h weights[h] * relu(scale * q[h] . k[t])."""
    q, keys, weights = q.double(), keys.double(), weights.double()
    return torch.einsum("bsh,bsht->bst", weights, (torch.einsum("bshd,btd->bsht", q, keys) * scale).relu())


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "dim", "total", "topk"),
    [(16, 32, 300, 128), (13, 37, 700, 100), (8, 5, 40, 40), (3, 200, 1000, 999)],  # odd heads, tails, T == K
)
def test_the_choice_is_the_top_k_of_the_indexer_scores_highest_first(heads, dim, total, topk):
    gen = torch.Generator().manual_seed(heads * dim)
    q, keys = torch.randn(2, 1, heads, dim, generator=gen), torch.randn(2, total, dim, generator=gen)
    weights = torch.randn(2, 1, heads, generator=gen)
    chosen = decode_ops.index_select(q, keys, weights, dim**-0.5, topk)
    assert chosen.shape == (2, 1, topk) and chosen.dtype == torch.int64
    scores = reference_scores(q, keys, weights, dim**-0.5)
    for row in range(2):
        expected = stable_topk_indices(scores[row, 0], topk)
        assert set(chosen[row, 0].tolist()) == set(expected.tolist())
        picked = scores[row, 0, chosen[row, 0]]
        assert torch.all(picked[:-1] >= picked[1:] - 1e-5 * scores.abs().max())  # highest first


@needs_kernel
def test_ties_nans_and_zeros_are_ordered_as_stable_topk_orders_them():
    """One head of one dim: each score is relu(key) exactly, so the order can be compared bit for bit."""
    values = [0.5, -1.0, float("nan"), 0.5, 2.0, -0.0, 0.0, float("inf"), -3.0, 0.5, float("nan"), 1e-30, 2.0]
    keys = torch.tensor(values * 3).view(1, -1, 1)
    q, weights = torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1)
    for topk in (1, 5, 13, keys.shape[1]):
        chosen = decode_ops.index_select(q, keys, weights, 1.0, topk)
        assert torch.equal(chosen[0, 0], stable_topk_indices(keys[0, :, 0].relu(), topk))


@needs_kernel
def test_a_decode_row_takes_the_one_call_and_a_prompts_rows_keep_torch(monkeypatch):
    args = ModelArgs.from_hf_config(json.loads((demo_model_dir() / "config.json").read_text()))
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

    def decode_row_after_the_prompt() -> torch.Tensor:
        cache = LayerCache.empty(args, 0, 1, torch.float32, torch.device("cpu"))
        cache.append(torch.zeros(1, context, args.kv_lora_rank), torch.zeros(1, context, args.qk_rope_head_dim))
        indexer(prompt, prompt_latent, 0, rope_tables(args, 0, context, prompt.device), cache)
        assert calls == []  # the prompt's rows: torch's ops
        cache.append(torch.zeros(1, 1, args.kv_lora_rank), torch.zeros(1, 1, args.qk_rope_head_dim))
        return indexer(x, q_latent, context, rope_tables(args, context, 1, x.device), cache)

    with torch.inference_mode():
        with decode_ops.torch_ops():
            by_torch = decode_row_after_the_prompt()
        in_c = decode_row_after_the_prompt()
    assert calls == [(1, 1, args.index_n_heads, args.index_head_dim)]
    assert in_c.shape == by_torch.shape == (1, 1, args.index_topk)
    assert set(in_c.flatten().tolist()) == set(by_torch.flatten().tolist())  # the same choice, summed in C
