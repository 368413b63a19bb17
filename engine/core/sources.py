"""How the MoE layer gets routed experts: the expert sources the engine declares.

The engine never owns routed experts. A MoE layer gets them from an expert source, one of two kinds:
``LocalExperts`` hands over the experts themselves and the layer computes with them (storage streams
them from disk into RAM/VRAM tiers: the tiered store satisfies the protocol structurally; tests and
small models use ``ResidentExperts``), while ``RemoteExperts`` computes the routed sum elsewhere (the
experts sharded over worker processes) and returns it. Both take the model's prefetch guesses.

What every source offers (``ExpertSource``):
    prefetch(layer, ids)   -> a non-blocking prefetch hint for a coming layer (the next layer's router
                              applied to the current hidden state); it may be ignored, never changes tokens
    wants_prefetch(layer)  -> whether a guess for that layer could do anything: when not, the model skips
                              the guess's router run
    prefetch_layers       -> how many MoE layers ahead the model guesses (the nearest first)
    memory_of(layer, ids)  -> the arrays of those ids held in this process's CPU memory now, without
                              pinning or waiting: what the kernels' idle helper thread reads into the CPU
                              caches ahead of use (engine/kernels/read_ahead.py); none when nothing is held here
A local source (``LocalExperts``) also:
    acquire(layer, ids)    -> start bringing every id in and return at once (``Acquired``): indexing it
                              waits for that expert only, so the shared expert (computed right after
                              acquire) overlaps the loads; ``ready(id)`` says whether indexing would wait,
                              so the MoE layer computes the experts already in memory before it waits. The
                              ids stay pinned until release
    release(layer, ids)    -> unpin: the source may evict them again
    max_acquire()          -> how many experts of one layer may be pinned at once (None: no limit); the MoE
                              layer acquires a step's distinct experts in chunks of at most that many,
                              each released before the next is acquired
    resident(layer)        -> every expert of the layer by id, when the source holds them all in memory and
                              never evicts, moves or rewrites them while it lives (a budget that fits them
                              all, all read), else None: a decode step may then run every layer in one C
                              call with no acquire (engine/mla/fused_decode.py)
    count_resident(used)   -> count such a step's experts (layer -> ids) as the acquires it skipped would
                              have: requests, hits, routing counts, usage history, trace
A remote source (``RemoteExperts``) instead:
    start_routed_sum(layer, x, weights, ids) -> send the layer's rows to where the experts are; the
                              returned function waits for the float64 routed sum
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.kernels.activation import swiglu
from engine.kernels.rows import linear


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

    def tensors(self) -> list[torch.Tensor]:
        """The weights in the order a call reads them: gate and up before down."""
        return [self.w1, self.w3, self.w2]

    def __call__(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """x [N, dim] -> [N, dim]; ``limit``: the swiglu clamp (engine.core.layers.swiglu), None for none"""
        w1, w2, w3 = (w if w.dtype == x.dtype else w.to(x.dtype) for w in (self.w1, self.w2, self.w3))
        return linear(swiglu(linear(x, w1), linear(x, w3), limit), w2)


class Expert(Protocol):
    """One routed expert: ExpertWeights, or engine.kernels.quant's QuantizedExpert."""

    @property
    def device(self) -> torch.device:
        """Where its weights live (e.g. a VRAM slot): the MoE layer computes it there (see RoutedSum)."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """Its weight arrays in the order a call reads them (what a read-ahead may touch)."""
        ...

    def __call__(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """x [N, dim] -> [N, dim] on the expert's device (``limit``: the swiglu clamp, V4 only)."""
        ...


class Acquired(Protocol):
    """The experts of one acquire, by id."""

    def __getitem__(self, expert: int) -> Expert:
        """The expert, waiting for its read if it is still loading."""
        ...

    def ready(self, expert: int) -> bool:
        """Whether indexing ``expert`` returns without waiting."""
        ...


class ExpertSource(Protocol):
    """What the model asks of any expert source: prefetch guesses and the memory to read ahead."""

    @property
    def prefetch_layers(self) -> int: ...

    def wants_prefetch(self, layer: int) -> bool: ...

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None: ...

    def memory_of(self, layer: int, expert_ids: Sequence[int]) -> Sequence[torch.Tensor | np.ndarray]: ...


