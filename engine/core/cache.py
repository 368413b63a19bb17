"""The compressed MLA KV cache: per position and layer the latent and the roped key shared by all heads
(plus the DSA indexer key where a layer runs one). Nothing per head is stored: keys and values are rebuilt
from the latent (prefill) or never built (absorbed decode). Buffers grow by doubling, so a long decode
does not copy the cache per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Protocol, TypeVar

import torch

from engine.config.args import ModelArgs


def grow(buffer: torch.Tensor, needed: int) -> torch.Tensor:
    """buffer [B, capacity, ...] with room for ``needed`` positions: itself, or a copy twice as long."""
    if buffer.shape[1] >= needed:
        return buffer
    capacity = max(needed, 2 * buffer.shape[1], 16)
    bigger = buffer.new_empty((buffer.shape[0], capacity) + tuple(buffer.shape[2:]))
    bigger[:, : buffer.shape[1]] = buffer
    return bigger


@dataclass
class LayerCache:
    """One layer's compressed state for a batch of B sequences of equal length."""

    latent: torch.Tensor  # [B, capacity, kv_lora_rank]
    rope_key: torch.Tensor  # [B, capacity, qk_rope_head_dim]
    index_key: torch.Tensor | None  # [B, capacity, index_head_dim] on DSA full layers
    length: int = 0

    @classmethod
    def empty(
        cls, args: ModelArgs, layer: int, batch: int, dtype: torch.dtype, device: str | torch.device
    ) -> LayerCache:

        def buffer(width: int, buffer_dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.empty((batch, 0, width), dtype=buffer_dtype, device=device)

        # indexer keys are scored in float32 (as the reference does)
        index_key = buffer(args.index_head_dim, torch.float32) if args.has_indexer(layer) else None
        return cls(buffer(args.kv_lora_rank), buffer(args.qk_rope_head_dim), index_key)

    def append(self, latent: torch.Tensor, rope_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store S new positions ([B, S, *]) and return the whole valid latent and rope key ([B, T, *])."""
        end = self.length + latent.shape[1]
        self.latent, self.rope_key = grow(self.latent, end), grow(self.rope_key, end)
        self.latent[:, self.length : end] = latent
        self.rope_key[:, self.length : end] = rope_key
        self.length = end
        return self.latent[:, :end], self.rope_key[:, :end]

    def next_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One more position of a one-sequence cache, counted as stored: views (latent [kv_lora_rank], rope key
        [qk_rope_head_dim]) the caller fills."""
        if self.latent.shape[0] != 1:
            raise ValueError(f"next_row fills one sequence's row, not {self.latent.shape[0]}")
        end = self.length + 1
        self.latent, self.rope_key = grow(self.latent, end), grow(self.rope_key, end)
        self.length = end
        return self.latent[0, end - 1], self.rope_key[0, end - 1]

    def append_index_key(self, index_key: torch.Tensor) -> torch.Tensor:
        """After ``append`` of the same positions: store their indexer keys -> all of them [B, T, index_head_dim]."""
        if self.index_key is None:
            raise ValueError("this layer has no DSA indexer keys")
        start = self.length - index_key.shape[1]
        self.index_key = grow(self.index_key, self.length)
        self.index_key[:, start : self.length] = index_key
        return self.index_key[:, : self.length]

    def trim(self, length: int) -> None:
        """Forget every position from ``length`` on (prefix reuse, edited conversations)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} positions to {length}")
        self.length = length

    @contextmanager
    def as_seen_at(self, position: int) -> Iterator[None]:
        """Inside, the cache ends at ``position``, as that position's own decode step saw it (for a step that
        counted several rows of one sequence at once); later positions are kept and restored on exit."""
        held, self.length = self.length, position + 1
        try:
            yield
        finally:
            self.length = held

    def state(self) -> dict[str, torch.Tensor]:
        """The valid positions as copies."""
        state = {
            "latent": self.latent[:, : self.length].clone(),
            "rope_key": self.rope_key[:, : self.length].clone(),
        }
        if self.index_key is not None:
            state["index_key"] = self.index_key[:, : self.length].clone()
        return state

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> LayerCache:
        latent, rope_key = state["latent"], state["rope_key"]
        index_key = state.get("index_key")
        lengths = {t.shape[1] for t in (latent, rope_key, index_key) if t is not None}
        if len(lengths) != 1:
            raise ValueError(f"layer state tensors disagree on the number of positions: {sorted(lengths)}")
        return cls(latent.clone(), rope_key.clone(), None if index_key is None else index_key.clone(), lengths.pop())


@dataclass
class KVCache:
    """All layers' compressed state; ``length`` positions are valid in every layer."""

    layers: list[LayerCache] = field(default_factory=list)

    @classmethod
    def empty(
        cls,
        args: ModelArgs,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVCache:
        return cls([LayerCache.empty(args, layer, batch, dtype, device) for layer in range(args.n_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].latent.dtype

    def trim(self, length: int) -> None:
        for layer in self.layers:
            layer.trim(length)

    def log_view(self) -> KVCacheLog:
        return KVCacheLog(self)

    def state(self) -> list[dict[str, torch.Tensor]]:
        return [layer.state() for layer in self.layers]

    @classmethod
    def from_state(cls, state: list[dict[str, torch.Tensor]]) -> KVCache:
        cache = cls([LayerCache.from_state(layer) for layer in state])
        if len({layer.length for layer in cache.layers}) > 1:
            raise ValueError("layers disagree on the number of cached positions")
        return cache


@dataclass(frozen=True)
class KVCacheLog:
    """A KVCache as a log reads it: session log and prefix block hold the same rows; none is freed (attention
    reads every row held)."""

    cache: KVCache
    frees_rows: ClassVar[bool] = False

    def rows(self, start: int, end: int) -> list[torch.Tensor]:
        """[end - start, width] each: every layer's latent and roped key, then the indexer keys."""
        layers = self.cache.layers
        rows = [t[0, start:end] for layer in layers for t in (layer.latent, layer.rope_key)]
        return rows + [layer.index_key[0, start:end] for layer in layers if layer.index_key is not None]

    def entries(self, start: int, end: int) -> list[torch.Tensor]:
        return self.rows(start, end)

    def window(self, position: int) -> list[torch.Tensor]:
        return []

    def release(self, logged: int) -> None:
        pass

    def round_to(self, dtype: torch.dtype) -> None:
        for layer in self.cache.layers:
            for t in (layer.latent, layer.rope_key, layer.index_key):
                if t is not None and t.dtype != dtype:
                    t[:, : layer.length] = t[:, : layer.length].to(dtype).to(t.dtype)


class DraftLayer(Protocol):
    """An MTP block's attention state: a LayerCache, or V4's V4DraftLayer."""

    @property
    def length(self) -> int: ...

    def trim(self, length: int) -> None: ...


L = TypeVar("L", bound=DraftLayer)


@dataclass
class DraftCache(Generic[L]):
    """One sequence's MTP attention state: index j holds position ``offset + j``; ``fresh`` makes an empty one."""

    fresh: Callable[[], L]
    offset: int = 0
    layer: L = field(init=False)

    def __post_init__(self) -> None:
        self.layer = self.fresh()

    @property
    def end(self) -> int:
        """The position after the last one held."""
        return self.offset + self.layer.length

    def continue_at(self, position: int) -> None:
        """Make ``position`` the next one stored: forget those from it on, or start over at it when positions
        before it were never stored (drafting paused)."""
        if self.offset <= position <= self.end:
            self.layer.trim(position - self.offset)
        else:
            self.layer, self.offset = self.fresh(), position
