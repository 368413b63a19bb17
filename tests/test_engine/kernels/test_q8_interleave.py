"""The q8 kernel's interleaved layout (engine/csrc/q8.h): a matrix's codes and scales regrouped per 4 rows and
span of 512 columns, so a 4-row block is one forward stream. The same products in the same order, so the
same bytes as the row-major matrix: checked per instruction set, row count, weight and scale kind; the
loader holds a model's dense codes so where the shape allows, and its resident experts too (streamed ones
stay row-major), and decoding gives the same tokens."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import colibri_stream.experts.codec as codec
import colibri_stream.runtime.loader as loader
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_container
from engine.kernels.int8_dense import CodedLinear
from engine.kernels.interleaved_expert import InterleavedExpert
from engine.kernels.q8 import ISA_AVX2, ISA_BEST, ISA_SCALAR, deinterleave, interleavable, interleave, q8_matmul
from engine.kernels.quant import KERNEL_SCALES, QuantizedExpert
from storage.container.reader import Container
from storage.tiers.config import StoreConfig

pytest.importorskip("engine.kernels._kernels")

SCALE_DTYPES = [torch.float16, torch.bfloat16, torch.uint8]  # uint8: e8m0 exponents


def coded(code: str, out_dim: int, in_dim: int, group: int, scale_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if code == "int4":
        q = torch.randint(0, 256, (out_dim, in_dim // 2), dtype=torch.uint8, generator=g)
    else:
        q = torch.randint(-127, 128, (out_dim, in_dim), dtype=torch.int8, generator=g)
    if scale_dtype == torch.uint8:
        scales = torch.randint(110, 125, (out_dim, in_dim // group), dtype=torch.uint8, generator=g)
    else:
        scales = (torch.rand(out_dim, in_dim // group, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    return q, scales


@pytest.mark.parametrize("code", ["int4", "int8"])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("group", [64, 128, 512])
def test_interleaving_round_trips_and_the_layout_is_the_documented_one(code, scale_dtype, group):
    q, scales = coded(code, 8, 1024, group, scale_dtype)
    packed = interleave(q, scales, code, group)
    back_q, back_scales = deinterleave(packed, code, scale_dtype, group)
    assert back_q.dtype == q.dtype and torch.equal(back_q, q)
    assert torch.equal(back_scales.view(torch.uint8), scales.view(torch.uint8))
    step = 32 if code == "int4" else 64
    code_bytes = 8 * 4 * step
    per = 512 // group
    # block 1 (rows 4..7), span 1 (columns 512..1023): chunk 3 of row 6, then row 5's scales
    span = packed[1, 1]
    row_chunk = q[6].view(torch.uint8)[(8 + 3) * step : (8 + 4) * step]
    assert torch.equal(span[(4 * 3 + 2) * step : (4 * 3 + 3) * step], row_chunk)
    scale_bytes = scales.view(torch.uint8).view(8, 2, -1)[5, 1]  # row 5's groups of span 1, as bytes
    size = scale_bytes.numel()
    assert size == per * scales.element_size()
    assert torch.equal(span[code_bytes + size : code_bytes + 2 * size], scale_bytes)


@pytest.mark.parametrize("code", ["int4", "int8"])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_the_interleaved_product_has_the_row_major_bytes(code, scale_dtype):
    for out_dim, in_dim, group in [(12, 1024, 64), (4, 1536, 128), (20, 512, 256), (8, 1024, 512)]:
        q, scales = coded(code, out_dim, in_dim, group, scale_dtype, seed=out_dim)
        packed = interleave(q, scales, code, group)
        kind = KERNEL_SCALES[scales.dtype]
        for rows in (1, 2, 3, 4, 5, 9, 37):  # 37: past two tiles of the kernel's rows (q8.c Q8_ROW_TILE)
            x = torch.randn(rows, in_dim, generator=torch.Generator().manual_seed(rows))
            x[0, :7] = 0  # a zero block's scale
            for isa in (ISA_SCALAR, ISA_AVX2, ISA_BEST):
                want = q8_matmul(x, q, scales, code, group, kind, isa)
                got = q8_matmul(x, packed, scales.new_empty(0), code, group, kind, isa, out_dim=out_dim)
                assert torch.equal(got, want), (out_dim, in_dim, group, rows, isa)


def test_which_shapes_interleave_and_the_kernel_refuses_the_others():
    assert interleavable("int4", 512, 4, 64) and interleavable("int8", 7168, 1536, 128)
    for in_dim, out_dim, group in [(448, 8, 64), (1000, 8, 64), (1024, 6, 64), (1024, 8, 32), (1024, 8, 192)]:
        assert not interleavable("int4", in_dim, out_dim, group), (in_dim, out_dim, group)
    q, scales = coded("int4", 8, 1024, 64, torch.float16)
    packed = interleave(q, scales, "int4", 64)
    with pytest.raises(ValueError, match="interleaved=1"):
        q8_matmul(torch.randn(1, 1024), packed, scales, "int4", 64, 0, out_dim=6)  # not whole 4-row blocks


def test_a_coded_linear_interleaves_where_it_can_and_computes_the_same():
    q, scales = coded("int4", 16, 1024, 64, torch.float16)
    layer = CodedLinear(q.clone(), scales.clone(), 64, "int4", 1024)
    x = torch.randn(3, 1024)
    before, matrix = layer(x), layer.matrix.dequantize(torch.float32)
    assert layer.c_matrix()[6] == 0
    assert layer.interleave() and layer.interleaved and not layer.interleave()  # once
    assert layer.q.shape == (4, 2, 8 * 4 * 32 + 4 * 8 * 2) and layer.scales.numel() == 0
    assert torch.equal(layer(x), before)
    assert torch.equal(layer.matrix.dequantize(torch.float32), matrix)
    assert layer.c_matrix()[6] == 1 and layer.c_matrix()[0] == layer.q.data_ptr()
    odd = CodedLinear(*coded("int4", 16, 448, 64, torch.float16), 64, "int4", 448)
    assert not odd.interleave() and not odd.interleaved


# widths of real models' kind: hidden, q and kv ranks, the experts' and attention's output widths span whole
# 512-column spans; the dense layer's FFN (1000) does not, so a model holds both layouts
WIDE = dict(
    hidden_size=512, q_lora_rank=512, kv_lora_rank=128, moe_intermediate_size=512, intermediate_size=1000,
    num_attention_heads=4, v_head_dim=128, qk_nope_head_dim=32, qk_rope_head_dim=16, n_routed_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, num_hidden_layers=3, first_k_dense_replace=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def wide_containers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wide")
    source = fixtures.build_tiny_checkpoint("deepseek_v3", root / "hf", config_overrides=WIDE)
    built = {}
    for dense in ("int8", "int4"):
        built[dense] = root / dense
        Converter(source, built[dense], ConvertOptions(experts="int4", dense=dense), progress=False).run()
    return built


@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_a_loaded_model_decodes_the_same_tokens_interleaved(wide_containers, dense, monkeypatch):
    held = load_container(wide_containers[dense], int8_activations=True)
    layers = {name: m for name, m in held.model.named_modules() if isinstance(m, CodedLinear)}
    assert layers["layers.1.attn.wq_a"].interleaved and layers["layers.1.ffn.shared_experts.w2"].interleaved
    assert layers["head"].interleaved and not layers["layers.0.ffn.w2"].interleaved  # in 1000: row-major
    monkeypatch.setattr(loader, "interleave_codes", lambda model: 0)
    row_major = load_container(wide_containers[dense], int8_activations=True)
    assert not any(m.interleaved for m in row_major.model.modules() if isinstance(m, CodedLinear))
    same_tokens_and_logits(held, row_major)


def same_tokens_and_logits(a: loader.LoadedModel, b: loader.LoadedModel) -> list[int]:
    prompt = fixtures.make_prompt(a.args.vocab_size, 23)
    ids = [generate(m.model, prompt, 12, m.experts).ids for m in (a, b)]
    assert ids[0] == ids[1]
    logits = [m.model(torch.tensor([prompt]), 0, m.model.new_cache(), m.experts) for m in (a, b)]
    assert torch.equal(logits[0], logits[1])  # the prompt's rows: several rows per expert call
    return ids[0]


@pytest.mark.parametrize("store", [None, StoreConfig(ram_bytes=1 << 30)], ids=["resident", "store-at-100%"])
def test_resident_experts_are_interleaved_and_decode_the_same_tokens(wide_containers, store, monkeypatch):
    path = wide_containers["int8"]
    held = load_container(path, int8_activations=True, store=store)
    monkeypatch.setattr(loader, "Settler", lambda layout: functools.partial(codec.expert_from_record, layout))
    row_major = load_container(path, int8_activations=True, store=store)
    for layer in (1, 2):
        assert {type(e) for e in held.experts.resident(layer) or ()} == {InterleavedExpert}
        assert {type(e) for e in row_major.experts.resident(layer) or ()} == {QuantizedExpert}
    same_tokens_and_logits(held, row_major)


def test_streamed_experts_stay_row_major_and_decode_the_tokens_of_interleaved_ones(wide_containers):
    path = wide_containers["int8"]
    record_bytes = Container(path).layout.record_bytes
    streamed = load_container(path, int8_activations=True, store=StoreConfig(ram_bytes=10 * record_bytes))
    assert streamed.experts.resident(1) is None  # 10 of 16 records: slots are reused, so none is settled
    resident = load_container(path, int8_activations=True)
    assert same_tokens_and_logits(streamed, resident)
