"""The MTP governor's choices from measured step costs: on where drafts are accepted and rows are cheap
(experts cached), off where each extra row's experts are disk reads or drafts are wrong, probes while
off, and the stats it reports; then the same choices in real runs (a random MTP head is turned off)."""

from __future__ import annotations

import random
import shutil

import pytest

from colibri_stream.devtools.mtp_fixture import add_mtp_layer
from colibri_stream.errors import ColibriError
from colibri_stream.runtime.batching import ContinuousBatch, GenerationRequest
from colibri_stream.runtime.loader import load_checkpoint
from colibri_stream.runtime.mtp_governor import (
    COUNT_PLAIN_EVERY,
    MARGIN,
    MAX_PROBE_EVERY,
    PROBE_EVERY,
    Governor,
    MTPOptions,
    StepCost,
)
from colibri_stream.runtime.speculation import Speculation
from storage.tiers.stats import StoreStats

PLAIN_S = 0.010  # a plain step: 10 ms


def store(requests: int, misses: int, wait_s: float) -> StoreStats:
    return StoreStats(requests=requests, misses=misses, io_wait_s=wait_s)


def drive(
    governor: Governor, steps: int, accept: float, row_s: float, miss_rate: float, miss_s: float,
    draft_s: float = 0.001, first_s: float = PLAIN_S,
) -> list[int]:  # fmt: skip
    """``steps`` decode steps of one sequence whose drafts are accepted with probability ``accept`` (as a
    fixed pattern), each extra row costing ``row_s`` of compute and 32 expert requests (1 MoE layer x 8
    experts x 4, as the store counts them) with ``miss_rate`` of them disk reads of ``miss_s`` each, and
    each draft ``draft_s``; the first step of each kind (plain, drafting) takes ``first_s`` more."""
    depths, hits = [], 0.0
    for _ in range(steps):
        depth = governor.depth()
        depths.append(depth)
        accepted = 0
        for _ in range(depth):
            hits += accept
            if hits < 1:
                break
            hits -= 1
            accepted += 1
        rows = 1 + depth
        misses = round(32 * rows * miss_rate)
        first = first_s - PLAIN_S if (depth > 0) not in {d > 0 for d in depths[:-1]} else 0.0
        seconds = PLAIN_S + depth * row_s + misses * miss_s + first
        counters = store(32 * rows, misses, misses * miss_s)
        cost = StepCost(depth, (accepted,) if depth else (), seconds, draft_s * depth + first, counters)
        governor.observe(cost)
    return depths


def test_cached_experts_and_good_drafts_turn_drafting_on_and_deep():
    governor = Governor(MTPOptions("auto", 3))
    depths = drive(governor, 200, accept=0.8, row_s=0.002, miss_rate=0.0, miss_s=0.0)
    # plain until the first probe (untimed) and the timed step after it, both at depth 1; then as measured
    assert depths[: PROBE_EVERY + 2] == [0] * PROBE_EVERY + [1, 1]
    # drafting every step but one plain step in PROBE_EVERY (the yardstick kept current)
    assert sum(d == 0 for d in depths[-100:]) in (100 // (PROBE_EVERY + 1), -(-100 // (PROBE_EVERY + 1)))
    assert max(depths[-100:]) >= 2
    report = governor.report()
    assert report["on_share"] > 0.8 and report["estimated_gain"] > 1.3  # 1.55 at a = 0.8; the smoothed a moves
    assert 0.7 < report["acceptance_rate"] <= 0.85


def test_streaming_misses_turn_drafting_off_but_it_probes():
    governor = Governor(MTPOptions("auto", 3))
    # every extra row's experts miss half the time and a miss waits 5 ms: a row costs 80 ms, a step 10 ms
    depths = drive(governor, 300, accept=0.8, row_s=0.002, miss_rate=0.5, miss_s=0.005)
    late = depths[100:]
    assert sum(d > 0 for d in late) <= len(late) // PROBE_EVERY + 1  # probes only
    assert 1 in late  # it does probe
    assert governor.gain(1) < 1 and governor.report()["on_share"] < 0.1


def test_probes_that_do_not_pay_come_ever_more_rarely():
    """Under a tight budget a probe's extra experts are disk reads: each probe that does not pay doubles the
    wait before the next, up to MAX_PROBE_EVERY; a probe that pays would reset it (the cached case above)."""
    governor = Governor(MTPOptions("auto", 2))
    depths = drive(governor, 2000, accept=0.8, row_s=0.002, miss_rate=0.5, miss_s=0.005)
    probes = [i for i, depth in enumerate(depths) if depth > 0]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:], strict=False)]  # plain steps between probes
    # the first probe's untimed step and its timed one, back to back; then ever longer waits
    assert gaps == [0, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY] + [MAX_PROBE_EVERY] * (len(gaps) - 4)
    assert len(probes) == 7  # 32 steps apart throughout: 61


