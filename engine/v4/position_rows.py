"""Per-position rows of which only a recent part is kept: DeepSeek-V4's K=V rows and compressor projections.

Attention needs only the sliding window's rows and the open compressor windows', so older rows may be
released once no log needs them. A trim back into released rows raises ``RowsReleased``; the caller
restores from the log.
"""

from __future__ import annotations

import torch

from engine.core.cache import grow


class RowsReleased(ValueError):
    """The rows a request needs were released (they are in the conversation's log, if it has one)."""


class PositionRows:
    """Rows [B, *, width] of positions base .. length-1, growing by doubling."""

    def __init__(self, rows: torch.Tensor, base: int = 0):
        self.buffer = rows  # [B, capacity, width]; row i is position base + i
        self.base = base
        self.length = base + rows.shape[1]

    def append(self, rows: torch.Tensor) -> None:
        end = self.length + rows.shape[1]
        self.buffer = grow(self.buffer, end - self.base)
        self.buffer[:, self.length - self.base : end - self.base] = rows
        self.length = end

    def between(self, start: int, end: int) -> torch.Tensor:
        """Rows of positions start .. end-1 [B, end - start, width] (a view)."""
        if start < self.base or end > self.length:
            raise RowsReleased(f"rows of positions {start}..{end - 1} requested; {self.base}..{self.length - 1} held")
        return self.buffer[:, start - self.base : end - self.base]

    def all(self) -> torch.Tensor:
        return self.buffer[:, : self.length - self.base]

    def release_before(self, position: int) -> None:
        """Free the rows of positions before ``position`` (copied out: the buffer's memory goes)."""
        position = min(position, self.length)
        if position > self.base:
            self.buffer = self.between(position, self.length).clone()
            self.base = position

    def trim(self, length: int) -> None:
        if not self.base <= length <= self.length:
            raise RowsReleased(f"cannot cut back to {length} positions: rows from {self.base} on are held")
        self.length = length
