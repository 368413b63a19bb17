"""One query's MLA attention in two C calls (engine/mla/decode.py): with int8 activations, and on the float32
path with bf16 projections (the default container), a decode step's attention gives the bits of the module
path it replaces, on every MLA family (DSA's indexer between the calls), at odd widths, alone or as one row
of forward_rows, and a failed step leaves the cache as it was."""

from __future__ import annotations

import pytest
import torch

import engine.mla.model
from colibri_stream.runtime.loader import load_container
from engine.kernels import decode_ops
from engine.kernels.bf16 import Bf16Linear, bf16_kernel_available
from engine.kernels.modes import int8_activations
from engine.mla import decode as mla_decode
from engine.mla import fused_decode
from engine.mla.decode import FusedMLA

pytestmark = pytest.mark.skipif(not decode_ops.available(), reason="the C kernels are not built")

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def _greedy(model, experts, steps: int, rows: bool = False) -> tuple[list[int], list[torch.Tensor], list]:
    """Prompt, then ``steps`` greedy decode steps: (tokens, each step's logits, the cache's final state)."""
    cache, tokens, logits = model.new_cache(), list(PROMPT), []
    out = model(torch.tensor([tokens]), 0, cache, experts)[0, -1]
    for _ in range(steps):
        tokens.append(int(out.argmax()))
        if rows:
            out = model.forward_rows([tokens[-1]], [cache], experts)[0]
        else:
            out = model(torch.tensor([[tokens[-1]]]), cache.length, cache, experts)[0, -1]
        logits.append(out)
    return tokens, logits, cache.state()


def _compare(model, experts, monkeypatch, rows: bool = False) -> int:
    """Fused against the module path: the same tokens, logits and cache bits; returns the fused calls. (A
    forward_rows step keeps the module path here: the whole step in one call is test_fused_decode.py's.)"""
    calls = []
    original = FusedMLA.__call__
    monkeypatch.setattr(FusedMLA, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    with fused_decode.module_path():
        fused = _greedy(model, experts, 5, rows)
    with fused_decode.module_path(), monkeypatch.context() as off:
        off.setattr(engine.mla.model, "fused_attention_applies", lambda *a: False)
        plain = _greedy(model, experts, 5, rows)
    assert fused[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(fused[1], plain[1], strict=True))
    for a, b in zip(fused[2], plain[2], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(calls)


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa"])
def test_fused_attention_gives_the_module_paths_bits(make_container, family, monkeypatch):
    loaded = load_container(make_container(family, "int4", "int8"), int8_activations=True)
    calls = _compare(loaded.model, loaded.experts, monkeypatch)
    assert calls == 5 * len(loaded.model.layers)  # every decode step of every layer, none of the prompt's


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa"])
def test_int4_dense_matrices_give_the_module_paths_bits_too(make_container, family, monkeypatch):
    """--dense int4: the C steps read wq_a/wq_b/wkv_a/wo as int4 codes (wkv_b stays int8)."""
    loaded = load_container(make_container(family, "int4", "int4"), int8_activations=True)
    assert loaded.model.layers[1].attn.wq_b.code == "int4"
    calls = _compare(loaded.model, loaded.experts, monkeypatch)
    assert calls == 5 * len(loaded.model.layers)


@pytest.mark.skipif(not bf16_kernel_available(), reason="no SIMD path for the bf16 kernel: bf16 weights stay float32")
@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa"])
def test_float_path_with_bf16_projections_gives_the_module_paths_bits(make_container, family, monkeypatch):
    """The default container (bf16 dense, float32 activations): the C steps read the projections as bf16
    (the kernel Bf16Linear calls) and wkv_b as float32."""
    loaded = load_container(make_container(family, "int4", "bf16"))
    assert isinstance(loaded.model.layers[1].attn.wkv_a, Bf16Linear)
    assert _compare(loaded.model, loaded.experts, monkeypatch) == 5 * len(loaded.model.layers)
    assert _compare(loaded.model, loaded.experts, monkeypatch, rows=True) == 5 * len(loaded.model.layers)


@pytest.mark.skipif(not bf16_kernel_available(), reason="no SIMD path for the bf16 kernel: bf16 weights stay float32")
def test_float_path_at_odd_widths_gives_the_module_paths_bits(odd_bf16_container, monkeypatch):
    loaded = load_container(odd_bf16_container)
    assert _compare(loaded.model, loaded.experts, monkeypatch) == 5 * len(loaded.model.layers)


def test_one_row_of_forward_rows_takes_it_too(make_container, monkeypatch):
    loaded = load_container(make_container("deepseek_v32", "int4", "int8"), int8_activations=True)
    assert _compare(loaded.model, loaded.experts, monkeypatch, rows=True) == 5 * len(loaded.model.layers)


def test_odd_widths_give_the_module_paths_bits(odd_container, monkeypatch):
    loaded = load_container(odd_container, int8_activations=True)
    assert _compare(loaded.model, loaded.experts, monkeypatch) == 5 * len(loaded.model.layers)


def test_a_failed_step_leaves_the_cache_as_it_was(make_container, monkeypatch):
    loaded = load_container(make_container("deepseek_v3", "int4", "int8"), int8_activations=True)
    model, experts = loaded.model, loaded.experts
    cache = model.new_cache()
    model(torch.tensor([PROMPT]), 0, cache, experts)
    before = cache.state()

    real = mla_decode._kernels

    class Failing:
        """The extension, but its projection step fails as on a machine out of memory."""

        def __getattr__(self, name):
            if name != "mla_project":
                return getattr(real, name)

            def fail(*args):
                raise MemoryError("no memory for the work area")

            return fail

    monkeypatch.setattr(mla_decode, "_kernels", Failing())
    with pytest.raises(MemoryError):
        model(torch.tensor([[7]]), cache.length, cache, experts)
    assert cache.length == len(PROMPT)
    after = cache.state()
    assert all(torch.equal(before[i]["latent"], after[i]["latent"]) for i in range(len(before)))


def test_layers_without_int8_records_or_bf16_weights_keep_the_module_path(make_container):
    loaded = load_container(make_container("deepseek_v3", "int4", "f32"), int8_activations=True)
    block = loaded.model.layers[0]
    assert FusedMLA.build(block.attn_norm, block.attn) is None  # float32 projections
    x = torch.zeros(1, 1, loaded.args.dim)
    cache = loaded.model.new_cache().layers[0]
    with int8_activations():
        assert block._fused_attention(x, cache, None) is None
    assert block._fused is False  # decided once, at the first step it could apply to


def test_only_decode_rows_with_the_c_ops_on_take_it(make_container):
    loaded = load_container(make_container("deepseek_v3", "int4", "int8"), int8_activations=True)
    block, dim = loaded.model.layers[0], loaded.args.dim
    cache = loaded.model.new_cache().layers[0]
    assert not mla_decode.fused_attention_applies(torch.zeros(1, 3, dim), cache, None)  # a prompt's positions
    assert mla_decode.fused_attention_applies(torch.zeros(1, 1, dim), cache, None)  # a float32 decode row
    with decode_ops.torch_ops():
        assert not mla_decode.fused_attention_applies(torch.zeros(1, 1, dim), cache, None)
    assert not mla_decode.fused_attention_applies(torch.zeros(1, 1, dim, dtype=torch.float64), cache, None)
    with int8_activations():
        assert mla_decode.fused_attention_applies(torch.zeros(1, 1, dim), cache, None)
        assert not mla_decode.fused_attention_applies(torch.zeros(1, 1, dim), cache, False)  # expanded forced
    assert block._fused is None  # nothing built by asking
