"""Fixtures the engine tests share."""

from __future__ import annotations

import dataclasses

import pytest


@pytest.fixture(scope="session")
def odd_container(tmp_path_factory):
    """Widths no kernel block divides: hidden 200, q LoRA 72, kv LoRA 40, 3 heads of 24 + 16 (rope), v 20."""
    from colibri_stream.bench.stress_model import QUICK, write_stress_checkpoint
    from colibri_stream.convert.converter import Converter, ConvertOptions

    root = tmp_path_factory.mktemp("odd-mla")
    shape = dataclasses.replace(
        QUICK, hidden_size=200, q_lora_rank=72, kv_lora_rank=40, num_attention_heads=3, qk_nope_head_dim=24,
        qk_rope_head_dim=16, v_head_dim=20, moe_intermediate_size=96, intermediate_size=136, vocab_size=300,
    )  # fmt: skip
    source = write_stress_checkpoint(root / "hf", shape, progress=False)
    Converter(source, root / "c", ConvertOptions(experts="int4", dense="int8", group_size=32), progress=False).run()
    return root / "c"
