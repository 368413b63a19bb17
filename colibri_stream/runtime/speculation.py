"""Speculative decoding with the model's MTP module: a ContinuousBatch step that drafts, verifies, accepts.

Per sequence in the step (x_n its next token, fed now):

    drafts d_1..d_k   = Drafter.draft(the pairs (h_i, t_{i+1}) not yet drafted from, ending with (h_{n-1}, x_n))
    rows              = [x_n, d_1, .., d_k] at positions n..n+k, in the batch's one forward_rows_hidden
    row j's logits    -> the token y_{j+1} the sequence takes (``sample_against`` d_{j+1});
                         row j+1 is valid only while y_{j+1} == d_{j+1}
    cache             trimmed to the valid rows; the pairs (h_{n+j}, y_{j+1}) kept for the next draft

Each row is computed as that position's own decode step would compute it (rows_alone; engine/mla/model.py),
so greedy tokens are those of plain decoding under every budget, policy and batch; sampled ones follow
the same distribution (runtime/sampling.py sample_against). How deep to draft is the governor's
(runtime/mtp_governor.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from colibri_stream.runtime.mtp_governor import Governor, MTPOptions, StepCost
from engine.core.cache import DraftCache
from engine.core.interfaces import Cache, Drafter
from engine.core.sources import Experts
from storage.tiers.stats import StoreStats

# The pairs kept for a sequence's next draft: after a pause in drafting only the latest are fed to the
# MTP module (its attention then restarts there), so a long plain stretch costs one short catch-up.
CATCH_UP_PAIRS = 8


@dataclass
class DraftState:
    """One sequence's drafting state: its MTP cache and the pairs (h_i, t_{i+1}) it has not seen yet."""

    cache: DraftCache[Any]
    hidden: list[torch.Tensor] = field(default_factory=list)  # [dim] ([n, dim] in DeepSeek-V4) each: h_i, i = first..
    tokens: list[int] = field(default_factory=list)  # t_{i+1}
    first: int = 0  # the position of hidden[0]

    def keep(self, position: int, hidden: torch.Tensor, token: int) -> None:
        """The pair of ``position``: its hidden state and the token that followed it."""
        if self.hidden and position != self.first + len(self.hidden):
            self.hidden, self.tokens = [], []
        if not self.hidden:
            self.first = position
        self.hidden.append(hidden)
        self.tokens.append(token)
        if len(self.hidden) > CATCH_UP_PAIRS:
            del self.hidden[0], self.tokens[0]
            self.first += 1

    def take_pairs(self) -> tuple[torch.Tensor, list[int], int]:
        """(hidden [S, ...], tokens, first position), forgotten here: the draft feeds them to the module."""
        pairs = torch.stack(self.hidden), self.tokens, self.first
        self.hidden, self.tokens = [], []
        return pairs


@dataclass
class DraftedSequence:
    """A sequence in a drafting step: its cache and next token (fed now), its drafting state, how it
    chooses a token from logits [vocab] (a draft proposed, or None) and takes it (False: it finished),
    the tokens it may still take, its stop ids (it ends at one) and whether it may be drafted for (a
    constrained sequence may not: its mask for a position depends on the token chosen before it)."""

    cache: Cache
    next_token: int
    state: DraftState
    choose: Callable[[torch.Tensor, int | None], int]
    take: Callable[[torch.Tensor, int], bool]
    room: int
    stops: set[int]
    drafted: bool = True


class Row:
    """What a sequence feeds in one step: its next token, then its drafts."""

    def __init__(self, sequence: DraftedSequence, drafts: list[int]):
        self.sequence, self.start = sequence, sequence.cache.length
        self.tokens = [sequence.next_token, *drafts]
        self.drafts = drafts


