"""The DSA indexer's scores over a long context run on the kernel threads (engine/indexer.py
PARALLEL_SCORE_MACS), inside a forward pass whose other torch ops keep one thread, with the bits of one
thread: a selection, and so every token, does not depend on how many threads scored it."""

from __future__ import annotations

import json

import pytest
import torch

import engine.indexer as indexer_module
from colibri_stream.checkpoint.demo_model import demo_model_dir
from engine.args import ModelArgs
from engine.cache import LayerCache
from engine.indexer import Indexer
from engine.rope import rope_tables
from engine.rows import torch_on_one_thread

pytestmark = pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 torch threads")


def select(indexer: Indexer, args: ModelArgs, x: torch.Tensor, q_latent: torch.Tensor, cache: LayerCache, start: int):
    """``forward`` of the S new positions x [1, S, dim] at start.. in a forward pass (torch on one thread),
    and the torch thread counts the scores ran on."""
    seen = []
    einsum = torch.einsum

    def counting(*operands):
        seen.append(torch.get_num_threads())
        return einsum(*operands)

    cache.append(
        torch.zeros(1, x.shape[1], args.kv_lora_rank), torch.zeros(1, x.shape[1], args.qk_rope_head_dim)
    )  # the latents of these positions (the indexer reads only its keys)
    rope = rope_tables(args, start, x.shape[1], x.device)
    with torch.inference_mode(), torch_on_one_thread(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "einsum", counting)
        chosen = indexer(x, q_latent, start, rope, cache)
    return chosen, seen


@pytest.mark.parametrize("new_positions", [1, 24])  # a decode row, a prompt's block
def test_long_context_scores_run_on_the_kernel_threads_with_one_threads_bits(new_positions, monkeypatch):
    args = ModelArgs.from_hf_config(json.loads((demo_model_dir() / "config.json").read_text()))
    torch.manual_seed(0)
    indexer = Indexer(args)
    for parameter in indexer.parameters():
        parameter.data.normal_(0, 0.5)
    context = 16_400  # 16 heads x 32 dims x 16.4k keys: 8.4M multiply-adds a query, the threshold
    assert args.index_n_heads * args.index_head_dim * context >= indexer_module.PARALLEL_SCORE_MACS
    prompt = torch.randn(1, context, args.dim)
    x, q_latent = torch.randn(1, new_positions, args.dim), torch.randn(1, new_positions, args.q_lora_rank)
    results = {}
    for threshold in (indexer_module.PARALLEL_SCORE_MACS, 1 << 62):  # then: never parallel
        monkeypatch.setattr(indexer_module, "PARALLEL_SCORE_MACS", threshold)
        cache = LayerCache.empty(args, 0, 1, torch.float32, torch.device("cpu"))
        with torch.inference_mode():  # the context's keys: the indexer's own, appended as a prompt would
            cache.append(torch.zeros(1, context, args.kv_lora_rank), torch.zeros(1, context, args.qk_rope_head_dim))
            cache.append_index_key(indexer.keys(prompt, *rope_tables(args, 0, context, prompt.device)))
        results[threshold] = select(indexer, args, x, q_latent, cache, context)
    (parallel, parallel_threads), (alone, alone_threads) = results.values()
    assert parallel_threads and set(parallel_threads) == {torch.get_num_threads()}
    assert set(alone_threads) == {1}
    assert parallel.shape == (1, new_positions, args.index_topk) and torch.equal(parallel, alone)
