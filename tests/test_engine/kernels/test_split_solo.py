"""engine/csrc/split.c's solo rule: a join that waited out a helper descheduled inside its block, or whose yield
lost the caller's core (another busy process on the cores), runs the next calls on the caller alone, and says the
cores are shared; a helper that is only busy (a long block on an idle machine) keeps its share. A verdict right
after a solo period doubles the next period.

No verdict here depends on the test machine's load (split.c's split_give_load): a signal a test does not
exercise is given, not measured, and a solo period lasts an hour, so a test's next job falls within it however
slowly the test runs. The signal a test does measure holds however busy the machine is: a helper asleep in its
block runs none of the wait."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from engine.kernels.quant import _kernels, int4_kernel_available

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="engine.kernels._kernels was not built")

HELPER_NS = 3_000_000  # the helper's block outlasts the caller's by this: past split.c's SOLO_WAIT_NS
HOUR_NS = 3600 * 10**9
MEASURED = -1


@contextmanager
def load_given(helper_share: float = MEASURED, yield_lost: int = MEASURED, solo_ns: int = HOUR_NS) -> Iterator[None]:
    """split.c's load signals given (MEASURED: measured), and measured again afterwards."""
    _kernels.split_give_load(helper_share, yield_lost, solo_ns)
    try:
        yield
    finally:
        _kernels.split_give_load(MEASURED, MEASURED, 0)


def test_a_join_that_waits_out_a_descheduled_helper_runs_the_next_calls_on_the_caller_alone():
    # the helper's CPU clock measured: asleep in its block it runs none of the join's wait, however busy the machine
    with load_given(yield_lost=0):
        assert _kernels.split_probe(0, True, True) == 1  # no solo period: the helper takes its half's block
        assert _kernels.split_probe(HELPER_NS, True, True) == 1  # it sleeps in its block: the join waits 3 ms
        assert _kernels.split_probe(0, True, False) == 0  # the next job ran on the caller alone
        assert _kernels.cores_shared(1) is True  # and torch's products stay on one thread (engine/kernels/rows.py)


@pytest.mark.parametrize(("helper_share", "keeps"), [(1.0, True), (0.85, True), (0.75, False), (0.0, False)])
def test_a_join_that_waits_out_a_long_block_keeps_the_helper_while_both_threads_ran(helper_share, keeps):
    # A helper spinning through a long block runs all of the wait on an idle machine; on a busy one the
    # scheduler takes it off (rightly a solo period), so its share is given: kept from 0.8 of the wait on
    with load_given(helper_share=helper_share, yield_lost=0):
        assert _kernels.split_probe(HELPER_NS, False, True) == 1  # the helper spins 3 ms in its block
        assert _kernels.split_probe(0, False, False) == (1 if keeps else 0)  # the next job shares its blocks or not


def test_a_verdict_right_after_a_solo_period_doubles_the_next_one_and_a_later_one_starts_over():
    with load_given(helper_share=0.0, yield_lost=0, solo_ns=HOUR_NS):  # every long join a verdict
        assert _kernels.split_probe(HELPER_NS, True, True) == 1  # a fresh first period
        first = _kernels.split_solo_ns()
        assert first == HOUR_NS
        _kernels.split_end_solo(0)  # the period ends now
        assert _kernels.split_probe(HELPER_NS, True, False) == 1  # shared again at once: a steady competitor
        assert _kernels.split_solo_ns() == 2 * first
        _kernels.split_end_solo(0)
        _kernels.split_probe(HELPER_NS, True, False)
        assert _kernels.split_solo_ns() == 4 * first
        _kernels.split_end_solo(2 * first)  # the cores were free for longer than a first period
        _kernels.split_probe(HELPER_NS, True, False)
        assert _kernels.split_solo_ns() == first


def test_a_join_whose_yield_loses_the_callers_core_runs_the_next_calls_on_the_caller_alone():
    # A yield in the join that returns late (another busy thread ran on the caller's core) is the common sign of a
    # busy machine, but one could be a hiccup: two in a row are a solo period. Whether a yield loses the core is
    # given (beside a real competitor it depends on the scheduler, and on how busy the machine already is); the
    # helper's share too (all of the wait), so that only the yields tell. The helper's block outlasts
    # SOLO_WAIT_NS, so each join waits past its first look at the clocks and yields there.
    with load_given(helper_share=1.0, yield_lost=1):
        assert _kernels.split_probe(1_000_000, False, True) == 1  # a first lost yield
        assert _kernels.split_probe(1_000_000, False, False) == 1  # shared still; its join lost a yield again
        assert _kernels.split_probe(0, True, False) == 0  # so this job ran on the caller alone
    with load_given(helper_share=1.0, yield_lost=0):
        assert _kernels.split_probe(1_000_000, False, True) == 1
        assert _kernels.split_probe(1_000_000, False, False) == 1
        assert _kernels.split_probe(0, True, False) == 1  # yields that kept the core: no verdict