@dataclass
class Speculation:
    """A batch's drafting: the drafter, its governor, the store's counters (None: not measured)."""

    drafter: Drafter
    options: MTPOptions
    counters: Callable[[], StoreStats] | None = None
    governor: Governor = field(init=False)

    def __post_init__(self) -> None:
        self.governor = Governor(self.options)

    def new_state(self) -> DraftState:
        return DraftState(self.drafter.new_draft_cache())

    def step(self, sequences: list[DraftedSequence], experts: Experts) -> list[tuple[int, int]]:
        """One decode step for ``sequences``; returns (drafted, accepted) per sequence."""
        depth = self.governor.depth()
        before = self.counters() if self.counters is not None and self.governor.counts(depth) else None
        started = time.perf_counter()
        if depth == 0:  # most steps where drafting does not pay: each bookkeeping microsecond is ~0.2% of one
            self._plain(sequences, experts)
            self._observe(StepCost(0, (), time.perf_counter() - started, 0.0, None), before)
            return [(0, 0)] * len(sequences)
        rows = [Row(s, self._drafts(s.state, experts, depth) if s.drafted else []) for s in sequences]
        drafted = time.perf_counter()
        tokens = [token for row in rows for token in row.tokens]
        caches = [row.sequence.cache for row in rows for _ in row.tokens]
        logits, hidden = self.drafter.forward_rows_hidden(tokens, caches, experts)
        counts, offset = [], 0
        for row in rows:
            end = offset + len(row.tokens)
            counts.append(self._accept(row, logits[offset:end], hidden[offset:end]))
            offset = end
        accepted = tuple(a for d, a in counts if d)
        verified = time.perf_counter() - drafted
        self._observe(StepCost(depth if accepted else 0, accepted, verified, drafted - started, None), before)
        return counts

    def _plain(self, sequences: list[DraftedSequence], experts: Experts) -> None:
        """A step without drafts, as ``_accept`` takes a row with none (one token each), without its loop."""
        starts = [sequence.cache.length for sequence in sequences]
        tokens = [sequence.next_token for sequence in sequences]
        logits, hidden = self.drafter.forward_rows_hidden(tokens, [s.cache for s in sequences], experts)
        for sequence, start, row_logits, row_hidden in zip(sequences, starts, logits, hidden, strict=True):
            token = sequence.choose(row_logits, None)
            if sequence.take(row_logits, token):
                sequence.state.keep(start, row_hidden, token)

    def _observe(self, cost: StepCost, before: StoreStats | None) -> None:
        """The governor learns the step's cost; with the store's counters over it where they were taken."""
        if self.counters is not None and before is not None:
            cost = replace(cost, store=self.counters().minus(before))
        self.governor.observe(cost)

    def _drafts(self, state: DraftState, experts: Experts, depth: int) -> list[int]:
        if depth == 0 or not state.hidden:
            return []  # no pair yet: the first step after a prompt gives the first one
        hidden, tokens, first = state.take_pairs()
        return self.drafter.draft(hidden, tokens, first, state.cache, experts, depth)

    @staticmethod
    def _accept(row: Row, logits: torch.Tensor, hidden: torch.Tensor) -> tuple[int, int]:
        """The sequence chooses a token from each row's logits until one differs from the draft (rows after
        it fed a token the sequence will not have); its cache keeps the rows whose fed token it has, then
        it takes the chosen tokens, each after the one before. Its callbacks see the rows of the tokens
        taken, and of accepted ones up to the last it chooses: a session synced then logs positions
        plain decoding computes too (valid rows), never a rejected one. Returns (drafted, accepted)."""
        sequence = row.sequence
        chosen: list[int] = []
        for j, draft in enumerate([*row.drafts, None]):
            chosen.append(sequence.choose(logits[j], draft))
            if chosen[-1] != draft or chosen[-1] in sequence.stops or len(chosen) == sequence.room:
                break
        sequence.cache.trim(row.start + len(chosen))
        for j, token in enumerate(chosen):
            if not sequence.take(logits[j], token):
                sequence.cache.trim(row.start + j + 1)  # it finished at this token, which is not fed
                break
            sequence.state.keep(row.start + j, hidden[j], token)
        return len(row.drafts), len(chosen) - 1
