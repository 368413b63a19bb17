"""What a KV pack's values must be before they enter the prefix cache (packs.py imports through this): a
pack's checksums only say its bytes are the ones written, not that the model wrote them.

Bounds (every import). Every value must be finite, and each row of each position (a layer's latent, rope
key, indexer key; DeepSeek-V4's per-layer rows) must have an L2 norm of at most ``BOUND_FACTOR`` times the
largest that row reaches on a calibration prefill of the model itself (``CALIBRATION_TOKENS`` ids spread
over the vocabulary, its first ids among them, in the pack's compute dtype and activation path). The rows
are bounded by construction (the latent is RMS-normed, the keys are projections of RMS-normed hidden
states), so an honest pack stays within a small multiple of what any prompt gives, while random bytes,
NaN and huge values are refused, naming the file, the position and the layer.

Verification (``kv import --verify N``). Values within the bounds can still be another prompt's: a pack
filed under other tokens. The first N positions are recomputed by a prefill from nothing, every row of
every layer compared. N more, drawn with the OS's randomness (a pack cannot know which), are recomputed
each from the pack's own positions before it and its token, and their first layer's rows compared: those
depend on the position's token only, so a position filed under another token differs there, while the
deeper layers depend on the context, where a rounded record (bfloat16) or a DSA top-k selection that a
rounding flips makes an honest pack differ too. A position whose recomputed row differs from the pack's by
more than ``tolerance`` (relative L2, after rounding both to the record dtype) refuses the pack, naming
the position and the row.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from colibri_stream.errors import SessionError
from colibri_stream.planning.activations import PREFILL_CHUNK_TOKENS
from colibri_stream.runtime.kv.records import as_bytes, cache_from_payloads, from_bytes
from engine.config.args import ModelArgs
from engine.core.interfaces import Cache, Model
from engine.core.sources import Experts
from engine.families import family_of
from storage.kv.geometry import Geometry, item_bytes

CALIBRATION_TOKENS = 64
BOUND_FACTOR = 8.0  # an honest row stays well within this multiple of the calibration's largest norm
BOUND_FLOOR = 1e-3  # a row the calibration leaves all zero still admits rounding noise
# Relative L2 difference an honest position stays within: float32 compute differs from a recompute by
# rounding only (a bfloat16 record's last bit); bfloat16 compute and int8 activations by more.
EXACT_TOLERANCE = 0.01
LOSSY_TOLERANCE = 0.05


@dataclass(frozen=True)
class Recompute:
    """The model a pack is checked against, loaded in the pack's compute dtype and activation path."""

    model: Model[Any]
    experts: Experts
    args: ModelArgs
    geometry: Geometry  # the pack's record geometry (its record dtype)
    lossy: bool  # bfloat16 compute or int8 activations: a recompute differs by more than rounding

    @property
    def row_names(self) -> list[str]:
        return [f"layer {layer} {row}" for layer, row in family_of(self.args).kv_log.log_row_layers()]

    @property
    def token_rows(self) -> list[int]:
        """The rows that depend on their position's token only: the first layer's."""
        return [i for i, (layer, _) in enumerate(family_of(self.args).kv_log.log_row_layers()) if layer == 0]

    @property
    def row_widths(self) -> list[int]:
        return family_of(self.args).kv_log.log_row_widths()

    def new_cache(self) -> Cache:
        cache: Cache = self.model.new_cache()
        cache.log_view().release(0)  # keep every row: they are what is compared
        return cache

    def rows(self, payloads: np.ndarray) -> list[torch.Tensor]:
        """Record payloads [n, payload_bytes] -> each row's values, float32 [n, width], record order."""
        dtype, offset, rows = self.geometry.dtype, 0, []
        for width in self.row_widths:
            size = width * item_bytes(dtype)
            rows.append(from_bytes(payloads[:, offset : offset + size], dtype, width))
            offset += size
        return rows

    def computed(self, cache: Cache, start: int, end: int) -> list[torch.Tensor]:
        """The cache's rows of positions start..end as a record holds them (rounded to the record dtype)."""
        dtype = self.geometry.dtype
        return [from_bytes(as_bytes(r, dtype), dtype, r.shape[-1]) for r in cache.log_view().rows(start, end)]


