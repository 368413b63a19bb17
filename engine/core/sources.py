"""Expert sources: where a MoE layer gets its routed experts (the engine never owns them).

An ``ExpertSource`` hands over the experts and the layer computes with them (the tiered store satisfies it
structurally; ``ResidentExperts`` for tests and small models). A ``RemoteExperts`` computes the routed sum
where the experts are (worker processes) and returns it. Both take the model's prefetch guesses and may
offer speed paths (``Offers``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from engine.kernels.activation import swiglu
from engine.kernels.rows import linear

if TYPE_CHECKING:  # typing_extensions: a type checker's dependency, not the runtime's (TypeIs: Python 3.13)
    from typing_extensions import TypeIs


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert in float: w1 (gate) and w3 (up) [inter, dim], w2 (down) [dim, inter].

    Weights in another dtype than the activations are cast per call: a kept cast copy would double or
    triple every cached slot's memory, beyond the budget the slots were sized for."""

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
        """x [N, dim] -> [N, dim]; ``limit``: the swiglu clamp, None for none"""
        w1, w2, w3 = (w if w.dtype == x.dtype else w.to(x.dtype) for w in (self.w1, self.w2, self.w3))
        return linear(swiglu(linear(x, w1), linear(x, w3), limit), w2)


class Expert(Protocol):
    """One routed expert: ExpertWeights, or engine.kernels.quant's QuantizedExpert."""

    @property
    def device(self) -> torch.device:
        """Where its weights live (e.g. a VRAM slot): the MoE layer computes it there."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """Its weight arrays in read order (what a read-ahead may touch)."""
        ...

    def __call__(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """x [N, dim] -> [N, dim] on the expert's device (``limit``: swiglu clamp, V4 only)."""
        ...


class Acquired(Protocol):
    """The experts of one acquire, by id; indexing waits for that expert only."""

    def __getitem__(self, expert: int) -> Expert:
        """The expert, waiting for its read if it is still loading."""
        ...

    def ready(self, expert: int) -> bool:
        """Whether indexing ``expert`` returns without waiting."""
        ...


class Offers(Protocol):
    """A source's optional speed paths, each None when not offered (now). A store answers with its own
    dataclass of these fields (storage does not import the engine)."""

    @property
    def max_acquire(self) -> int | None:
        """Most experts of a layer pinned at once: the MoE layer acquires in chunks of this many."""
        ...

    @property
    def resident(self) -> ResidentSet | None:
        """Set while no expert can leave memory: decode then runs every layer in one C call."""
        ...

    @property
    def read_ahead(self) -> ReadAheadMemory | None:
        """Expert arrays the kernels' idle helper thread may read into the CPU caches ahead of use."""
        ...


@dataclass(frozen=True)
class Offered:
    """``Offers`` as a value (the engine's and the library's sources)."""

    max_acquire: int | None = None
    resident: ResidentSet | None = None
    read_ahead: ReadAheadMemory | None = None


class ResidentSet(Protocol):
    """A source's experts that never leave memory (the fused decode step's experts)."""

    def resident(self, layer: int) -> Sequence[Expert] | None:
        """Every routed expert of ``layer`` (index = id) while none can leave memory, else None; the same
        object while that holds, so a caller may cache what it derives from it."""
        ...

    def count_resident(self, used: Mapping[int, Sequence[int]]) -> None:
        """Count a step's experts taken from ``resident`` (layer -> ids) as the skipped acquires would have."""
        ...


class ReadAheadMemory(Protocol):
    """The experts a source holds in this process's CPU memory (what a read-ahead may touch)."""

    def memory_of(self, layer: int, expert_ids: Sequence[int]) -> Sequence[torch.Tensor | np.ndarray]:
        """The arrays of those of ``expert_ids`` held now, without pinning or waiting."""
        ...


class Prefetching(Protocol):
    """What the model asks of every source: prefetch guesses, and the speed paths it offers."""

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        """A non-blocking hint for a coming layer; may be ignored, never changes tokens."""
        ...

    def lookahead(self, layers: Sequence[int]) -> Sequence[int]:
        """Of the coming ``layers`` (nearest first), those a guess made now is for (the model skips the others'
        router runs)."""
        ...

    def offers(self) -> Offers: ...


class ExpertSource(Prefetching, Protocol):
    """A source that hands the MoE layer the experts themselves."""

    def acquire(self, layer: int, expert_ids: Sequence[int]) -> Acquired:
        """Start loading, return at once (the shared expert overlaps the loads); pinned until release."""
        ...

    def release(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Unpin: the source may evict them again."""
        ...

    def routed_sum(self) -> None:
        """None: the MoE layer sums this source's experts itself."""
        ...


class RemoteSum(Protocol):
    """A routed sum computed where the experts are."""

    def start_routed_sum(
        self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        """Send the layer's rows x [N, dim], gate weights [N, topk] float32 and expert ids [N, topk]; the
        returned function waits for the routed sum, float64 [N, dim] on x's device."""
        ...


class RemoteExperts(Prefetching, Protocol):
    """A source that computes a layer's routed sum where the experts are, e.g. worker processes."""

    def routed_sum(self) -> RemoteSum: ...


Experts = ExpertSource | RemoteExperts  # what a model's forward takes


def is_remote(experts: Experts) -> TypeIs[RemoteExperts]:
    """Whether the source sums its experts elsewhere: only a remote one declares a routed sum."""
    return experts.routed_sum() is not None


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

    def __init__(self, experts: Mapping[int, Mapping[int, Expert]]):
        self._experts = experts  # layer -> expert id -> weights
        self._by_id: dict[int, tuple[Expert, ...] | None] = {}  # resident()'s answers, built once per layer

    def acquire(self, layer: int, expert_ids: Sequence[int]) -> HeldExperts:
        try:
            return HeldExperts({e: self._experts[layer][e] for e in expert_ids})
        except KeyError as exc:
            raise KeyError(f"layer {layer} has no routed expert {exc.args[0]}") from None

    def release(self, layer: int, expert_ids: Sequence[int]) -> None:
        pass

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        pass

    def lookahead(self, layers: Sequence[int]) -> Sequence[int]:
        """None for this no-op prefetch, so the model skips the router run; the next one for a subclass that
        overrides prefetch (further ahead would do no more here)."""
        return layers[:1] if type(self).prefetch is not ResidentExperts.prefetch else ()

    def routed_sum(self) -> None:
        return None

    def offers(self) -> Offered:
        return Offered(resident=self, read_ahead=self)

    def memory_of(self, layer: int, expert_ids: Sequence[int]) -> list[torch.Tensor]:
        held = self._experts.get(layer, {})
        return [tensor for e in expert_ids if e in held for tensor in held[e].tensors()]

    def resident(self, layer: int) -> tuple[Expert, ...] | None:
        """The layer's experts by id, when numbered 0..n-1, else None."""
        if layer not in self._by_id:
            held = self._experts.get(layer, {})
            whole = len(held) > 0 and all(e in held for e in range(len(held)))
            self._by_id[layer] = tuple(held[e] for e in range(len(held))) if whole else None
        return self._by_id[layer]

    def count_resident(self, used: Mapping[int, Sequence[int]]) -> None:
        """Nothing to count here (ResidentStore counts)."""
