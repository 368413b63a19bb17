"""The router against hand-computed cases, and the stable top-k it and the DSA indexer choose with."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config.args import ModelArgs
from engine.core.layers import TOPK_FIRST_FROM, stable_topk_indices
from engine.core.moe import Gate

BASE = dict(
    model_type="deepseek_v3",
    vocab_size=16,
    hidden_size=8,
    intermediate_size=16,
    moe_intermediate_size=4,
    num_hidden_layers=2,
    num_attention_heads=2,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=4,
    qk_nope_head_dim=4,
    qk_rope_head_dim=2,
    v_head_dim=4,
)


def gate_for(scores: list[float], bias: list[float] | None = None, **config) -> tuple[Gate, torch.Tensor]:
    """A gate whose sigmoid scores for the returned input are exactly ``scores``."""
    n = len(scores)
    args = ModelArgs.from_hf_config({**BASE, "n_routed_experts": n, "hidden_size": n, **config})
    gate = Gate(args)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(n))
        gate.bias.copy_(torch.tensor(bias or [0.0] * n))
    x = torch.logit(torch.tensor([scores], dtype=torch.float64)).float()
    return gate, x


def route(gate: Gate, x: torch.Tensor) -> tuple[list[int], list[float]]:
    weights, ids = gate(x)
    order = ids[0].argsort()
    return ids[0][order].tolist(), weights[0][order].tolist()


def test_group_limit_excludes_the_best_expert_of_a_weaker_group():
    # group 0 = experts 0-3 (top-2 sum 1.0), group 1 = experts 4-7 (top-2 sum 1.5): only group 1 allowed
    gate, x = gate_for([0.9, 0.1, 0.1, 0.1, 0.8, 0.7, 0.1, 0.1], n_group=2, topk_group=1, routed_scaling_factor=2.0)
    ids, weights = route(gate, x)
    assert ids == [4, 5]
    assert weights == pytest.approx([2.0 * 0.8 / 1.5, 2.0 * 0.7 / 1.5], abs=1e-6)


def test_groups_rank_by_the_sum_of_their_top_two_not_their_best():
    # group 0 best single score 0.95 but top-2 sum 1.05; group 1 top-2 sum 1.2
    gate, x = gate_for([0.95, 0.1, 0.05, 0.05, 0.6, 0.6, 0.05, 0.05], n_group=2, topk_group=1)
    assert route(gate, x)[0] == [4, 5]


def test_correction_bias_steers_selection_but_not_weights():
    gate, x = gate_for(
        [0.5, 0.6, 0.4, 0.3],
        bias=[0.2, 0.0, 0.0, 0.0],
        num_experts_per_tok=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )
    ids, weights = route(gate, x)
    assert ids == [0]
    assert weights == pytest.approx([0.5], abs=1e-6)


def test_without_normalisation_weights_are_scaled_scores():
    gate, x = gate_for([0.2, 0.9, 0.4, 0.7], norm_topk_prob=False, routed_scaling_factor=2.5)
    ids, weights = route(gate, x)
    assert ids == [1, 3]
    assert weights == pytest.approx([2.5 * 0.9, 2.5 * 0.7], abs=1e-6)


def test_with_normalisation_weights_sum_to_the_scale():
    gate, x = gate_for([0.2, 0.9, 0.4, 0.7], routed_scaling_factor=2.5)
    assert sum(route(gate, x)[1]) == pytest.approx(2.5, abs=1e-6)


def test_ties_go_to_the_lower_expert_and_the_lower_group():
    gate, x = gate_for([0.5] * 8, n_group=4, topk_group=2)
    assert route(gate, x)[0] == [0, 1]  # groups 0 and 1 tie with 2 and 3; experts tie within them


def test_router_is_batched_per_row():
    gate, x1 = gate_for([0.9, 0.1, 0.2, 0.8])
    _, x2 = gate_for([0.1, 0.9, 0.8, 0.2])
    weights, ids = gate(torch.cat([x1, x2]))
    assert sorted(ids[0].tolist()) == [0, 3] and sorted(ids[1].tolist()) == [1, 2]
    assert weights.shape == (2, 2) and weights.dtype == torch.float32


def test_gate_shape_follows_args():
    args = ModelArgs.from_hf_config(BASE)
    gate = Gate(dataclasses.replace(args, n_activated_experts=3))
    assert gate.weight.shape == (8, 8) and gate.topk == 3


def _sorted_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The definition: a stable descending sort of the whole row, its first k."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def _long_scores(kind: str, rows: int, total: int, g: torch.Generator) -> torch.Tensor:
    scores = torch.randn(rows, total, generator=g)
    if kind == "few values":  # ties everywhere, at the k-th score too
        return torch.randint(0, 6, (rows, total), generator=g).float()
    if kind == "masked":  # a prompt row's future positions: -inf ties once the visible ones run out
        return scores.masked_fill(torch.arange(total) > total // 7, -torch.inf)
    if kind == "nan":
        return scores.index_fill(-1, torch.tensor([5, 77, total - 1]), torch.nan)
    if kind == "relu":  # the indexer's relu: zeros tie
        return scores.sub(1.5).relu()
    return scores


@pytest.mark.parametrize("kind", ["distinct", "few values", "masked", "nan", "relu"])
def test_long_rows_take_the_same_indices_in_the_same_order_as_the_full_sort(kind):
    """From TOPK_FIRST_FROM positions (the DSA indexer's rows at long contexts) the set comes from topk;
    ties at the k-th score (few distinct values, -inf masks, relu's zeros) and NaNs must still give the
    sort's indices, in its order (an attention over the selected positions sums in that order)."""
    g = torch.Generator().manual_seed(len(kind))
    for trial in range(12):
        total = TOPK_FIRST_FROM + 37 * trial
        scores = _long_scores(kind, 1 + trial % 3, total, g)
        for k in (1, 8, 2048, total // 2):
            assert torch.equal(stable_topk_indices(scores, k), _sorted_topk(scores, k)), (kind, trial, k)


@pytest.mark.parametrize("kind", ["distinct", "few values", "masked", "nan", "relu"])
def test_many_short_rows_in_one_call_take_the_sorts_indices_too(kind):
    """A prompt's routers (rows of 256 experts) and its indexer's query blocks (rows of a few hundred
    positions) count their scores together: past TOPK_FIRST_FROM of them topk finds the sets, and every row
    must still get the sort's indices in its order."""
    g = torch.Generator().manual_seed(7 + len(kind))
    for rows, total, k in [(512, 256, 8), (64, 300, 128), (33, 257, 8), (16, 1000, 128), (41, 203, 4)]:
        assert rows * total >= TOPK_FIRST_FROM and total > 2 * k  # the topk-first path
        scores = _long_scores(kind, rows, total, g)
        assert torch.equal(stable_topk_indices(scores, k), _sorted_topk(scores, k)), (kind, rows, total, k)
