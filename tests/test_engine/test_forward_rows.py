"""Batch invariance: B independent sequences decoded in one pass (Transformer.forward_rows) give each
row the bits it gets decoded alone, on every family, through every kernel kind, under a RAM budget
where the store misses; and the pass acquires each distinct expert once per MoE layer."""

from __future__ import annotations

import pytest
import torch

from colibri_stream.bench.kernels import KINDS, random_kind_matrix
from colibri_stream.devtools.steps import decode_one_token, prefill
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.loader import load
from engine.kernels.bf16 import ISA, bf16_kernel_available, bf16_matmul
from engine.kernels.quant import int4_kernel_available, kernel_matmul
from engine.kernels.rows import computing_alone, linear, rows_alone

# Odd lengths, one past the DSA fixtures' index_topk (8: the indexer selects), one of a single token.
PROMPTS = [[1, 5, 9, 3, 7, 2, 11, 4, 6, 8, 10, 12, 13], [4, 4, 2], list(range(3, 40)), [7], [9, 9, 9, 9, 9]]
STEPS = 4


def solo_runs(model, experts, prompts, steps):
    """Each prompt alone: greedy tokens and the logits of every decode step."""
    runs = []
    for prompt in prompts:
        cache = model.new_cache()
        logits, tokens, all_logits = prefill(model, prompt, cache, experts), [], []
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            logits = decode_one_token(model, tokens[-1], cache, experts)
            all_logits.append(logits)
        runs.append((tokens, all_logits))
    return runs


def batched_runs(model, experts, prompts, steps):
    """All prompts prefilled alone, then decoded together, one forward_rows per step."""
    caches, tokens = [], []
    for prompt in prompts:
        cache = model.new_cache()
        tokens.append([int(prefill(model, prompt, cache, experts).argmax())])
        caches.append(cache)
    all_logits = []
    for _ in range(steps):
        logits = model.forward_rows([t[-1] for t in tokens], caches, experts)
        all_logits.append(logits)
        for row, t in zip(logits, tokens, strict=True):
            t.append(int(row.argmax()))
    return [(t[:steps], [step[b] for step in all_logits]) for b, t in enumerate(tokens)]


def assert_bit_identical(solo, batched):
    for (solo_tokens, solo_logits), (tokens, logits) in zip(solo, batched, strict=True):
        assert tokens == solo_tokens
        for a, b in zip(solo_logits, logits, strict=True):
            assert torch.equal(a, b), (a - b).abs().max()


def test_every_family_decodes_the_same_bits_batched(loaded):
    model, experts = loaded.model, loaded.experts
    assert_bit_identical(solo_runs(model, experts, PROMPTS, STEPS), batched_runs(model, experts, PROMPTS, STEPS))


@pytest.mark.parametrize(
    ("experts", "dense", "activations"),
    [("int4", "bf16", "float32"), ("int4", "int8", "float32"), ("bf16", "f32", "float32"), ("int4", "int8", "int8")],
)
def test_containers_under_a_tight_budget_decode_the_same_bits_batched(make_container, experts, dense, activations):
    """The C kernels' batch-invariant path (int4 experts, bf16 and int8 dense; the int8-activation kernel)
    and torch row by row (bf16 experts, f32 dense), through the tiered store at a budget where it misses."""
    path = make_container("glm_moe_dsa", experts, dense)
    loaded = load(path, "float32", StoreOptions(ram="30%"), activations)
    try:
        solo = solo_runs(loaded.model, loaded.experts, PROMPTS, STEPS)
        before = loaded.experts.snapshot()
        batched = batched_runs(loaded.model, loaded.experts, PROMPTS, STEPS)
        assert loaded.experts.snapshot().minus(before).misses > 0
        assert_bit_identical(solo, batched)
    finally:
        loaded.experts.close()


class CountingExperts:
    """A provider that records each acquire's (layer, ids)."""

    def __init__(self, inner):
        self.inner, self.acquired = inner, []

    def acquire(self, layer, ids):
        self.acquired.append((layer, list(ids)))
        return self.inner.acquire(layer, ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_batched_step_acquires_each_distinct_expert_once_per_layer(loaded):
    model = loaded.model
    caches = []
    for prompt in PROMPTS:
        caches.append(model.new_cache())
        prefill(model, prompt, caches[-1], loaded.experts)
    counting = CountingExperts(loaded.experts)
    tokens = [3, 1, 4, 1, 5]
    model.forward_rows(tokens, caches, counting)
    per_layer: dict[int, list[int]] = {}
    for layer, ids in counting.acquired:
        per_layer.setdefault(layer, []).extend(ids)
    moe_layers = [i for i, layer in enumerate(model.layers) if hasattr(layer.ffn, "gate")]
    assert sorted(per_layer) == moe_layers
    topk = model.args.n_activated_experts
    for ids in per_layer.values():
        assert len(ids) == len(set(ids))  # each distinct expert once for the whole batch
        assert topk <= len(ids) <= min(len(tokens) * topk, model.args.n_routed_experts)


def test_rows_alone_is_scoped_and_linear_goes_row_by_row():
    assert not computing_alone()
    with rows_alone():
        assert computing_alone()
        x, w = torch.randn(5, 1, 37), torch.randn(19, 37)
        rows = torch.cat([torch.nn.functional.linear(x[r], w) for r in range(5)])
        assert torch.equal(linear(x, w).view(5, 19), rows)
    assert not computing_alone()


@pytest.mark.skipif(not int4_kernel_available(), reason="the C kernel is not built")
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("shape", [(130, 384), (257, 41), (96, 1000)])
def test_nibble_kernel_alone_gives_each_row_its_one_row_bits(kind, shape):
    code, scales, group = KINDS[kind]
    gen = torch.Generator().manual_seed(7)
    m = random_kind_matrix(code, scales, group, *shape, gen)
    x = torch.randn(8, shape[1], generator=gen)
    alone = torch.cat([kernel_matmul(x[r : r + 1], m) for r in range(8)])
    for rows in (2, 3, 5, 8):
        assert torch.equal(kernel_matmul(x[:rows], m, alone=True), alone[:rows])
        assert torch.equal(
            kernel_matmul(x[:rows], m, alone=True, isa="scalar"), kernel_matmul(x[:rows], m, isa="scalar")
        )


@pytest.mark.skipif(not bf16_kernel_available(), reason="the bf16 kernel has no SIMD path here")
@pytest.mark.parametrize("isa", list(ISA))
def test_bf16_kernel_alone_gives_each_row_its_one_row_bits(isa):
    gen = torch.Generator().manual_seed(3)
    for out_dim, in_dim in [(130, 384), (64, 1024), (33, 96)]:
        w = torch.randn(out_dim, in_dim, generator=gen).bfloat16()
        x = torch.randn(8, in_dim, generator=gen)
        alone = torch.cat([bf16_matmul(x[r : r + 1], w, isa) for r in range(8)])
        for rows in (2, 5, 8):
            assert torch.equal(bf16_matmul(x[:rows], w, isa, alone=True), alone[:rows])
