"""SwiGLU, the activation of every expert and MLP, computed row by row (batch invariance: kernels/rows.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.rows import per_row


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with a limit (DeepSeek-V4's swiglu_limit) gate is clamped from above and up
    to [-limit, limit] first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return per_row(_silu_times, gate, up)


def _silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
