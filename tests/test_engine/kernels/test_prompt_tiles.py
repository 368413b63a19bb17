"""`--activations int8-tiles` (engine/csrc/q8_tiles.h): a model's prompts (forward_prompt, forward_prompts) compute
their int8 rows as tile GEMMs; decoded rows keep q8_gemm's products. The plain C loop gives the vector path's bytes,
so these run on any host (the model is set as the loader sets it where the CPU has AVX-512 VNNI)."""

from __future__ import annotations

import copy

import pytest
import torch

from colibri_stream.errors import ColibriError
from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.worker import _engine_context
from colibri_stream.runtime import loader
from colibri_stream.runtime.loader import load, load_container
from engine.kernels.modes import prompt_rows, rows_are_prompt
from engine.kernels.quant import int4_kernel_available

needs_kernel = pytest.mark.skipif(not int4_kernel_available(), reason="the C kernels are not built")
PROMPT = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]])  # 17 positions: chunks 8, 8, 1


def int8_model(path: str, tiles: bool):
    loaded = load_container(path, int8_activations=True)
    loaded.model.prompt_tiles = tiles
    return loaded


@needs_kernel
@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa"])
def test_a_prompt_is_the_same_in_windows_chunks_and_batches_and_only_near_the_decode_numbers(make_container, family):
    path = make_container(family, "int4", "int8")
    tiles, plain = int8_model(path, True), int8_model(path, False)
    model, experts = tiles.model, tiles.experts
    window_cache = model.new_cache()
    windowed = model.forward_prompt(PROMPT, 0, window_cache, experts, chunk=8)
    chunk_cache = model.new_cache()
    with prompt_rows():  # what forward_prompt promises: the chunked forwards' logits and cache, in prompt_rows()
        chunked = torch.cat([model(part, 8 * i, chunk_cache, experts) for i, part in enumerate(PROMPT.split(8, 1))], 1)
    assert torch.equal(windowed, chunked)
    assert torch.equal(window_cache.layers[1].latent[:, :17], chunk_cache.layers[1].latent[:, :17])
    batched = model.forward_prompts([PROMPT[:, :9], PROMPT[:, 9:]], [model.new_cache(), model.new_cache()], experts)
    alone = model.forward_prompt(PROMPT[:, 9:], 0, model.new_cache(), experts, chunk=8, last_only=True)
    assert torch.equal(batched[1], alone)
    decoded = plain.model.forward_prompt(PROMPT, 0, plain.model.new_cache(), plain.experts, chunk=8)
    assert not torch.equal(windowed, decoded)  # the tile products really ran
    near = 1e-3 if family == "deepseek_v3" else 0.1  # DSA: a last-bit change can flip the indexer's top-k
    assert (windowed - decoded).abs().max() <= near * decoded.abs().max()


@needs_kernel
def test_decoded_rows_keep_q8_gemms_products(make_container):
    """The token after a prompt: from the same cache, the same logits with tiles on or off (decode is not a
    prompt); the two models' prompts themselves leave different caches."""
    path = make_container("deepseek_v3", "int4", "int8")
    tiles, plain = int8_model(path, True), int8_model(path, False)
    cache, twin = tiles.model.new_cache(), plain.model.new_cache()
    tiles.model.forward_prompt(PROMPT, 0, cache, tiles.experts, chunk=8)
    plain.model.forward_prompt(PROMPT, 0, twin, plain.experts, chunk=8)
    assert not torch.equal(cache.layers[1].latent, twin.layers[1].latent)
    same = copy.deepcopy(cache)
    token = torch.tensor([[4]])
    assert torch.equal(tiles.model(token, 17, cache, tiles.experts), plain.model(token, 17, same, plain.experts))


def test_int8_tiles_needs_the_vector_path_and_float32(make_container, monkeypatch):
    path = make_container("deepseek_v3", "int4", "int8")
    with pytest.raises(ColibriError, match="--activations int8-tiles"):
        load(path, "bfloat16", activations="int8-tiles")
    monkeypatch.setattr(loader, "tiles_fast", lambda: False)
    with pytest.raises(ColibriError, match="AVX-512 VNNI tile GEMMs, which this CPU or build lacks"):
        load(path, "float32", activations="int8-tiles")


def test_a_worker_computes_in_the_prompt_mode_its_request_names():
    with _engine_context(wire.FLAG_INT8_ACTIVATIONS | wire.FLAG_PROMPT_ROWS):
        assert rows_are_prompt()
    with _engine_context(wire.FLAG_INT8_ACTIVATIONS):
        assert not rows_are_prompt()
