"""Fixtures the engine tests share."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def odd_checkpoint(tmp_path_factory) -> Path:
    """Widths no kernel block divides: hidden 200, q LoRA 72, kv LoRA 40, 3 heads of 24 + 16 (rope), v 20."""
    from colibri_stream.bench.stress_model import QUICK, write_stress_checkpoint

    shape = dataclasses.replace(
        QUICK, hidden_size=200, q_lora_rank=72, kv_lora_rank=40, num_attention_heads=3, qk_nope_head_dim=24,
        qk_rope_head_dim=16, v_head_dim=20, moe_intermediate_size=96, intermediate_size=136, vocab_size=300,
    )  # fmt: skip
    return write_stress_checkpoint(tmp_path_factory.mktemp("odd-mla") / "hf", shape, progress=False)


def _convert(source: Path, dst: Path, dense: str) -> Path:
    from colibri_stream.convert.converter import Converter, ConvertOptions

    Converter(source, dst, ConvertOptions(experts="int4", dense=dense, group_size=32), progress=False).run()
    return dst


@pytest.fixture(scope="session")
def odd_container(odd_checkpoint, tmp_path_factory) -> Path:
    """The odd widths, int8 dense (the int8 path's container)."""
    return _convert(odd_checkpoint, tmp_path_factory.mktemp("odd-int8") / "c", "int8")


@pytest.fixture(scope="session")
def odd_bf16_container(odd_checkpoint, tmp_path_factory) -> Path:
    """The odd widths, bf16 dense (the default container's float32 path)."""
    return _convert(odd_checkpoint, tmp_path_factory.mktemp("odd-bf16") / "c", "bf16")
