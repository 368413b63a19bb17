"""Key blocks expanded through wkv_b, kept across the chunks of one prompt window in one layer.

forward_prompt (engine/mla/model.py) runs a window's chunks through a layer one after another, and each
chunk's key-blocked expanded attention (engine/mla/prefill.py expanded_blocks) expands every earlier key
block's latents again: the 32 chunks of an 8192-token prompt expanded 16.5 times the latents there are.
The cache only grows inside that loop, so a full key block's latents do not change from one chunk to the
next: inside ``expansions_kept`` each full block is expanded once, by the same call on the same latents
(the same bits), and the later chunks read it. A chunk's partial last block is expanded as before.

Kept until the layer's chunks are done, at most KEPT_EXPANSION_BYTES (colibri_stream/planning/family_memory.py
counts it); blocks past that are expanded chunk by chunk as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from engine.kernels.rows import Linear, products_on_threads

# The stress model's 8192 positions take 64 MiB per layer (16 heads x 128 float32); DeepSeek-V3's 128 heads
# x 256 in float32 keep the first 2048 positions.
KEPT_EXPANSION_BYTES = 256 << 20

# (one sequence's latents [T, c], a key block of them, whether it is a whole key block) -> [Tk, H * (n + v)]
BlockExpansion = Callable[[torch.Tensor, slice, bool], torch.Tensor]


class KeptExpansions:
    """Full key blocks' expansions by (sequence, first position, end), up to ``limit`` bytes."""

    def __init__(self, limit: int):
        self.limit = limit
        self.bytes = 0
        self.blocks: dict[tuple[int, int, int], torch.Tensor] = {}

    def expansion(self, wkv_b: Linear, latents: torch.Tensor, keys: slice, sequence: int, full: bool) -> torch.Tensor:
        """Block ``keys`` of sequence ``sequence``'s latents [T, c] expanded, or its kept expansion; kept
        when ``full`` (a whole key block: its latents stay as they are while the cache grows) and it fits."""
        key = (sequence, keys.start, keys.stop)
        kept = self.blocks.get(key)
        if kept is not None:
            return kept
        kv = expand_block(wkv_b, latents, keys)
        size = kv.numel() * kv.element_size()
        if full and self.bytes + size <= self.limit:
            self.blocks[key] = kv
            self.bytes += size
        return kv


_kept: ContextVar[KeptExpansions | None] = ContextVar("kept_expansions", default=None)


@contextmanager
def expansions_kept(limit: int = KEPT_EXPANSION_BYTES) -> Iterator[KeptExpansions]:
    """Inside, the cache of every sequence only grows (one layer's pass over a prompt window's chunks): full
    key blocks' expansions are kept and reused; gone on exit."""
    kept = KeptExpansions(limit)
    token = _kept.set(kept)
    try:
        yield kept
    finally:
        _kept.reset(token)


def expand_block(wkv_b: Linear, latents: torch.Tensor, keys: slice) -> torch.Tensor:
    """latents [T, c] -> the block's [Tk, H * (n + v)]: a product split by output rows, so its bits do not
    follow the threads (engine/kernels/rows.py products_on_threads)."""
    block = latents[keys]
    with products_on_threads(block.shape[0] * wkv_b.weight.numel()):
        return wkv_b(block)


def block_expansion(wkv_b: Linear, sequence: int) -> BlockExpansion:
    """wkv_b over key blocks of sequence ``sequence``'s latents, through the kept expansions where there are."""
    kept = _kept.get()

    def expand(latents: torch.Tensor, keys: slice, full: bool) -> torch.Tensor:
        if kept is None:
            return expand_block(wkv_b, latents, keys)
        return kept.expansion(wkv_b, latents, keys, sequence, full)

    return expand
