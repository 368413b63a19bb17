"""engine/csrc/split.c's solo rule: a join that waited out a helper descheduled inside its block (another busy
process on the cores) runs the next calls on the caller alone, and says the cores are shared; a helper that is
only busy (a long block on an idle machine) keeps its share."""

from __future__ import annotations

import pytest

from engine.quant import _kernels, int4_kernel_available

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="engine._kernels was not built")

HELPER_NS = 3_000_000  # the helper's block outlasts the caller's by this: past split.c's SOLO_WAIT_NS


def test_a_join_that_waits_out_a_descheduled_helper_runs_the_next_calls_on_the_caller_alone():
    assert _kernels.split_probe(0, True, True) == 1  # no solo period: the helper takes its half's block
    assert _kernels.split_probe(HELPER_NS, True, True) == 1  # it sleeps in its block: the join waits 3 ms
    assert _kernels.split_probe(0, True, False) == 0  # the next job ran on the caller alone
    assert _kernels.cores_shared(1) is True  # and torch's products stay on one thread (engine/rows.py)


def test_a_join_that_waits_out_a_long_block_keeps_the_helper():
    assert _kernels.split_probe(HELPER_NS, False, True) == 1  # the helper spins 3 ms: it is running, not off
    assert _kernels.split_probe(0, False, False) == 1  # so the next job still shares its blocks
