"""DeepSeek-V4's attention state per layer: what a query still needs from the past.

- ``recent``: the K=V rows of the last sliding_window - 1 positions [B, <= n - 1, D] (a new query adds
  its own): older positions are never attended uncompressed again, so they are dropped.
- ``compressor`` (CSA and HCA layers): the compressed entries and the open window's projections.
- ``indexer`` (CSA layers): the same for the lightning indexer's own compressor.

Per position that is O(D / m) on a compressed layer once the window is full, against D per position
for a plain KV cache (engine/cache.py holds MLA's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.args import ModelArgs
from engine.compressor import CompressorState


@dataclass
class V4LayerCache:
    """One layer's state for a batch of B sequences of equal length."""

    recent: torch.Tensor  # [B, R, D]: K=V rows of positions length - R .. length - 1
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    length: int = 0

    def append(self, kv: torch.Tensor, window: int) -> tuple[torch.Tensor, int]:
        """Add the S new positions' rows kv [B, S, D]; return (the rows a query among them may see
        [B, R + S, D], the position of the first of those rows)."""
        first = self.length - self.recent.shape[1]
        rows = torch.cat([self.recent, kv], dim=1)
        self.recent = rows[:, rows.shape[1] - min(window - 1, rows.shape[1]) :]
        self.length += kv.shape[1]
        return rows, first

    def trim(self, length: int) -> None:
        """V4's state cannot be rolled back (closed windows and dropped rows); only a no-op trim is allowed."""
        if length != self.length:
            raise ValueError(
                f"a DeepSeek-V4 cache of {self.length} positions cannot be trimmed to {length}: "
                "its compressed windows cannot be reopened; rebuild it from the conversation log"
            )

    def clone(self) -> V4LayerCache:
        return V4LayerCache(
            self.recent.clone(),
            None if self.compressor is None else self.compressor.clone(),
            None if self.indexer is None else self.indexer.clone(),
            self.length,
        )


@dataclass
class V4Cache:
    """All layers' state; ``length`` positions have been fed to every layer."""

    layers: list[V4LayerCache] = field(default_factory=list)

    @classmethod
    def empty(
        cls, args: ModelArgs, batch: int = 1, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> V4Cache:
        v4 = args.v4
        device = torch.device(device)

        def layer(i: int) -> V4LayerCache:
            compressed = v4.rate(i) > 0
            return V4LayerCache(
                recent=torch.empty((batch, 0, v4.head_dim), dtype=dtype, device=device),
                compressor=(
                    CompressorState.empty(batch, v4.head_dim, v4.is_csa(i), dtype, device) if compressed else None
                ),
                indexer=CompressorState.empty(batch, v4.index_head_dim, True, dtype, device) if v4.is_csa(i) else None,
            )

        return cls([layer(i) for i in range(args.n_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def trim(self, length: int) -> None:
        for layer in self.layers:
            layer.trim(length)
