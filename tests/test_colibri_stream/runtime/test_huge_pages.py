"""The resident dense part moved into one huge-page arena at load (colibri_stream/runtime/huge_pages.py): every
weight lands there, tied weights stay one, and nothing computed from the old tensors survives the move (the
C steps' plans and the coded matrices' addresses are rebuilt: the same tokens and logits, bit for bit)."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from torch import nn

from colibri_stream.devtools.steps import decode_one_token, prefill
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.huge_pages import hold_in_huge_pages
from colibri_stream.runtime.loader import load

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MADV_HUGEPAGE is Linux's")


def mappings() -> list[tuple[int, int, set[str]]]:
    """(start, end, VmFlags) of every mapping of this process."""
    found: list[tuple[int, int, set[str]]] = []
    for line in open("/proc/self/smaps"):
        if m := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            found.append((int(m.group(1), 16), int(m.group(2), 16), set()))
        elif line.startswith("VmFlags:"):
            found[-1][2].update(line.split()[1:])
    return found


def mapping_of(t: torch.Tensor, maps: list[tuple[int, int, set[str]]]) -> tuple[int, int, set[str]]:
    return next(m for m in maps if m[0] <= t.data_ptr() < m[1])


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [t for t in [*model.parameters(), *model.buffers()] if t.is_contiguous() and t.numel() > 0]


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_loaded_models_dense_part_lies_in_one_huge_page_arena(make_container, activations):
    path = make_container("deepseek_v3", "int4", "int8" if activations == "int8" else "bf16")
    loaded = load(path, store=StoreOptions(ram="100%"), activations=activations)
    maps = mappings()
    arenas = {mapping_of(t, maps)[:2] for t in weights(loaded.model)}
    assert len(arenas) == 1  # one mapping holds them all ...
    (start, end), flags = arenas.pop(), mapping_of(weights(loaded.model)[0], maps)[2]
    assert "hg" in flags  # ... advised MADV_HUGEPAGE
    assert end - start >= sum(t.numel() * t.element_size() for t in weights(loaded.model))


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_moving_again_after_decoding_keeps_every_bit(make_container, activations):
    """A second move after the C steps were planned on the first arena (its memory freed once nothing holds
    it): were an address kept, the next steps would read freed memory."""
    path = make_container("glm_moe_dsa", "int4", "int8" if activations == "int8" else "bf16")
    loaded = load(path, store=StoreOptions(ram="100%", preload=True), activations=activations)
    model, experts = loaded.model, loaded.experts
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    before = generate(model, prompt, 12, experts).ids
    cache = model.new_cache()
    prefill(model, prompt, cache, experts)
    logits_before = decode_one_token(model, 7, cache, experts)
    old = {t.data_ptr() for t in weights(model)}

    assert hold_in_huge_pages(model) > 0
    assert not old & {t.data_ptr() for t in weights(model)}  # every weight moved
    torch.empty(64 << 20, dtype=torch.uint8).fill_(0xFF)  # reuse what the old arena freed, if anything
    assert generate(model, prompt, 12, experts).ids == before
    cache = model.new_cache()
    prefill(model, prompt, cache, experts)
    assert torch.equal(decode_one_token(model, 7, cache, experts), logits_before)


def test_tied_weights_stay_one_and_other_tensors_stay_put():
    first, second = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    second.weight = first.weight
    model = nn.Sequential(first, second, nn.LayerNorm(8))
    model.register_buffer("strided", torch.arange(16.0).view(4, 4).t())  # not contiguous: left where it is
    strided_at, value = model.strided.data_ptr(), first.weight.detach().clone()
    moved = hold_in_huge_pages(model)
    assert moved == 256 + 64 + 64  # one 8x8 float32 weight, the norm's two 8-float vectors padded to a cache line
    assert first.weight is second.weight and torch.equal(first.weight, value)
    assert model.strided.data_ptr() == strided_at
    maps = mappings()
    assert mapping_of(first.weight, maps) == mapping_of(model[2].bias, maps)
