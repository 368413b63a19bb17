"""engine/csrc/split.c's solo rule: a join that waited out a helper descheduled inside its block, or whose yield
lost the caller's core (another busy process on the cores), runs the next calls on the caller alone, and says the
cores are shared; a helper that is only busy (a long block on an idle machine) keeps its share. A verdict right
after a solo period doubles the next period."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from engine.kernels.quant import _kernels, int4_kernel_available

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="engine.kernels._kernels was not built")

HELPER_NS = 3_000_000  # the helper's block outlasts the caller's by this: past split.c's SOLO_WAIT_NS


def test_a_join_that_waits_out_a_descheduled_helper_runs_the_next_calls_on_the_caller_alone():
    assert _kernels.split_probe(0, True, True) == 1  # no solo period: the helper takes its half's block
    assert _kernels.split_probe(HELPER_NS, True, True) == 1  # it sleeps in its block: the join waits 3 ms
    assert _kernels.split_probe(0, True, False) == 0  # the next job ran on the caller alone
    assert _kernels.cores_shared(1) is True  # and torch's products stay on one thread (engine/kernels/rows.py)


def test_a_join_that_waits_out_a_long_block_keeps_the_helper():
    assert _kernels.split_probe(HELPER_NS, False, True) == 1  # the helper spins 3 ms: it is running, not off
    assert _kernels.split_probe(0, False, False) == 1  # so the next job still shares its blocks


def _solo_period_over() -> None:
    """Runs probe jobs until one shares its blocks again: the solo period ended microseconds ago."""
    while _kernels.split_probe(0, True, False) == 0:
        pass


def test_a_verdict_right_after_a_solo_period_doubles_the_next_one_and_a_later_one_starts_over():
    assert _kernels.split_probe(HELPER_NS, True, True) == 1  # a fresh first period
    first = _kernels.split_solo_ns()
    _solo_period_over()
    _kernels.split_probe(HELPER_NS, True, False)  # shared again at once: a steady competitor
    assert _kernels.split_solo_ns() == 2 * first
    _solo_period_over()
    _kernels.split_probe(HELPER_NS, True, False)
    assert _kernels.split_solo_ns() == 4 * first
    _solo_period_over()
    time.sleep(2 * first / 1e9)  # the cores were free for longer than a first period
    _kernels.split_probe(HELPER_NS, True, False)
    assert _kernels.split_solo_ns() == first


@pytest.fixture
def competitor_on_this_core() -> Iterator[None]:
    """This thread pinned to one core, and a busy process pinned to the same core."""
    held = os.sched_getaffinity(0)
    core = min(held)
    os.sched_setaffinity(0, {core})
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        time.sleep(0.3)  # spinning before the probes
        yield
    finally:
        busy.kill()
        busy.wait()
        os.sched_setaffinity(0, held)


def test_a_join_whose_yield_loses_the_callers_core_runs_the_next_calls_on_the_caller_alone(competitor_on_this_core):
    # The helper spins 0.2 ms in its block (running), so the caller's first yield in the wait comes before it
    # reads the CPU clocks; that yield hands its core to the busy process for a slice, and the wait is over when
    # the caller is back: only the yield's length tells the cores are shared. Two such joins in a row are a solo
    # period (one could be a hiccup).
    solo = 0
    for _ in range(5):  # a yield may find the busy process off the core; one of five finding it on is enough
        _kernels.split_probe(200_000, False, True)
        _kernels.split_probe(200_000, False, False)
        solo += _kernels.split_probe(0, True, False) == 0
    assert solo >= 1
