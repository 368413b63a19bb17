"""Library entry points for surfaces that no colibri-stream command reads (run in the child)."""

from __future__ import annotations

from storage.tiers.simulate import compare_policies, read_trace


def replay_trace(path: str) -> None:
    """What ``tools/simulate_trace.py TRACE --capacities 4,16 --room 2`` does with a trace file."""
    compare_policies(read_trace(path), [4, 16], 2)
