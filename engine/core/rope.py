"""Rotary position embedding for the qk_rope part of MLA and for the DSA indexer, with YaRN.

Checkpoints store q and k's rope dims interleaved in pairs (MLA, GLM-5's indexer) or half-split
(DeepSeek-V3.2's indexer). The result is always written half-split: queries and keys get the same
permutation, so their dot products are unchanged, and cached keys have transformers' layout.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from engine.config.args import ModelArgs, RopeArgs


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_range(rope: RopeArgs, dim: int) -> tuple[float, float]:
    """The band of frequency indices that is blended between interpolation and extrapolation."""

    def correction_dim(rotations: float) -> float:
        wavelengths = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def inverse_frequencies(rope: RopeArgs, dim: int) -> torch.Tensor:
    """[dim // 2] float32 inverse frequencies, YaRN-corrected when configured."""
    base = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1.0 / base
    if rope.kind == "default":
        return extrapolated
    interpolated = 1.0 / (rope.factor * base)
    low, high = _yarn_correction_range(rope, dim)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_extrapolated = 1 - ramp
    return interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated


def cos_sin_scale(rope: RopeArgs) -> float:
    """YaRN's scale on cos/sin (the "attention factor"); 1 for plain rope."""
    if rope.kind == "default":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


def softmax_scale(args: ModelArgs) -> float:
    """1/sqrt(qk_head_dim), times mscale^2 for YaRN models that set mscale_all_dim (DeepSeek-V3)."""
    scale: float = args.qk_head_dim**-0.5  # typeshed types int ** float as Any (it may be complex)
    if args.rope.kind != "default" and args.rope.mscale_all_dim:
        scale *= _yarn_mscale(args.rope.factor, args.rope.mscale_all_dim) ** 2
    return scale


def rope_tables(
    args: ModelArgs, start_pos: int, length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [length, qk_rope_head_dim // 2] float32, for positions start_pos .. +length. Callers
    must not write to them: one position's tables are shared."""
    if length == 1:
        return _one_position(args.rope, args.qk_rope_head_dim, start_pos, device)
    return rope_at(args.rope, args.qk_rope_head_dim, torch.arange(start_pos, start_pos + length, device=device))


@lru_cache(maxsize=1 << 15)
def _one_position(rope: RopeArgs, dim: int, position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode row's tables, once per position (the same bits as computing them). Built outside inference
    mode so the shared tensors serve any caller."""
    with torch.inference_mode(False):
        return rope_at(rope, dim, torch.arange(position, position + 1, device=device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [B, S, ..., d] by the angles of cos/sin [S, d // 2]; output is half-split [B, S, ..., d]."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (cos.shape[-1],)
    cos, sin = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@lru_cache(maxsize=16)
def _cached_inverse_frequencies(rope: RopeArgs, dim: int) -> torch.Tensor:
    """inverse_frequencies once per configuration; built outside inference mode to serve any caller."""
    with torch.inference_mode(False):
        return inverse_frequencies(rope, dim)


def rope_at(rope: RopeArgs, dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [P, dim // 2] float32, at arbitrary positions [P] (DeepSeek-V4's compressed entries
    sit at the first position of their window)."""
    inv_freq = _cached_inverse_frequencies(rope, dim).to(positions.device)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    scale = cos_sin_scale(rope)
    return angles.cos() * scale, angles.sin() * scale


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's rope: the last r channels of x [B, P, ..., d] rotate in interleaved pairs by cos/sin
    [P, r // 2]; the layout stays interleaved (V4 reads its keys as values too)."""
    rope_dim = 2 * cos.shape[-1]
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    tail = x[..., -rope_dim:].float()
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)
