"""DeepSeek-V4's KV compressor: every ``rate`` positions fold into one compressed entry.

Shapes: B batch, S new positions, w entry width, m = rate, c = 2 if overlapping else 1.

Each position projects to a value row kv [c * w] and a gate row [c * w] (plus a learned bias ``ape``
per place in the window). A closed window of m rows gives one entry:

    entry = RMSNorm(sum_j softmax_j(gate_j) * kv_j),  roped at the window's first position

Overlapping compressors (CSA's, and its indexer's) keep two series: the second half of each row (Cb)
feeds its own window's entry, the first half (Ca) the *next* window's, so an entry spans 2m positions
with stride m. Between calls the state keeps the rows of a window not yet closed (``pending``) and,
when overlapping, the Ca half of the last closed window (``carry``): with them a prompt fed in pieces
gives the entries of the prompt fed at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.args import RopeArgs
from engine.layers import RMSNorm
from engine.rope import rope_at, rotate_tail
from engine.rows import Linear


@dataclass
class CompressorState:
    """One compressor's memory for a batch of B sequences of equal length."""

    pending_kv: torch.Tensor  # [B, p, c * w], p < m: projections of positions whose window is still open
    pending_gate: torch.Tensor  # [B, p, c * w], without ape (added when the window closes)
    entries: torch.Tensor  # [B, E, w]: every entry emitted so far, E = closed windows
    carry_kv: torch.Tensor | None = None  # overlap: [B, m, w] Ca half of the last closed window
    carry_gate: torch.Tensor | None = None  # [B, m, w], ape added

    @classmethod
    def empty(cls, batch: int, width: int, overlap: bool, dtype: torch.dtype, device: torch.device) -> CompressorState:
        rows = torch.empty((batch, 0, (2 if overlap else 1) * width), dtype=dtype, device=device)
        return cls(rows, rows.clone(), torch.empty((batch, 0, width), dtype=dtype, device=device))

    def clone(self) -> CompressorState:
        return CompressorState(*(None if t is None else t.clone() for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.pending_kv, self.pending_gate, self.entries, self.carry_kv, self.carry_gate


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
        kv = torch.cat([state.pending_kv, self.wkv(x)], dim=1)
        gate = torch.cat([state.pending_gate, self.wgate(x)], dim=1)
        closed = kv.shape[1] // self.rate * self.rate
        state.pending_kv, state.pending_gate = kv[:, closed:], gate[:, closed:]
        if closed:
            first = state.entries.shape[1]  # index of the first window closed now
            new = self._compress(kv[:, :closed], gate[:, :closed], first, state)
            state.entries = torch.cat([state.entries, new], dim=1)
        return state.entries

    def _compress(self, kv: torch.Tensor, gate: torch.Tensor, first: int, state: CompressorState) -> torch.Tensor:
        """kv, gate [B, W * m, c * w] of W closed windows, the first one window ``first`` -> entries [B, W, w]."""
        bsz, m = kv.shape[0], self.rate
        kv = kv.view(bsz, -1, m, kv.shape[-1])
        gate = gate.view(bsz, -1, m, gate.shape[-1]) + self.ape
        if self.overlap:
            kv, gate = self._overlap(kv, gate, state)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        entries = self.norm((kv * weights).sum(dim=2))  # [B, W, w]
        positions = torch.arange(first, first + entries.shape[1], device=kv.device) * m
        return rotate_tail(entries, *rope_at(self.rope, self.rope_dim, positions))

    def _overlap(self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState):
        """[B, W, m, 2w] -> [B, W, 2m, w]: window i's Cb half after window i-1's Ca half (the carried one
        for i = 0; none at the very start: zero rows with -inf gates, i.e. softmax weight 0)."""
        bsz, windows, m, w = kv.shape[0], kv.shape[1], self.rate, self.width
        wide_kv = kv.new_zeros((bsz, windows, 2 * m, w))
        wide_gate = gate.new_full((bsz, windows, 2 * m, w), float("-inf"))
        wide_kv[:, :, m:], wide_gate[:, :, m:] = kv[..., w:], gate[..., w:]
        wide_kv[:, 1:, :m], wide_gate[:, 1:, :m] = kv[:, :-1, :, :w], gate[:, :-1, :, :w]
        if state.carry_kv is not None:
            wide_kv[:, 0, :m], wide_gate[:, 0, :m] = state.carry_kv, state.carry_gate
        state.carry_kv, state.carry_gate = kv[:, -1, :, :w].clone(), gate[:, -1, :, :w].clone()
        return wide_kv, wide_gate
