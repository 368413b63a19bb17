"""Placement changes speed, never tokens: routed experts sharded over 1, 2 and 3 local worker processes
give the same logits (bit for bit) and the same greedy tokens as one process, on every family, for
lossless (f32) and int4 containers, at a budget where the workers' stores miss."""

from __future__ import annotations

import torch

from colibri_stream.devtools import fixtures
from colibri_stream.experts.cluster.group import ClusterOptions
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.batching import ContinuousBatch, GenerationRequest
from colibri_stream.runtime.sampling import SamplingParams
from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, load_runtime, run_turn

TIGHT = StoreOptions(ram="40%")  # of the routed-expert bytes, together: every worker's store misses
NEW_TOKENS = 6


def open_runtime(container, tmp_path, workers: int):
    cluster = ClusterOptions(local_workers=workers, timeout_s=120)
    return load_runtime(container, RuntimeOptions(store=TIGHT, kv_dir=tmp_path / "kv", text=False, cluster=cluster))


def prefill_logits_and_tokens(runtime, prompt: list[int]) -> tuple[torch.Tensor, list[int], dict]:
    model = runtime.loaded.model
    logits = model(torch.tensor([prompt]), 0, model.new_cache(), runtime.loaded.experts)[0]
    result = run_turn(runtime, prompt, TurnOptions(max_new_tokens=NEW_TOKENS))
    return logits, result.ids, result.stats


def test_workers_give_one_process_logits_and_tokens(family, make_container, tmp_path):
    for experts in ("f32", "int4"):
        container = make_container(family, experts)
        alone = open_runtime(container, tmp_path, 0)
        prompt = fixtures.make_prompt(alone.vocab_size, 9, seed=5)
        try:
            expected_logits, expected_ids, _ = prefill_logits_and_tokens(alone, prompt)
        finally:
            alone.close()
        for workers in (1, 2, 3):
            runtime = open_runtime(container, tmp_path, workers)
            try:
                logits, ids, stats = prefill_logits_and_tokens(runtime, prompt)
            finally:
                runtime.close()
            where = f"{family} {experts} experts, {workers} worker(s)"
            assert torch.equal(logits, expected_logits), where
            assert ids == expected_ids, where
            assert stats["store"] == "workers" and len(stats["workers"]) == workers, where
            assert stats["misses"] > 0, where


def test_batched_rows_through_workers_are_each_computed_alone(make_container, tmp_path):
    """Two requests decoded together (a server's batch: rows_alone travels with the request) give each
    the tokens it gets alone in one process."""
    container = make_container("deepseek_v3", "int4")
    prompts = [[5, 9, 2, 7], [11, 3, 8, 1, 4, 6]]
    alone = open_runtime(container, tmp_path, 0)
    try:
        expected = [run_turn(alone, p, TurnOptions(max_new_tokens=NEW_TOKENS)).ids for p in prompts]
    finally:
        alone.close()
    runtime = open_runtime(container, tmp_path, 2)
    try:
        model, store = runtime.loaded.model, runtime.loaded.experts
        batch = ContinuousBatch(model, store)
        generations = [
            batch.add(GenerationRequest(p, NEW_TOKENS, SamplingParams(), (), model.new_cache())) for p in prompts
        ]
        while batch:
            batch.step()
        got = [g.result.ids for g in generations]
    finally:
        runtime.close()
    assert got == expected