def test_where_not_even_perfect_drafts_would_pay_it_probes_at_the_longest_wait():
    """A draft that costs more than a step (the demo model's: ~0.5 ms against a 0.54 ms step on the int8
    path) loses at any acceptance: after its first timed probe the wait is MAX_PROBE_EVERY at once."""
    governor = Governor(MTPOptions("auto", 1))
    depths = drive(governor, 1200, accept=0.9, row_s=0.001, miss_rate=0.0, miss_s=0.0, draft_s=0.012, first_s=0.05)
    probes = [i for i, depth in enumerate(depths) if depth > 0]
    assert probes[:2] == [PROBE_EVERY, PROBE_EVERY + 1]  # the untimed first drafting step, then the timed one
    assert [b - a - 1 for a, b in zip(probes[1:], probes[2:], strict=False)] == [MAX_PROBE_EVERY] * (len(probes) - 2)
    assert governor.ceiling() < 1


def test_wrong_drafts_turn_drafting_off_even_when_rows_are_cheap():
    governor = Governor(MTPOptions("auto", 2))
    depths = drive(governor, 200, accept=0.0, row_s=0.003, miss_rate=0.0, miss_s=0.0)
    assert sum(d > 0 for d in depths[50:]) <= 150 // PROBE_EVERY + 1
    assert governor.report()["acceptance_rate"] == 0.0


def test_a_slow_first_step_does_not_become_the_yardstick():
    """The first plain step builds what later steps reuse (4.0 ms against 0.9 ms after on the demo model
    with int8 activations): taken as the plain step's time it made drafts that cost more than a step look
    1.46x faster while the run went at 0.45x. The first step of each kind is not timed."""
    governor = Governor(MTPOptions("auto", 1))
    depths = drive(governor, 200, accept=0.9, row_s=0.001, miss_rate=0.0, miss_s=0.0, draft_s=0.012, first_s=0.05)
    assert sum(d > 0 for d in depths[10:]) <= 190 // PROBE_EVERY + 1  # probes only
    assert governor.gain(1) < 1 and governor.report()["on_share"] < 0.1
    cheap = Governor(MTPOptions("auto", 1))  # and where drafts are cheap it still drafts
    depths = drive(cheap, PROBE_EVERY + 100, accept=0.9, row_s=0.001, miss_rate=0.0, miss_s=0.0, first_s=0.05)
    assert sum(depths[PROBE_EVERY + 10 :]) > 80


def test_plain_steps_take_the_store_counters_now_and_then_and_drafting_steps_always():
    """Two snapshots of the store and their difference cost ~9 us, 1.5% of the demo model's step: a plain step
    takes them once in COUNT_PLAIN_EVERY, a drafting step and the plain one after it always; a step without
    them leaves the miss and wait averages where they were (not pulled towards no wait)."""
    governor = Governor(MTPOptions("auto", 1))
    counted = []
    for _ in range(40):  # every step: 4 of its 32 requests miss and wait 5 ms each
        counted.append(governor.counts(0))
        governor.observe(StepCost(0, (), PLAIN_S + 0.02, 0.0, store(32, 4, 0.02) if counted[-1] else None))
    assert counted == [step % COUNT_PLAIN_EVERY == 0 for step in range(40)]
    assert governor.plain_wait_s.value == pytest.approx(0.02) and governor.miss_rate.value == pytest.approx(0.125)
    assert governor.plain_s.samples == 39 and governor.plain_wait_s.samples == 4  # the first step is not timed
    assert governor.counts(1)  # a drafting step
    governor.observe(StepCost(1, (1,), PLAIN_S, 0.001, store(64, 0, 0.0)))
    assert governor.counts(0)  # the plain step right after one


