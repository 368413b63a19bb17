"""A prompt read layer by layer (Model.forward_prompt) against the same chunks read one after another:
the same bits, and under a budget that holds a layer's experts but not the model's, each expert read once
per layer instead of once per chunk."""

from __future__ import annotations

import pytest
import torch

from colibri_stream.devtools.fixtures import make_prompt
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_container
from storage.container.reader import Container
from storage.tiers.config import StoreConfig

CHUNK = 7  # 45 positions: six chunks of 7 and one of 3


def _chunk_by_chunk(model, tokens, experts, chunk=CHUNK, last_only=False):
    cache = model.new_cache()
    starts = range(0, tokens.shape[1], chunk)
    logits = [model(tokens[:, start : start + chunk], start, cache, experts, last_only=last_only) for start in starts]
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_prompt_read_layer_by_layer_gives_the_chunked_bits(loaded, activations):
    """Logits of every position and every cached row, bit for bit, with both activation paths; on DSA
    families each chunk keeps its own selection from layer to layer."""
    model, experts = loaded.model, loaded.experts
    tokens = torch.tensor([make_prompt(loaded.args.vocab_size, 45, seed=5)])
    model.int8_activations = activations == "int8"
    try:
        chunked, chunked_cache = _chunk_by_chunk(model, tokens, experts)
        cache = model.new_cache()
        windowed = model.forward_prompt(tokens, 0, cache, experts, CHUNK)
        last = model.forward_prompt(tokens[:, :20], 0, model.new_cache(), experts, CHUNK, last_only=True)
        chunked_last = _chunk_by_chunk(model, tokens[:, :20], experts, last_only=True)[0]
    finally:
        model.int8_activations = False
    assert windowed.shape == chunked.shape == (1, 45, loaded.args.vocab_size)
    assert torch.equal(windowed, chunked)
    assert last.shape == (1, 1, loaded.args.vocab_size) and torch.equal(last[0, -1], chunked_last[0, -1])
    assert cache.length == chunked_cache.length == 45
    if cache.log_view().frees_rows:  # DeepSeek-V4 reads prompts chunk by chunk (its rows are gone here)
        return
    for ours, theirs in zip(cache.log_view().rows(0, 45), chunked_cache.log_view().rows(0, 45), strict=True):
        assert torch.equal(ours, theirs)


def _store(stream_container, layers_held: int):
    """A cold store whose RAM holds ``layers_held`` layers' experts, reads counted (no preload, no prefetch)."""
    container = Container(stream_container)
    ram = layers_held * container.n_experts * container.layout.record_bytes
    return load_container(stream_container, store=StoreConfig(ram_bytes=ram, preload=False, prefetch=False))


def test_a_prompt_alone_reads_each_expert_once_per_layer(stream_container):
    """64 positions in chunks of 16 under a budget of two layers' experts (of seven): read layer by layer,
    every routed expert is acquired once and read once; chunk by chunk each chunk reads most of them again.
    The greedy tokens are the same."""
    prompt = make_prompt(512, 64, seed=9)
    windowed = _store(stream_container, 2)
    ids = generate(windowed.model, prompt, 1, windowed.experts, prefill_chunk=16).ids  # the prompt's forward only
    by_layer = windowed.experts.report()
    windowed.experts.close()
    container = Container(stream_container)
    n_routed = len(container.moe_layers) * container.n_experts
    assert by_layer["misses"] == by_layer["expert_requests"] <= n_routed  # each acquired once, read once

    chunked = _store(stream_container, 2)
    cache = chunked.model.new_cache()
    tokens = torch.tensor([prompt])
    for start in range(0, 64, 16):
        logits = chunked.model(tokens[:, start : start + 16], start, cache, chunked.experts, last_only=True)
    by_chunk = chunked.experts.report()
    chunked.experts.close()
    assert int(logits[0, -1].argmax()) == ids[0]
    assert by_chunk["expert_requests"] > by_layer["expert_requests"]
    assert by_chunk["misses"] > 2 * by_layer["misses"]  # each chunk read again what the budget could not keep
