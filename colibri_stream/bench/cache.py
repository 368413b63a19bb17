"""Section 4 of the bench: each eviction policy against Belady's MIN on recorded routing traces.

Placement never changes tokens, so one run's trace is every policy's request sequence: replaying it
offline at each capacity gives the frequency policy (the default), LRU, the hybrid, learned pins and the
offline optimum side by side.
Capacities are the slot counts the live store would have at each RAM budget, plus a sweep for the
curve; the pinned policy leaves one layer of unpinned room, as the live store does. Hits are counted
over the decode steps only: the prompt's acquires (one per MoE layer, or several consecutive chunks of
it below one layer's experts) warm the cache uncounted, as its reads are compulsory misses for every
policy and would only dilute the differences.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from storage.tiers.policy import POLICY_NAMES
from storage.tiers.simulate import compare_policies, read_acquires, read_trace


def capacity_sweep(n_experts: int, total_records: int, points: int) -> list[int]:
    """``points`` capacities from one layer's experts (a prompt's union in one acquire) to every record."""
    if points < 2 or total_records <= n_experts:
        return [total_records]
    step = (total_records - n_experts) / (points - 1)
    return sorted({round(n_experts + i * step) for i in range(points)})


def prompt_acquires(acquires: Sequence[tuple[int, list[int]]], moe_layers: int) -> int:
    """How many leading acquires are the prompt's: its one pass over the MoE layers, in which a layer's
    union may come as several consecutive chunks (budgets below one layer's experts)."""
    passed = 0
    for i, (layer, _) in enumerate(acquires):
        if i == 0 or layer != acquires[i - 1][0]:
            passed += 1
            if passed > moe_layers:
                return i
    return len(acquires)


def trace_section(
    trace_path: Path,
    record_bytes: int,
    n_experts: int,
    total_records: int,
    budgets: dict[str, int],
    sweep_points: int,
    moe_layers: int,
    learned_from: Path | None = None,
) -> dict:
    """Hit rates per policy and Belady at the budgets' capacities (``budgets``: label -> RAM bytes)
    and over a capacity sweep. Pins come from the trace at ``learned_from`` (another prompt's run)
    when given, else from this trace itself."""
    acquires = read_acquires(trace_path)
    trace = [(layer, expert) for layer, experts in acquires for expert in experts]
    prompt_requests = sum(len(experts) for _, experts in acquires[: prompt_acquires(acquires, moe_layers)])
    learned = read_trace(learned_from) if learned_from else None
    at_budget = {label: min(total_records, ram // record_bytes) for label, ram in budgets.items()}
    # a decode step asks each MoE layer for top-k experts: the live store's frequency half-life
    uses_per_token = moe_layers * len(acquires[-1][1]) if acquires else 1
    capacities = sorted(set(at_budget.values()))
    rows = compare_policies(trace, capacities, n_experts, prompt_requests, learned, uses_per_token)
    by_capacity = {row["capacity"]: row for row in rows}
    budget_rows = [{"budget": label, **by_capacity[capacity]} for label, capacity in at_budget.items()]
    sweep_capacities = capacity_sweep(n_experts, total_records, sweep_points)
    sweep = compare_policies(trace, sweep_capacities, n_experts, prompt_requests, learned, uses_per_token)
    return {
        "trace": str(trace_path),
        "requests": len(trace),
        "decode_requests": len(trace) - prompt_requests,
        "pins_learned_from": str(learned_from) if learned_from else "this trace (optimistic)",
        "distinct_experts": len(set(trace)),
        "total_records": total_records,
        "at_budgets": budget_rows,
        "sweep": sweep,
    }


def gap_to_belady_pp(row: dict, policies: Sequence[str] = POLICY_NAMES) -> float:
    """Belady's hit rate minus the best policy's, in percentage points."""
    return round(100 * (row["belady"] - max(row[p] for p in policies)), 2)
