"""How the MoE layer gets routed-expert weights: the ExpertProvider protocol.

The engine never owns routed experts. It asks a provider for the experts the router picked, which
lets storage stream them from disk into RAM/VRAM tiers (the tiered store satisfies this protocol
structurally) while tests and small models use ``ResidentExperts``.

Verbs:
    acquire(layer, ids)   -> start bringing every id in and return at once; indexing the result
                             waits for that expert only, so the shared expert (computed right after
                             acquire) overlaps the loads; the ids stay pinned until release. The
                             result may have ``ready(id)`` (would indexing wait?): the MoE layer then
                             computes the experts already in memory together before it waits
    release(layer, ids)   -> unpin: the provider may evict them again
    memory_of(layer, ids) -> optional: the arrays of those ids the provider holds in CPU memory now,
                             without pinning or waiting: what the model has the kernels' idle helper
                             thread read into the CPU caches ahead of use (engine/warm.py)
    max_acquire()         -> how many experts of one layer may be pinned at once (None: no limit); the MoE
                             layer acquires a step's distinct experts in chunks of at most that many,
                             each released before the next is acquired
    prefetch(layer, ids)  -> a non-blocking lookahead hint for a coming layer (the next layer's router
                             applied to the current hidden state); it may be ignored, never changes tokens
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.layers import swiglu
from engine.rows import linear


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert in float: w1 (gate) and w3 (up) [inter, dim], w2 (down) [dim, inter].

    Weights stored in another float dtype than the activations (bf16 records, f32 compute) are cast
    per call, not once: a cast copy kept with the expert would double or triple the memory of every
    cached slot, beyond the budget the slots were sized for."""

    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.w1.device

    def __call__(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """x [N, dim] -> [N, dim]; ``limit``: the swiglu clamp (engine.layers.swiglu), None for none"""
        w1, w2, w3 = (w if w.dtype == x.dtype else w.to(x.dtype) for w in (self.w1, self.w2, self.w3))
        return linear(swiglu(linear(x, w1), linear(x, w3), limit), w2)


class Expert(Protocol):
    """x [N, dim] -> [N, dim] on the expert's own device (``limit``: the swiglu clamp, V4 only).
    Experts may also expose ``device`` (where
    their weights live, e.g. a VRAM slot); the MoE layer then sends x there (see RoutedSum)."""

    def __call__(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor: ...


class ExpertProvider(Protocol):
    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None: ...

    def acquire(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, Expert]: ...

    def release(self, layer: int, expert_ids: Sequence[int]) -> None: ...

    def max_acquire(self) -> int | None:
        """How many experts of one layer may be pinned at once; None: no limit."""
        ...


class ResidentExperts:
    """Every routed expert held in memory (small models, tests)."""

    def __init__(self, experts: Mapping[int, Mapping[int, Expert]]):
        self._experts = experts  # layer -> expert id -> weights

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        pass

    def wants_prefetch(self, layer: int) -> bool:
        """Whether a lookahead guess could do anything: not for this no-op prefetch (every expert is in
        memory), so the model skips the router run; a subclass that overrides prefetch gets its guesses."""
        return type(self).prefetch is not ResidentExperts.prefetch

    def memory_of(self, layer: int, expert_ids: Sequence[int]) -> list[torch.Tensor]:
        held = self._experts.get(layer, {})
        return [tensor for e in expert_ids if e in held for tensor in expert_tensors(held[e])]

    def acquire(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, Expert]:
        try:
            return {e: self._experts[layer][e] for e in expert_ids}
        except KeyError as exc:
            raise KeyError(f"layer {layer} has no routed expert {exc.args[0]}") from None

    def release(self, layer: int, expert_ids: Sequence[int]) -> None:
        pass

    def max_acquire(self) -> int | None:
        return None


def expert_tensors(expert: object) -> list[torch.Tensor]:
    """An expert's weight tensors, gate and up before down (the order it reads them): its w1, w3, w2
    fields, each a tensor or an object of tensors (a quantised matrix's codes and scales)."""
    tensors = []
    for name in ("w1", "w3", "w2"):
        value = getattr(expert, name, None)
        parts = [value] if isinstance(value, torch.Tensor) else list(getattr(value, "__dict__", {}).values())
        tensors += [part for part in parts if isinstance(part, torch.Tensor)]
    return tensors
