"""Placement changes speed, never tokens: routed experts sharded over 1, 2 and 3 local worker processes
give the same logits (bit for bit) and the same greedy tokens as one process, on every family, for
lossless (f32) and int4 containers, at a budget where the workers' stores miss; and requests decoded
together through the workers (a server's batch) each get the tokens they get alone in one process.

Each worker is a process importing torch (seconds on the test machine), so each (family, container)
pair runs at one worker count (WORKERS: every count on both containers, every family at two counts,
one of them split over several workers), and both tests read one module-scoped run of each pair."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from colibri_stream.devtools import fixtures
from colibri_stream.experts.cluster.group import ClusterOptions
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.batching import ContinuousBatch, GenerationRequest
from colibri_stream.runtime.sampling import SamplingParams
from colibri_stream.runtime.turn import Runtime, RuntimeOptions, TurnOptions, load_runtime, run_turn

TIGHT = StoreOptions(ram="40%")  # of the routed-expert bytes, together: every worker's store misses
NEW_TOKENS = 6
EXPERTS = ("f32", "int4")
# (family, experts) -> local workers, cycling 1, 2, 3 over the pairs in order
WORKERS = {pair: 1 + i % 3 for i, pair in enumerate((f, e) for f in fixtures.FAMILIES for e in EXPERTS)}
BATCH = [[5, 9, 2, 7], [11, 3, 8, 1, 4, 6]]  # two prompts of other lengths, decoded together


@dataclass(frozen=True)
class Outputs:
    logits: torch.Tensor  # [prompt, vocab]: one forward over the prompt
    ids: list[int]  # run_turn's greedy tokens
    stats: dict
    batch_ids: list[list[int]]  # BATCH's tokens: alone, one turn each; through workers, decoded together


@dataclass(frozen=True)
class PairRuns:
    where: str
    workers: int
    alone: Outputs  # one process
    sharded: Outputs  # the routed experts on the workers


def open_runtime(container, tmp_path, workers: int) -> Runtime:
    cluster = ClusterOptions(local_workers=workers, timeout_s=120)
    return load_runtime(container, RuntimeOptions(store=TIGHT, kv_dir=tmp_path / "kv", text=False, cluster=cluster))


def outputs(runtime: Runtime, prompt: list[int], batched: bool) -> Outputs:
    model = runtime.loaded.model
    logits = model(torch.tensor([prompt]), 0, model.new_cache(), runtime.loaded.experts)[0]
    result = run_turn(runtime, prompt, TurnOptions(max_new_tokens=NEW_TOKENS))
    if batched:
        batch = ContinuousBatch(model, runtime.loaded.experts)
        requests = [GenerationRequest(p, NEW_TOKENS, SamplingParams(), (), model.new_cache()) for p in BATCH]
        generations = [batch.add(request) for request in requests]
        while batch:
            batch.step()
        batch_ids = [g.result.ids for g in generations]
    else:
        batch_ids = [run_turn(runtime, p, TurnOptions(max_new_tokens=NEW_TOKENS)).ids for p in BATCH]
    return Outputs(logits, result.ids, result.stats, batch_ids)


@pytest.fixture(scope="module", params=EXPERTS)
def experts(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def runs(family, experts, make_container, tmp_path_factory) -> PairRuns:
    container = make_container(family, experts)
    tmp_path = tmp_path_factory.mktemp("workers")
    alone = open_runtime(container, tmp_path, 0)
    prompt = fixtures.make_prompt(alone.vocab_size, 9, seed=5)
    try:
        expected = outputs(alone, prompt, batched=False)
    finally:
        alone.close()
    workers = WORKERS[family, experts]
    runtime = open_runtime(container, tmp_path, workers)
    try:
        got = outputs(runtime, prompt, batched=True)
    finally:
        runtime.close()
    return PairRuns(f"{family} {experts} experts, {workers} worker(s)", workers, expected, got)


def test_every_worker_count_is_on_both_containers_and_every_family_splits():
    for experts in EXPERTS:
        assert {w for (_, e), w in WORKERS.items() if e == experts} == {1, 2, 3}
    for family in fixtures.FAMILIES:
        counts = {WORKERS[family, experts] for experts in EXPERTS}
        assert len(counts) == 2 and max(counts) > 1, family


def test_workers_give_one_process_logits_and_tokens(runs):
    assert torch.equal(runs.sharded.logits, runs.alone.logits), runs.where
    assert runs.sharded.ids == runs.alone.ids, runs.where
    stats = runs.sharded.stats
    assert stats["store"] == "workers" and len(stats["workers"]) == runs.workers, runs.where
    assert stats["misses"] > 0, runs.where


def test_batched_rows_through_workers_are_each_computed_alone(runs):
    """rows_alone travels with the request: each row of a batch is computed as it is alone."""
    assert runs.sharded.batch_ids == runs.alone.batch_ids, runs.where
    assert all(len(ids) == NEW_TOKENS for ids in runs.alone.batch_ids)  # no stop id cut the comparison short