def test_the_depth_chosen_is_the_lowest_of_the_highest_gain_if_it_clears_the_margin():
    """The per-step choice (one pass over the depths) against its definition over ``gain``, on states where
    drafting pays at some depth or at none: the states come from driving the governor, then its averages
    are set at random, zeros and certainties included."""
    rng = random.Random(7)
    cases = 0
    for _ in range(300):
        governor = Governor(MTPOptions("auto", rng.randint(1, 4)))
        drive(governor, PROBE_EVERY + 3, accept=rng.random(), row_s=rng.uniform(0, 0.01), miss_rate=0.0, miss_s=0.0)
        governor.acceptance.value = rng.choice([0.0, 1.0, rng.random()])
        governor.row_s.value = rng.choice([0.0, rng.uniform(0, 0.02)])
        governor.draft_s.value = rng.choice([0.0, rng.uniform(0, 0.01)])
        governor.miss_rate.value, governor.miss_s.value = rng.random(), rng.uniform(0, 0.01)
        governor.extra_requests.value = rng.choice([0.0, 32.0])
        depths = range(governor.options.max_depth + 1)
        best = max(depths, key=governor.gain)
        expected = best if governor.gain(best) >= MARGIN else 0
        governor.since_draft, governor.since_plain = 1, 1  # neither a probe nor a yardstick step is due
        assert governor.depth() == expected
        cases += expected > 0
    assert 30 < cases < 270  # both choices were exercised
    governor = Governor(MTPOptions("auto", 2))  # drafts always accepted, rows free: the deepest pays most
    drive(governor, PROBE_EVERY + 3, accept=0.5, row_s=0.0, miss_rate=0.0, miss_s=0.0)
    governor.since_draft, governor.since_plain = 1, 1
    governor.extra_requests.value, governor.draft_s.value, governor.row_s.value = 0.0, 0.0, 0.0
    governor.acceptance.value = 1.0  # gains 1, 2, 3
    assert governor.depth() == 2


def test_forced_modes_and_options():
    assert Governor(MTPOptions("on", 3)).depth() == 3
    assert Governor(MTPOptions("off", 3)).depth() == 0
    assert Governor(MTPOptions("auto", 3)).depth() == 0  # the first plain step measures the yardstick
    with pytest.raises(ColibriError, match="--mtp must be one of auto, on, off"):
        MTPOptions("sometimes")
    with pytest.raises(ColibriError, match="--mtp-depth must be between 1 and 8"):
        MTPOptions("on", 0)


def test_a_random_mtp_head_is_turned_off_in_a_real_run(tiny_checkpoints, tmp_path):
    path = shutil.copytree(tiny_checkpoints["glm_moe_dsa"], tmp_path / "glm")
    add_mtp_layer(path, seed=5)
    loaded = load_checkpoint(path)
    speculation = Speculation(loaded.drafter, MTPOptions("auto", 2), loaded.experts.snapshot)
    batch = ContinuousBatch(loaded.model, loaded.experts, speculation=speculation)
    generation = batch.add(GenerationRequest([3, 9, 4, 7, 1, 8], 120))
    while batch:
        batch.step()
    report = speculation.governor.report()
    assert report["acceptance_rate"] is not None and report["acceptance_rate"] < 0.2
    assert report["on_share"] < 0.3, report  # a few steps while it learns, then probes
    assert generation.result.stats.decode_steps == 119
