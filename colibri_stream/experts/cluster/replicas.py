"""Who holds each routed expert, and who computes it in one request.

Every (layer, expert) has one holder (the owner table, shares.py); with ``--replicas N`` the N hottest
experts of each layer (by the usage history) get a second holder, so a lost worker costs no disk reads
for them and a busy one can be passed over. Per MoE layer request, each routed expert goes to a holder
that is serving: the only one, or of two the one with fewer experts of this request so far (the less
loaded; a tie goes to the first holder); an expert none of whose holders serves is computed by the
coordinator itself (COORDINATOR), from its own container.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from colibri_stream.errors import ColibriError
from storage.tiers.history import UsageHistory

COORDINATOR = 0  # the coordinator's own rank: experts it computes itself after their holders were lost
NONE = -1  # no second holder


@dataclass(frozen=True)
class Holders:
    """owners int64 [MoE layers, experts] -> rank; replicas the same shape, NONE where there is no second."""

    owners: torch.Tensor
    replicas: torch.Tensor

    @classmethod
    def single(cls, owners: torch.Tensor) -> Holders:
        return cls(owners, torch.full_like(owners, NONE))

    def held_by(self, rank: int) -> torch.Tensor:
        """uint8 [MoE layers, experts]: 1 where ``rank`` holds the expert (its share or a replica)."""
        return ((self.owners == rank) | (self.replicas == rank)).to(torch.uint8)

    def replica_count(self) -> int:
        """Replicated experts per layer (the most of any layer)."""
        return int((self.replicas != NONE).sum(dim=1).max()) if self.replicas.numel() else 0


def with_replicas(
    owners: torch.Tensor, layers: Sequence[int], history: UsageHistory | None, n: int, ranks: Sequence[int]
) -> Holders:
    """The N hottest experts of each layer (by ``history``; none without one) held twice: the second holder
    is the other worker holding the fewest records so far (a tie: the lower rank)."""
    if n < 0:
        raise ColibriError(f"--replicas must be >= 0, got {n}")
    holders = Holders.single(owners)
    if n == 0 or history is None or not history.counts:
        return holders
    if len(ranks) < 2:
        raise ColibriError(f"--replicas {n}: a replica needs a second worker, there is {len(ranks)}")
    replicas = holders.replicas.clone()
    held = {rank: int((owners == rank).sum()) for rank in ranks}
    for row, layer in enumerate(layers):
        counts = history.counts.get(layer)
        if counts is None:
            continue
        hottest = sorted((e for e, c in enumerate(counts) if c), key=lambda e: (-counts[e], e))[:n]
        for expert in hottest:
            first = int(owners[row, expert])
            second = min((r for r in ranks if r != first), key=lambda r: (held[r], r))
            replicas[row, expert] = second
            held[second] += 1
    return Holders(owners, replicas)


def assign(
    experts: Sequence[int], owners: Sequence[int], replicas: Sequence[int], serving: Collection[int]
) -> dict[int, list[int]]:
    """rank -> the experts of one layer request it computes (COORDINATOR: the coordinator itself).
    ``owners``/``replicas``: this layer's rows of the holder tables, as lists."""
    plan: dict[int, list[int]] = {}
    two: list[tuple[int, list[int]]] = []
    for expert in experts:
        holders = [r for r in (owners[expert], replicas[expert]) if r != NONE and r in serving]
        if len(holders) == 2:
            two.append((expert, holders))
        else:
            plan.setdefault(holders[0] if holders else COORDINATOR, []).append(expert)
    for expert, holders in two:  # after the single-holder ones: their load is known
        pick = min(holders, key=lambda r: (len(plan.get(r, ())), holders.index(r)))
        plan.setdefault(pick, []).append(expert)
    return plan
