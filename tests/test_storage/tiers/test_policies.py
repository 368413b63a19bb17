"""Policy scenarios at capacity 4 with integer ids, the tier's "full" answer, and Belady's optimum."""

from __future__ import annotations

import pytest

from storage.tiers.policy import FrequentPolicy, HybridPolicy, LRUPolicy
from storage.tiers.simulate import belady_hits, replay
from storage.tiers.tier import SlotTier


def _resident_after(policy, requests, capacity=4, hot=frozenset()):
    tier = SlotTier("t", capacity, policy, hot=hot)
    for key in requests:
        if tier.lookup(key) is None:
            assert tier.allocate(key) is not None
    return set(tier.entries)


def test_lru_evicts_the_least_recently_used():
    assert _resident_after(LRUPolicy(), [1, 2, 3, 4, 1, 5]) == {1, 3, 4, 5}


def test_lru_is_flushed_by_a_scan_but_hybrid_keeps_the_hot_set():
    hot_then_scan = [1, 2, 1, 2, 1, 2, 1, 2, 10, 11, 12, 13]
    assert _resident_after(LRUPolicy(), hot_then_scan) == {10, 11, 12, 13}
    assert {1, 2} <= _resident_after(HybridPolicy(), hot_then_scan)


def test_hybrid_forgets_old_popularity():
    old_hot = [1] * 6 + [2, 3, 4]
    recent = [5, 5, 6, 6, 7, 7, 8, 8]
    assert 1 not in _resident_after(HybridPolicy(half_life=2), old_hot + recent)
    assert 1 in _resident_after(HybridPolicy(half_life=1000), old_hot + recent)


def test_a_cycle_longer_than_the_tier_defeats_lru_but_frequent_keeps_all_but_one_slot():
    """A token's experts outnumbering the slots: every key comes back once per cycle (a token)."""
    cycle = list(range(10)) * 20
    assert replay(cycle, 4, "lru") == 0
    # after the first pass 3 keys stay, one slot churns (10 uses a token: a half-life past the trace)
    assert replay(cycle, 4, "frequent", uses_per_token=10) == 19 * 3
    assert belady_hits(cycle, 4) == 64  # the optimum rotates which keys stay: 57 is 89% of it


def test_frequent_keeps_the_most_used_and_lets_a_returning_key_earn_its_slot():
    used_often = [1, 2, 3] * 4
    assert {1, 2, 3} <= _resident_after(FrequentPolicy(), used_often + [10, 11, 12, 13, 14])
    # 9 is evicted (one use) but its count survives: back a fourth time it outranks 3 (used once)
    keeps = _resident_after(FrequentPolicy(), [1, 1, 2, 2, 3, 4, 9, 5, 9, 6, 9, 7, 9])
    assert {1, 2, 9} <= keeps and 3 not in keeps


def test_frequent_forgets_old_popularity_with_a_short_half_life():
    old_hot = [1] * 6 + [2, 3, 4]
    recent = [5, 5, 6, 6, 7, 7, 8, 8] * 3
    assert 1 not in _resident_after(FrequentPolicy(half_life=2), old_hot + recent)
    assert 1 in _resident_after(FrequentPolicy(half_life=1000), old_hot + recent)


def test_frequent_skips_busy_keys_and_still_finds_them_later():
    tier = SlotTier("t", 2, FrequentPolicy())
    tier.allocate(1).pins = 1  # least used, but in use by the current step
    tier.allocate(2)
    tier.lookup(2)
    assert tier.allocate(3) is not None and set(tier.entries) == {1, 3}  # 2 went, though used more
    tier.entries[3].pins = 1
    assert tier.allocate(4) is None  # both busy: "full" is an answer
    tier.unpin([1])
    assert tier.allocate(4) is not None and set(tier.entries) == {3, 4}  # 1 was held aside, not lost


def test_learned_hot_keys_are_never_evicted():
    assert {1, 2} <= _resident_after(LRUPolicy(), [1, 2, 3, 4, 5, 6, 7, 8], hot=frozenset({1, 2}))


