"""The MTP governor: per decode step, whether to draft and how deep, from what this machine measures.

A step that verifies k drafted tokens yields 1 + a + a^2 + ... + a^k tokens on average (a: the measured
chance that a draft is accepted, given the one before it was), and costs more than a plain step by

    k x (one more row's compute  +  expected extra misses per row x measured seconds per miss)  +  the drafts

where a row's compute is measured on verify steps against plain ones, extra misses per row come from
the expert requests a verify step adds (measured) times the store's current miss rate, and a miss costs
the compute thread's measured wait per disk read. With experts cached, misses cost nothing and a
verified row is cheap: drafting wins. Streaming under a tight budget, each extra row's experts are disk
reads: the estimate falls below 1 and drafting stops (Colibrì measured MTP 32% slower there).

The governor only chooses how fast the text comes, never which text: a verify step gives the tokens
plain decoding gives. Drafting starts as a probe does: PROBE_EVERY plain steps first (the yardstick
settled on many steps, not one), then depth 1 until a draft's cost is timed, since a trial of drafts that
do not pay is the governor's whole loss (on the demo model two trial steps on priors cost 3-5% of a
96-token run; docs/benchmarks-log.md). While drafting is off it probes at depth 1 after PROBE_EVERY steps, so
a changed cache (warmed up, or a prompt that made it cold) is noticed; each probe that does not pay doubles the wait
before the next (up to MAX_PROBE_EVERY), since under a tight budget a probe's extra experts are disk reads,
and where even every draft accepted without a miss would not pay (``ceiling``: the draft and the extra
rows cost more than the tokens they add) the wait goes straight to MAX_PROBE_EVERY; while drafting, one
plain step every PROBE_EVERY keeps the yardstick (a plain step's time) current.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from colibri_stream.errors import ColibriError
from storage.tiers.stats import StoreStats

MODES = ("auto", "on", "off")
PROBE_EVERY = 32  # plain steps between depth-1 probes while drafting is off (at first)
MAX_PROBE_EVERY = 512  # ... doubled after each probe that did not pay, up to this
SMOOTHING = 0.2  # weight of the newest measurement in each running average
PRIOR_ACCEPTANCE = 0.5  # before any draft was verified
PRIOR_ROW_SHARE = 0.25  # one more row's compute as a share of a plain step, before it is measured
MARGIN = 1.05  # draft only where the expected gain clears measurement noise: "never slower" comes first
# The first plain step and the first drafting step of a run are not timed: they build what every later step
# reuses (the C step's layer plans, first-touch pages of the caches). On the demo model the first plain step
# took 4.0 ms against 0.9 ms after, and as the yardstick it made drafting look 1.46x faster while it ran
# at 0.45x (measured with --activations int8; docs/benchmarks-log.md).
WARMUP_STEPS = 1
# The store's counters over a step cost ~9 us to take (two snapshots and their difference), 1.5% of the demo
# model's 0.6 ms step: a plain step takes them once in this many (the miss rate and a miss's wait move slowly
# next to PROBE_EVERY), a drafting step always (what its rows add).
COUNT_PLAIN_EVERY = 8


@dataclass(frozen=True)
class MTPOptions:
    """--mtp auto|on|off, --mtp-depth: how a run drafts with the model's MTP module."""

    mode: str = "auto"
    max_depth: int = 2

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ColibriError(f"--mtp must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 1 <= self.max_depth <= 8:
            raise ColibriError(f"--mtp-depth must be between 1 and 8, got {self.max_depth}")


class Average:
    """An exponentially weighted running average. With a ``prior`` the first samples move it from there (one
    unlucky draft must not switch drafting off); without, the first sample is the value."""

    def __init__(self, prior: float | None = None):
        self.value, self.samples, self.has_prior = prior or 0.0, 0, prior is not None

    def add(self, sample: float) -> None:
        first = self.samples == 0 and not self.has_prior
        self.value = sample if first else (1 - SMOOTHING) * self.value + SMOOTHING * sample
        self.samples += 1


@dataclass
class StepCost:
    """What one decode step of the batch cost: every drafting sequence drafted ``depth`` tokens."""

    depth: int  # tokens each drafting sequence drafted and verified (0: a plain step)
    accepted: tuple[int, ...]  # per drafting sequence, its drafts verified equal to what the model chose
    seconds: float  # the verify (or plain) forward and taking its tokens
    draft_seconds: float  # the MTP module's forwards
    store: StoreStats | None  # the expert store's counters over the step (None: not measured)

    @property
    def extra_rows(self) -> int:
        return self.depth * len(self.accepted)


@dataclass
class Governor:
    """Chooses each step's draft depth (``depth``) and learns from what each step cost (``observe``)."""

    options: MTPOptions
    plain_s: Average = field(default_factory=Average)  # a plain step, its expert waits included
    plain_wait_s: Average = field(default_factory=Average)  # ... of which waiting for reads
    row_s: Average = field(default_factory=Average)
    draft_s: Average = field(default_factory=Average)
    acceptance: Average = field(default_factory=lambda: Average(PRIOR_ACCEPTANCE))
    plain_requests: Average = field(default_factory=Average)
    extra_requests: Average = field(default_factory=Average)  # expert requests one more row adds
    miss_rate: Average = field(default_factory=Average)
    miss_s: Average = field(default_factory=Average)  # compute-thread wait per miss
    steps: int = 0
    drafting_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    since_draft: int = 0
    since_plain: int = 0
    probe_every: int = PROBE_EVERY

    def depth(self) -> int:
        """The draft depth for the next step: 0 (plain) .. options.max_depth."""
        if self.options.mode == "off":
            return 0
        if self.options.mode == "on":
            return self.options.max_depth
        if self.plain_s.samples == 0 or self.since_plain >= PROBE_EVERY:
            return 0  # a plain step sets (or, while drafting, refreshes) the yardstick
        if not self.draft_s.samples:  # no draft timed yet: drafting starts as a probe, at depth 1, and
            # after the untimed first drafting step (WARMUP_STEPS) comes the timed one at once
            return 1 if self.drafting_steps or self.since_draft >= self.probe_every else 0
        best = self._best_depth()
        if best > 0:
            self.probe_every = PROBE_EVERY
        elif self.since_draft == 0 and self.drafting_steps:  # the step before drafted and did not pay
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
            if self.draft_s.samples and self.ceiling() < MARGIN:
                self.probe_every = MAX_PROBE_EVERY  # not even every draft accepted, no miss, would pay
        if best == 0 and self.since_draft >= self.probe_every:
            return 1  # a probe: the cache or the text may have changed since drafting stopped
        return best

    def counts(self, depth: int) -> bool:
        """Whether the step about to run at ``depth`` takes the store's counters: a drafting step, the plain
        step after one (the yardstick while drafting), else one plain step in COUNT_PLAIN_EVERY."""
        return depth > 0 or self.since_draft == 0 or self.steps % COUNT_PLAIN_EVERY == 0

    def _best_depth(self) -> int:
        """The depth of the highest expected gain if it clears MARGIN, else 0: ``gain``'s arithmetic in one pass
        over the depths (the governor asks every step, and a plain step of a small model is ~0.5 ms)."""
        if self.plain_s.value <= 0:
            return 0
        plain, per_depth = self.plain_s.value, self._depth_cost_s(self._miss_wait_s())
        best, best_gain, tokens, chance = 0, MARGIN, 1.0, 1.0
        for depth in range(1, self.options.max_depth + 1):
            chance *= self.acceptance.value
            tokens += chance
            gain = tokens * plain / (plain + depth * per_depth)
            if gain > best_gain or (gain == best_gain and best == 0):
                best, best_gain = depth, gain
        return best

    def gain(self, depth: int) -> float:
        """Expected tokens per second at ``depth`` over plain decoding's (1.0 at depth 0)."""
        if depth == 0 or self.plain_s.value <= 0:
            return 1.0
        return self._gain(depth, self.acceptance.value, self._miss_wait_s())

    def ceiling(self) -> float:
        """The best gain drafting could give here with every draft accepted and no extra miss: below 1, the
        draft and the rows alone cost more than the tokens they could add (a tiny model, whose draft costs
        about a step), and only a change in those costs, not in acceptance or the cache, could change that."""
        if self.plain_s.value <= 0:
            return float("inf")
        return max(self._gain(depth, 1.0, 0.0) for depth in range(1, self.options.max_depth + 1))

    def _gain(self, depth: int, acceptance: float, miss_wait_s: float) -> float:
        """Tokens per second at ``depth`` over plain decoding's, at this acceptance and this much extra waiting
        for reads per extra row."""
        tokens = sum(acceptance**i for i in range(depth + 1))
        cost = self.plain_s.value + depth * self._depth_cost_s(miss_wait_s)
        return tokens * self.plain_s.value / cost

    def _miss_wait_s(self) -> float:
        """The expected extra wait for reads one more row adds: its extra expert requests that miss, each a wait."""
        return self.extra_requests.value * self.miss_rate.value * self.miss_s.value

    def _depth_cost_s(self, miss_wait_s: float) -> float:
        """What one more depth adds to a step: a row's compute (a prior share of a plain step until measured),
        ``miss_wait_s`` and a draft."""
        row = self.row_s.value if self.row_s.samples else PRIOR_ROW_SHARE * self.plain_s.value
        return row + miss_wait_s + self.draft_s.value

    def observe(self, step: StepCost) -> None:
        self.steps += 1
        if step.store is not None:
            self._observe_store(step)
        waited = step.store.io_wait_s if step.store is not None else 0.0
        if step.extra_rows == 0:
            self.since_draft += 1
            self.since_plain = 0
            if self.steps - self.drafting_steps > WARMUP_STEPS:  # this one counted in steps already
                self.plain_s.add(step.seconds)
                if step.store is not None:
                    self.plain_wait_s.add(waited)
            return
        self.since_draft = 0
        self.since_plain += 1
        self.drafting_steps += 1
        self.drafted += step.extra_rows
        self.accepted += sum(step.accepted)
        for accepted in step.accepted:
            # a draft is tried only while those before it were accepted: the rate per tried draft
            for i in range(min(step.depth, accepted + 1)):
                self.acceptance.add(1.0 if i < accepted else 0.0)
        if self.drafting_steps <= WARMUP_STEPS:
            return
        self.draft_s.add(step.draft_seconds / step.extra_rows)
        if self.plain_s.samples:  # the rows' compute: what the step took beyond a plain one and its extra waits
            extra_wait = max(0.0, waited - self.plain_wait_s.value)
            self.row_s.add(max(0.0, step.seconds - self.plain_s.value - extra_wait) / step.extra_rows)

    def _observe_store(self, step: StepCost) -> None:
        store = step.store
        assert store is not None
        if store.requests:
            self.miss_rate.add(store.misses / store.requests)
        if store.misses:
            self.miss_s.add(store.io_wait_s / store.misses)
        if step.extra_rows == 0:
            self.plain_requests.add(store.requests)
        elif self.plain_requests.samples:
            self.extra_requests.add(max(0.0, store.requests - self.plain_requests.value) / step.extra_rows)

    def report(self) -> dict[str, Any]:
        """The stats' ``mtp`` object."""
        return {
            "mode": self.options.mode,
            "max_depth": self.options.max_depth,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "on_share": round(self.drafting_steps / self.steps, 4) if self.steps else None,
            "estimated_gain": round(max(self.gain(d) for d in range(self.options.max_depth + 1)), 4),
        }