def calibration_ids(vocab_size: int, n: int = CALIBRATION_TOKENS) -> list[int]:
    """The calibration prompt: the vocabulary's first ids (often BOS and other special tokens, whose states
    are the largest) then ids spread evenly over the rest."""
    first = list(range(min(4, vocab_size)))
    step = max(1, vocab_size // max(1, n - len(first)))
    spread = [(4 + i * step) % vocab_size for i in range(n - len(first))]
    return (first + spread)[:n]


def value_bounds(recompute: Recompute) -> list[float]:
    """Per row (record order) the largest L2 norm a position's row may have (the module docstring)."""
    ids = calibration_ids(recompute.args.vocab_size)
    cache = recompute.new_cache()
    tokens = torch.tensor([ids], dtype=torch.long, device=recompute.model.device)
    with torch.inference_mode():
        recompute.model.forward_prompt(tokens, 0, cache, recompute.experts, PREFILL_CHUNK_TOKENS, last_only=True)
    rows = cache.log_view().rows(0, len(ids))
    return [max(BOUND_FACTOR * float(r.float().norm(dim=-1).max()), BOUND_FLOOR) for r in rows]


def check_values(
    path: Path, name: str, first: int, payloads: np.ndarray, recompute: Recompute, bounds: Sequence[float]
) -> None:
    """SessionError naming the file, position and row unless every value of positions first.. is finite and
    every row within its bound."""
    for row, label, bound in zip(recompute.rows(payloads), recompute.row_names, bounds, strict=True):
        finite = torch.isfinite(row).all(dim=-1)
        norms = row.norm(dim=-1)
        bad = ~finite | (norms > bound)  # a NaN norm compares False: the finite test names it
        if not bool(bad.any()):
            continue
        index = int(bad.nonzero()[0, 0])
        where = f"{path}: KV pack {name!r} position {first + index}: {label}"
        if not bool(finite[index]):
            raise SessionError(f"{where} holds NaN or infinite values")
        raise SessionError(
            f"{where} has norm {float(norms[index]):.4g}, beyond the {bound:.4g} this model's values stay within "
            "(not values this model computed)"
        )


def default_tolerance(recompute: Recompute) -> float:
    return LOSSY_TOLERANCE if recompute.lossy else EXACT_TOLERANCE


def verify_positions(
    path: Path,
    name: str,
    tokens: Sequence[int],
    payloads: np.ndarray,
    recompute: Recompute,
    count: int,
    tolerance: float,
) -> list[int]:
    """Recompute ``count`` leading positions by prefill and ``count`` drawn ones from the pack's own earlier
    positions (the module docstring); SessionError at the first that disagrees. Returns the positions checked."""
    total = len(tokens)
    first = min(count, total)
    if first:
        cache = recompute.new_cache()
        ids = torch.tensor([list(tokens[:first])], dtype=torch.long, device=recompute.model.device)
        with torch.inference_mode():
            recompute.model.forward_prompt(ids, 0, cache, recompute.experts, PREFILL_CHUNK_TOKENS, last_only=True)
        _compare(path, name, 0, recompute.computed(cache, 0, first), payloads[:first], recompute, tolerance)
    drawn = sorted(secrets.SystemRandom().sample(range(first, total), min(count, total - first)))
    for position in drawn:
        cache = cache_from_payloads(payloads[:position], recompute.geometry, recompute.args, recompute.model.dtype)
        cache.log_view().release(0)
        token = torch.tensor([[tokens[position]]], dtype=torch.long, device=recompute.model.device)
        with torch.inference_mode():
            recompute.model.forward(token, position, cache, recompute.experts, last_only=True)
        computed = recompute.computed(cache, position, position + 1)
        wanted = payloads[position : position + 1]
        _compare(path, name, position, computed, wanted, recompute, tolerance, recompute.token_rows)
    return list(range(first)) + drawn


def _compare(
    path: Path,
    name: str,
    start: int,
    computed: list[torch.Tensor],
    payloads: np.ndarray,
    recompute: Recompute,
    tolerance: float,
    only: Sequence[int] | None = None,
) -> None:
    """SessionError at the first position whose rows (``only`` these: indices in record order) differ."""
    compared = zip(computed, recompute.rows(payloads), recompute.row_names, strict=True)
    for index, (got, want, label) in enumerate(compared):
        if only is not None and index not in only:
            continue
        difference = (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-12)
        worst = int(difference.argmax())
        if float(difference[worst]) > tolerance:
            raise SessionError(
                f"{path}: KV pack {name!r} position {start + worst}: {label} differs from what this model computes "
                f"for the pack's tokens (relative difference {float(difference[worst]):.3g} > {tolerance:g}): the "
                "values are another prompt's, or not this model's"
            )
