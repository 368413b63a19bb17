"""Several sequences' prompt chunks in one forward (Model.forward_prompts, engine/kernels/rows.py rows_in_segments):
each chunk's logits and cache rows are bit for bit those of its own forward, on every family, through every
kernel kind and under a RAM budget where the store misses; the pass acquires each expert once per layer; and
the segment-aware ops split exactly where a row's bits depend on its neighbours."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.batching import ContinuousBatch, GenerationRequest
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load
from engine.kernels.bf16 import PROMPT_KERNEL_ROWS, bf16_kernel_available, bf16_linear, bf16_matmul
from engine.kernels.rows import by_segment, linear, one_segment, per_row, row_segments, rows_alone, rows_in_segments
from tests.test_engine.test_forward_rows import CountingExperts

# (cached prefix, chunk): odd lengths; a chunk past the DSA fixtures' index_topk (8) after a prefix; one past
# the bf16 kernel's PROMPT_KERNEL_ROWS (that op then goes chunk by chunk); a one-position chunk (its own forward).
CHUNKS = [(0, [1, 5, 9, 3, 7, 2, 11]), (4, [4, 4, 2]), (0, list(range(3, 3 + PROMPT_KERNEL_ROWS + 5))), (9, [7, 8])]
ONE_POSITION = (3, [6])
SHORT = [CHUNKS[0], CHUNKS[1], (0, list(range(20, 31))), CHUNKS[3]]  # every op over all rows in one call


def prefixed_caches(model, experts, chunks):
    """A cache per chunk holding its prefix (positions of other ids before it)."""
    caches = []
    for prefix, _ in chunks:
        cache = model.new_cache()
        if prefix:
            model.forward(torch.tensor([[10 + i % 7 for i in range(prefix)]]), 0, cache, experts)
        caches.append(cache)
    return caches


def cache_rows(cache) -> list[torch.Tensor]:
    """What a cache's positions so far add to a session's log (MLA: every row; DeepSeek-V4, whose cache
    frees rows as it goes: the compressed entries)."""
    return [rows.clone() for rows in cache.log_view().entries(0, cache.length)]


def assert_each_as_alone(model, experts, chunks):
    caches = prefixed_caches(model, experts, chunks)
    together = model.forward_prompts([torch.tensor([c]) for _, c in chunks], caches, experts)
    alone_caches = prefixed_caches(model, experts, chunks)
    for (prefix, chunk), logits, cache, own in zip(chunks, together, caches, alone_caches, strict=True):
        expected = model.forward(torch.tensor([chunk]), prefix, own, experts, last_only=True)
        assert logits.shape == expected.shape == (1, 1, model.args.vocab_size)
        assert torch.equal(logits, expected), (len(chunk), (logits - expected).abs().max())
        assert cache.length == own.length == prefix + len(chunk)
        for mine, theirs in zip(cache_rows(cache), cache_rows(own), strict=True):
            assert torch.equal(mine, theirs)


def test_every_family_reads_prompt_chunks_together_with_their_own_bits(loaded):
    for chunks in (CHUNKS, SHORT, [*CHUNKS[:2], ONE_POSITION]):
        assert_each_as_alone(loaded.model, loaded.experts, chunks)


@pytest.mark.parametrize(
    ("experts", "dense", "activations"),
    [("int4", "bf16", "float32"), ("int4", "int8", "float32"), ("bf16", "f32", "float32"), ("int4", "int8", "int8")],
)
def test_containers_under_a_tight_budget_read_chunks_together_with_their_own_bits(
    make_container, experts, dense, activations
):
    """The C kernels (4-bit experts in one call or the dequantised matmul, bf16 and int8 dense, int8
    activations) and torch (bf16 experts, float32 dense), through the tiered store where it misses."""
    loaded = load(make_container("glm_moe_dsa", experts, dense), "float32", StoreOptions(ram="30%"), activations)
    try:
        before = loaded.experts.snapshot()
        assert_each_as_alone(loaded.model, loaded.experts, CHUNKS)
        assert_each_as_alone(loaded.model, loaded.experts, SHORT)
        assert loaded.experts.snapshot().minus(before).misses > 0
    finally:
        loaded.experts.close()


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_the_demo_model_reads_chunks_together_with_their_own_bits(tmp_path_factory, activations):
    """The demo model's widths (256, 128) take the kernels' SIMD paths, where a row's bits depend on the rows
    grouped with it (the tiny fixtures' odd widths mostly take the scalar loops, which do not)."""
    path = tmp_path_factory.mktemp("demo") / "container"
    Converter(demo_model_dir(), path, ConvertOptions(experts="int4", dense="bf16"), progress=False).run()
    loaded = load(path, "float32", StoreOptions(ram="100%"), activations)
    try:
        for chunks in (SHORT, CHUNKS):
            assert_each_as_alone(loaded.model, loaded.experts, chunks)
    finally:
        loaded.experts.close()


def test_chunks_read_together_acquire_each_expert_once_per_layer(tiny_checkpoints):
    from colibri_stream.runtime.loader import load_checkpoint

    loaded = load_checkpoint(tiny_checkpoints["deepseek_v3"])
    model = loaded.model
    counting = CountingExperts(loaded.experts)
    caches = prefixed_caches(model, loaded.experts, CHUNKS)
    model.forward_prompts([torch.tensor([c]) for _, c in CHUNKS], caches, counting)
    per_layer: dict[int, list[int]] = {}
    for layer, ids in counting.acquired:
        per_layer.setdefault(layer, []).extend(ids)
    assert per_layer  # the fixture has MoE layers
    for ids in per_layer.values():
        assert len(ids) == len(set(ids))


def test_a_batch_reads_waiting_prompts_in_one_forward_with_their_solo_tokens(tiny_checkpoints, monkeypatch):
    from colibri_stream.runtime.loader import load_checkpoint

    loaded = load_checkpoint(tiny_checkpoints["glm_moe_dsa"])
    model, experts = loaded.model, loaded.experts
    calls: list[list[int]] = []
    forward_prompts = type(model).forward_prompts

    def counted(self, chunks, caches, source):
        calls.append([c.shape[1] for c in chunks])
        return forward_prompts(self, chunks, caches, source)

    monkeypatch.setattr(type(model), "forward_prompts", counted)
    prompts = [[1, 5, 9, 3, 7, 2, 11], [4, 4, 2], [6, 1, 2, 3, 4, 5, 6, 12, 13]]
    batch = ContinuousBatch(model, experts, 32)
    generations = [batch.add(GenerationRequest(p, 6)) for p in prompts]
    while batch:
        batch.step()
    assert calls == [[7, 3, 9]]  # the three prompts, one forward
    for generation, prompt in zip(generations, prompts, strict=True):
        assert generation.result.ids == generate(model, prompt, 6, experts, prefill_chunk=32).ids


def test_segments_are_scoped_and_checked():
    assert row_segments(7) is None
    with rows_in_segments([3, 4]):
        assert row_segments(7) == (3, 4)
        with pytest.raises(ValueError, match="over 5 rows"):
            row_segments(5)
        with one_segment():
            assert row_segments(5) is None
        with rows_alone():
            assert row_segments(5) is None  # alone: every row on its own already
    with rows_in_segments([7]):
        assert row_segments(7) is None  # one segment: the op as it is


def test_linear_and_row_functions_go_segment_by_segment():
    """A float32 matmul and a vectorised transcendental function over an odd width: torch's bits for a row
    depend on the rows beside it, so inside segments each segment is its own call."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, 12, 37, generator=gen), torch.randn(19, 37, generator=gen)
    sizes = [5, 1, 6]
    parts = x[0].split(sizes)
    with rows_in_segments(sizes):
        assert torch.equal(linear(x, w)[0], torch.cat([F.linear(p, w) for p in parts]))
        assert torch.equal(per_row(F.silu, x)[0], torch.cat([F.silu(p) for p in parts]))
        assert torch.equal(by_segment(torch.mul, x, x)[0], x[0] * x[0])


@pytest.mark.skipif(not bf16_kernel_available(), reason="the bf16 kernel has no SIMD path here")
def test_bf16_kernel_groups_each_segments_rows_as_its_own_call():
    gen = torch.Generator().manual_seed(3)
    for out_dim, in_dim in [(130, 384), (33, 96)]:
        w = torch.randn(out_dim, in_dim, generator=gen).bfloat16()
        sizes = [11, 3, 9, 1, 17]
        x = torch.randn(sum(sizes), in_dim, generator=gen)
        own = torch.cat([bf16_matmul(part, w) for part in x.split(sizes)])
        assert torch.equal(bf16_matmul(x, w, segments=sizes), own)
        assert not torch.equal(bf16_matmul(x, w), own)  # groups across segments: other bits, so the test bites
        with rows_in_segments(sizes):
            assert torch.equal(bf16_linear(x, w), own)
        y = torch.randn(PROMPT_KERNEL_ROWS + 3, in_dim, generator=gen)
        expected = torch.cat([bf16_linear(y[: PROMPT_KERNEL_ROWS + 1], w), bf16_linear(y[-2:], w)])
        with rows_in_segments([PROMPT_KERNEL_ROWS + 1, 2]):  # a segment past the kernel's rows: one by one
            assert torch.equal(bf16_linear(y, w), expected)
        with pytest.raises(ValueError, match="segments"):
            bf16_matmul(x, w, segments=[11, 3])
