"""DeepSeek-V4's KV compressor: every ``rate`` positions fold into one compressed entry.

Shapes: B batch, S new positions, w entry width, m = rate, c = 2 if overlapping else 1.

Each position projects to kv [c * w] and gate [c * w] (plus ``ape`` per place in the window). A closed
window of m rows gives entry = RMSNorm(sum_j softmax_j(gate_j) * kv_j), roped at the window's first position.
Overlapping compressors (CSA's and its indexer's): a row's second half (Cb) feeds its own window, its first
half (Ca) the next one's, so an entry spans 2m positions with stride m.

The state keeps the projections (until released) and the closed windows' entries; a call compresses the
windows its positions close, so a prompt fed in pieces gives the entries of the prompt fed at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from engine.config.args import RopeArgs
from engine.core.layers import RMSNorm
from engine.core.rope import rope_at, rotate_tail
from engine.kernels.rows import Linear
from engine.v4.position_rows import PositionRows, RowsReleased


@dataclass
class CompressorState:
    """One compressor's memory for a batch of B sequences of equal length T."""

    kv: PositionRows  # [B, *, c * w]
    gate: PositionRows  # [B, *, c * w], without ape
    entries: torch.Tensor  # [B, E, w]: the first E closed windows

    @classmethod
    def empty(cls, batch: int, width: int, overlap: bool, dtype: torch.dtype, device: torch.device) -> CompressorState:
        rows = torch.empty((batch, 0, (2 if overlap else 1) * width), dtype=dtype, device=device)
        return cls(
            PositionRows(rows), PositionRows(rows.clone()), torch.empty((batch, 0, width), dtype=dtype, device=device)
        )

    @classmethod
    def from_rows(cls, kv: torch.Tensor, gate: torch.Tensor, width: int) -> CompressorState:
        """A state holding projections [B, T, c * w] and no entries yet: the next call compresses them."""
        return cls(PositionRows(kv), PositionRows(gate), kv.new_empty((kv.shape[0], 0, width)))

    @property
    def length(self) -> int:
        return self.kv.length

    def append(self, kv: torch.Tensor, gate: torch.Tensor) -> None:
        self.kv.append(kv)
        self.gate.append(gate)

    def needed_from(self, rate: int) -> int:
        """The first position the next compression reads: the open window's (overlapping: the one before)."""
        overlap = self.kv.buffer.shape[-1] == 2 * self.entries.shape[-1]
        return max(0, (self.entries.shape[1] - overlap) * rate)

    def window_start(self, position: int, rate: int) -> int:
        """The first position the state at ``position`` holds: its open window's (overlapping: the one before)."""
        overlap = self.kv.buffer.shape[-1] == 2 * self.entries.shape[-1]
        return max(0, (position // rate - overlap) * rate)

    def release_before(self, position: int, rate: int) -> None:
        """Free the rows neither the next compression nor the state at ``position`` or later holds."""
        keep = min(self.window_start(position, rate), self.needed_from(rate))
        self.kv.release_before(keep)
        self.gate.release_before(keep)

    def trim(self, length: int, rate: int) -> None:
        """Forget positions from ``length`` on, and the entries of windows they closed."""
        self.entries = self.entries[:, : length // rate]
        if self.needed_from(rate) < self.kv.base:
            raise RowsReleased(f"the rows to reopen the window at {length} were released")
        self.kv.trim(length)
        self.gate.trim(length)


class Compressor(nn.Module):
    """wkv, wgate [c * w, dim], ape [m, c * w], norm [w]."""

    def __init__(self, dim: int, width: int, rate: int, overlap: bool, rope: RopeArgs, rope_dim: int, eps: float):
        super().__init__()
        self.width, self.rate, self.overlap = width, rate, overlap
        self.rope, self.rope_dim = rope, rope_dim
        series = 2 if overlap else 1
        self.wkv = Linear(dim, series * width, bias=False)
        self.wgate = Linear(dim, series * width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, series * width))
        self.norm = RMSNorm(width, eps)

    def forward(self, x: torch.Tensor, state: CompressorState) -> torch.Tensor:
        """Feed x [B, S, dim] (the positions after those already fed) -> every entry so far [B, E, w]."""
        state.append(self.wkv(x), self.wgate(x))
        first, closed = state.entries.shape[1], state.length // self.rate
        if closed > first:
            new = self._compress(state, first, closed)
            state.entries = torch.cat([state.entries, new], dim=1)
        return state.entries

    def _compress(self, state: CompressorState, first: int, closed: int) -> torch.Tensor:
        """Entries of windows first..closed-1 from their positions' rows -> [B, W, w]."""
        m = self.rate

        def windows(rows: PositionRows) -> torch.Tensor:
            # torch leaves Tensor.unflatten unannotated
            return cast(torch.Tensor, rows.between(first * m, closed * m).unflatten(1, (closed - first, m)))

        kv, gate = windows(state.kv), windows(state.gate) + self.ape  # [B, W, m, c * w]
        if self.overlap:
            kv, gate = self._overlap(kv, gate, self._previous_ca(state, first))
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        entries = self.norm((kv * weights).sum(dim=2))  # [B, W, w]
        positions = torch.arange(first, closed, device=kv.device) * m
        return rotate_tail(entries, *rope_at(self.rope, self.rope_dim, positions))

    def _previous_ca(self, state: CompressorState, first: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The Ca half [B, m, w] of window first-1 (kv, gate + ape), or None before the first window."""
        if first == 0:
            return None
        start, end, w = (first - 1) * self.rate, first * self.rate, self.width
        return state.kv.between(start, end)[..., :w], state.gate.between(start, end)[..., :w] + self.ape[:, :w]

    def _overlap(
        self, kv: torch.Tensor, gate: torch.Tensor, previous: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, W, m, 2w] -> [B, W, 2m, w]: window i's Cb half after window i-1's Ca half (``previous`` for
        i = 0; at the very start none: zero rows with -inf gates, i.e. softmax weight 0)."""
        bsz, windows, m, w = kv.shape[0], kv.shape[1], self.rate, self.width
        wide_kv = kv.new_zeros((bsz, windows, 2 * m, w))
        wide_gate = gate.new_full((bsz, windows, 2 * m, w), float("-inf"))
        wide_kv[:, :, m:], wide_gate[:, :, m:] = kv[..., w:], gate[..., w:]
        wide_kv[:, 1:, :m], wide_gate[:, 1:, :m] = kv[:, :-1, :, :w], gate[:, :-1, :, :w]
        if previous is not None:
            wide_kv[:, 0, :m], wide_gate[:, 0, :m] = previous
        return wide_kv, wide_gate
