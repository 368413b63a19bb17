"""The CUDA VRAM tier: experts computed on the GPU from side-stream copies; skipped without CUDA.

tools/cuda_check.sh runs these and the CUDA micro-benchmark on a GPU machine (<= 5 minutes).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from colibri_stream.bench.kernels import KINDS, make_experts, random_kind_matrix
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_container
from engine.kernels.quant import QuantizedExpert
from storage.container.reader import Container
from storage.tiers.config import StoreConfig
from storage.tiers.tiered import minimum_slots

pytestmark = pytest.mark.gpu

PROMPT = [5, 9, 17, 33, 65, 129, 257, 300, 11, 23]
NEW_TOKENS = 24


def _to(expert: QuantizedExpert, device: str) -> QuantizedExpert:
    return QuantizedExpert(
        *(replace(m, q=m.q.to(device), scales=m.scales.to(device)) for m in (expert.w1, expert.w2, expert.w3))
    )


@pytest.mark.parametrize("rows", [1, 4, 64])
def test_int4_expert_on_cuda_equals_the_cpu_kernel(rows):
    cpu = make_experts(1, dim=512, inter=256)[0]
    gpu = _to(cpu, "cuda")
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    assert gpu.device.type == "cuda"
    expected, got = cpu(x), gpu(x.cuda()).cpu()
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (got - expected).abs().max()


@pytest.fixture(scope="module")
def resident(stream_container):
    return load_container(stream_container)


def _streamed(stream_container, vram_slots: int, ram: str = "100%", prefetch: bool = True):
    container = Container(stream_container)
    # "min": the floor (top-k records), so a prompt's experts come in chunks released while the GPU may
    # still read their VRAM slots; "layer": one layer's experts, one acquire per layer
    slots = {"min": minimum_slots(container), "layer": container.n_experts}.get(ram)
    ram_bytes = container.expert_bytes if slots is None else slots * container.layout.record_bytes
    config = StoreConfig(
        ram_bytes=ram_bytes,
        vram_bytes=vram_slots * container.layout.record_bytes,
        vram_device="cuda",
        prefetch=prefetch,
        preload=False,  # RAM is read as the model asks at every budget, 100% included
    )
    return load_container(stream_container, store=config)


@pytest.mark.parametrize("vram_slots", [2, 16, 10_000], ids=["2-slots", "16-slots", "all"])
@pytest.mark.parametrize("ram", ["min", "layer", "100%"])
def test_cuda_vram_tier_generates_the_resident_tokens(stream_container, resident, vram_slots, ram):
    """Tiny VRAM tiers reuse slots constantly (the side-stream hazards); "all" computes every expert on the GPU."""
    expected = generate(resident.model, PROMPT, NEW_TOKENS, resident.experts).ids
    loaded = _streamed(stream_container, vram_slots, ram)
    try:
        assert generate(loaded.model, PROMPT, NEW_TOKENS, loaded.experts).ids == expected
        stats = loaded.experts.report()
        staged = len(loaded.experts.vram.entries)
    finally:
        loaded.experts.close()
    container = loaded.experts.container
    assert staged == min(vram_slots, len(container.moe_layers) * container.n_experts)
    if vram_slots > container.experts_per_token:
        # more slots than a layer's experts: some stay between tokens (2 slots: every expert is staged
        # through them, used once, as the layer pins all it routes to)
        assert stats["hits"]["vram"] > 0
    assert stats["hits"]["ram"] + stats["hits"]["vram"] + stats["misses"] == stats["expert_requests"]


def test_cuda_vram_logits_equal_the_cpu_path(stream_container, resident):
    """One prefill and one decode step: logits with every expert on the GPU within float tolerance."""
    loaded = _streamed(stream_container, 10_000)
    try:
        logits = {}
        for name, model, experts in (("cpu", resident.model, resident.experts), ("gpu", loaded.model, loaded.experts)):
            cache = model.new_cache()
            with torch.no_grad():
                prefill = model(torch.tensor([PROMPT]), 0, cache, experts)
                step = model(torch.tensor([[7]]), len(PROMPT), cache, experts)
            logits[name] = torch.cat([prefill[0], step[0]])
    finally:
        loaded.experts.close()
    assert torch.allclose(logits["gpu"], logits["cpu"], rtol=1e-4, atol=1e-4), (
        (logits["gpu"] - logits["cpu"]).abs().max()
    )


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rows", [1, 5])
def test_every_record_kind_on_cuda_equals_the_cpu_kernel(kind, rows):
    """The VRAM path dequantises on the GPU (engine.kernels.quant.dequantize_torch): every code and scale kind, a
    ragged odd width (119) included, equals the CPU kernel."""
    cpu = random_kind_matrix(*KINDS[kind], 64, 119, torch.Generator().manual_seed(rows))
    gpu = replace(cpu, q=cpu.q.cuda(), scales=cpu.scales.cuda())
    x = torch.randn(rows, 119, generator=torch.Generator().manual_seed(rows))
    expected, got = cpu.matmul(x), gpu.matmul(x.cuda()).cpu()
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (got - expected).abs().max()