def test_full_is_an_answer_not_an_exception():
    tier = SlotTier("t", 2, LRUPolicy())
    for key in (1, 2):
        tier.allocate(key).pins = 1  # in use by the current step
    assert tier.allocate(3) is None
    tier.unpin([1])
    assert tier.allocate(3) is not None and 1 not in tier


def test_belady_on_a_hand_made_trace_with_a_known_optimum():
    trace = [1, 2, 3, 1, 2, 3, 1, 2]
    # MIN: [1 m][2 m][3 m, evict 2 (next use 4 vs 1's 3)][1 h][2 m, evict 1 (next 6) vs 3 (next 5)]
    #      [3 h][1 m, evict 3 (never again) ][2 h]  -> hits at steps 3, 5, 7 = 3
    assert belady_hits(trace, 2) == 3
    assert replay(trace, 2, "lru") == 0  # the cyclic pattern defeats LRU completely
    assert belady_hits(trace, 3) == 5  # everything fits: only the 3 compulsory misses


@pytest.mark.parametrize("policy", ["lru", "hybrid", "frequent"])
def test_no_policy_beats_belady(policy):
    import random

    rng = random.Random(0)
    trace = [rng.choice([0, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7]) for _ in range(400)]
    for capacity in (2, 3, 5):
        assert replay(trace, capacity, policy) <= belady_hits(trace, capacity)


def _belady_by_scanning(trace, capacity):
    """MIN written the slow, obvious way: on each miss scan the cache for the farthest next use."""
    cached, hits = set(), 0
    for now, key in enumerate(trace):
        if key in cached:
            hits += 1
            continue
        if len(cached) >= capacity:
            later = trace[now + 1 :]
            cached.remove(max(cached, key=lambda k: later.index(k) if k in later else len(trace)))
        cached.add(key)
    return hits


def test_heap_belady_equals_the_scanning_definition():
    import random

    rng = random.Random(1)
    for _ in range(20):
        keys = rng.randint(3, 12)
        trace = [(rng.randint(0, 2), rng.randint(0, keys)) for _ in range(rng.randint(1, 300))]
        for capacity in (1, 2, 4, 7, 20):
            assert belady_hits(trace, capacity) == _belady_by_scanning(trace, capacity)
    assert belady_hits([1, 2, 1], 0) == 0


def test_count_from_warms_the_cache_without_counting():
    trace = [1, 2, 1, 2, 3, 1]
    assert replay(trace, 2, "lru") == 2 and belady_hits(trace, 2) == 3  # Belady keeps 1 over 2 at step 4
    assert replay(trace, 2, "lru", count_from=3) == 1  # only step 3 (2) hits among steps 3-5
    assert belady_hits(trace, 2, count_from=3) == 2  # steps 3 (2) and 5 (1)


def _tier_with(policy, uses: dict[int, int], capacity: int) -> SlotTier:
    """A full tier whose keys were each looked up ``uses[key]`` times after their insert."""
    tier = SlotTier("t", capacity, policy)
    for key, n in uses.items():
        tier.allocate(key)
        for _ in range(n):
            tier.lookup(key)
    return tier


def test_an_awaited_guess_outlives_keys_used_more_often():
    """A prefetch guess has few uses so far: under the frequency policy it would be the next victim,
    before the use it was read for. Awaited, the least-used of the others leaves instead."""
    tier = _tier_with(FrequentPolicy(), {1: 5, 2: 3, 3: 0}, capacity=3)
    tier.entries[3].awaited = True
    assert tier.allocate(4, demand=False) is not None
    assert set(tier.entries) == {1, 3, 4}
    tier.lookup(4)
    tier.entries[3].awaited = False  # the router passed it by: the least used, it goes first again
    assert tier.allocate(5) is not None and 3 not in tier.entries


def test_only_a_demand_read_takes_an_awaited_guess_slot():
    tier = _tier_with(FrequentPolicy(), {1: 0, 2: 0}, capacity=2)
    tier.entries[1].awaited = tier.entries[2].awaited = True
    assert tier.allocate(3, demand=False) is None  # a guess never displaces a guess
    assert set(tier.entries) == {1, 2}
    assert tier.allocate(3) is not None  # a step needs 3: one guess gives way
    assert len(tier.entries) == 2 and 3 in tier.entries