class LocalExperts(ExpertSource, Protocol):
    """A source that hands the MoE layer the experts themselves (see the module doc)."""

    def acquire(self, layer: int, expert_ids: Sequence[int]) -> Acquired: ...

    def release(self, layer: int, expert_ids: Sequence[int]) -> None: ...

    def max_acquire(self) -> int | None:
        """How many experts of one layer may be pinned at once; None: no limit."""
        ...

    def resident(self, layer: int) -> Sequence[Expert] | None:
        """Every routed expert of ``layer`` (index = id) while none can leave memory, else None; the same
        object from call to call while that holds, so a caller may keep what it derives from it."""
        ...

    def count_resident(self, used: Mapping[int, Sequence[int]]) -> None:
        """Count a step's experts taken from ``resident`` (layer -> ids) as the skipped acquires would have."""
        ...


class RemoteExperts(ABC):
    """A source that computes a layer's routed sum where the experts are, e.g. worker processes.

    Subclassed by name (the library's DistributedExperts), so the MoE layer tells the two kinds apart
    with a plain isinstance; local stores satisfy ``LocalExperts`` structurally (storage does not
    import the engine)."""

    @property
    @abstractmethod
    def prefetch_layers(self) -> int: ...

    @abstractmethod
    def wants_prefetch(self, layer: int) -> bool: ...

    @abstractmethod
    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None: ...

    @abstractmethod
    def memory_of(self, layer: int, expert_ids: Sequence[int]) -> Sequence[torch.Tensor | np.ndarray]: ...

    @abstractmethod
    def start_routed_sum(
        self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        """Send the layer's rows x [N, dim], gate weights [N, topk] float32 and expert ids [N, topk]; the
        returned function waits for the routed sum, float64 [N, dim] on x's device."""


Experts = LocalExperts | RemoteExperts  # what a model's forward takes


class HeldExperts(Mapping[int, Expert]):
    """The experts of one acquire from memory: every one is ready."""

    def __init__(self, experts: dict[int, Expert]):
        self._experts = experts

    def __getitem__(self, expert: int) -> Expert:
        return self._experts[expert]

    def ready(self, expert: int) -> bool:
        return True

    def __iter__(self) -> Iterator[int]:
        return iter(self._experts)

    def __len__(self) -> int:
        return len(self._experts)


class ResidentExperts:
    """Every routed expert held in memory (small models, tests)."""

    prefetch_layers = 1  # a guess further ahead finds nothing more to do here than the next layer's

    def __init__(self, experts: Mapping[int, Mapping[int, Expert]]):
        self._experts = experts  # layer -> expert id -> weights
        self._by_id: dict[int, tuple[Expert, ...] | None] = {}  # resident()'s answers, built once per layer

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        pass

    def wants_prefetch(self, layer: int) -> bool:
        """Whether a prefetch guess could do anything: not for this no-op prefetch (every expert is in
        memory), so the model skips the router run; a subclass that overrides prefetch gets its guesses."""
        return type(self).prefetch is not ResidentExperts.prefetch

    def memory_of(self, layer: int, expert_ids: Sequence[int]) -> list[torch.Tensor]:
        held = self._experts.get(layer, {})
        return [tensor for e in expert_ids if e in held for tensor in held[e].tensors()]

    def acquire(self, layer: int, expert_ids: Sequence[int]) -> HeldExperts:
        try:
            return HeldExperts({e: self._experts[layer][e] for e in expert_ids})
        except KeyError as exc:
            raise KeyError(f"layer {layer} has no routed expert {exc.args[0]}") from None

    def release(self, layer: int, expert_ids: Sequence[int]) -> None:
        pass

    def max_acquire(self) -> int | None:
        return None

    def resident(self, layer: int) -> tuple[Expert, ...] | None:
        """The layer's experts by id, when they are numbered 0..n-1 (None for a layer without them)."""
        if layer not in self._by_id:
            held = self._experts.get(layer, {})
            whole = len(held) > 0 and all(e in held for e in range(len(held)))
            self._by_id[layer] = tuple(held[e] for e in range(len(held))) if whole else None
        return self._by_id[layer]

    def count_resident(self, used: Mapping[int, Sequence[int]]) -> None:
        """Nothing to count here (ResidentStore counts)."""
