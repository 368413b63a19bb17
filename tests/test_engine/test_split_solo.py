"""engine/csrc/split.c's solo rule: a join that waited out a helper descheduled inside its block (another busy
process on the cores) runs the next calls on the caller alone, and says the cores are shared."""

from __future__ import annotations

import pytest

from engine.quant import _kernels, int4_kernel_available

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="engine._kernels was not built")

HELPER_SLEEP_NS = 3_000_000  # the helper's block outlasts the caller's by this: past split.c's SOLO_WAIT_NS


def test_a_join_that_waits_out_the_helper_runs_the_next_calls_on_the_caller_alone():
    assert _kernels.split_probe(0, True) == 1  # no solo period: the helper takes its half's block
    assert _kernels.split_probe(HELPER_SLEEP_NS, True) == 1  # its block sleeps: the caller's join waits 3 ms
    assert _kernels.split_probe(0, False) == 0  # the next job ran on the caller alone
    assert _kernels.cores_shared(1) is True  # and torch's products stay on one thread (engine/rows.py)
