"""Fixtures of the MLA prefill tests (test_prefill_attention.py, test_kept_expansions.py)."""

from __future__ import annotations

import pytest

import engine.mla.prefill as prefill_attention

BLOCK = 7  # positions per key block under small_blocks: no context in these tests is a multiple of it


@pytest.fixture
def small_blocks(monkeypatch):
    """Every key block BLOCK positions, so short test contexts span several."""
    monkeypatch.setattr(prefill_attention, "KEY_BLOCK_BYTES", 1)
    monkeypatch.setattr(prefill_attention, "MIN_KEY_BLOCK", BLOCK)
