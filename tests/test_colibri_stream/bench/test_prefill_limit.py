"""The prefill limit line (bench/prefill_limit.py): the multiply-adds of a prompt on a hand-computed tiny
geometry, the fraction arithmetic, which prefill rows count, the report's table, and the calibration run on
a tiny shape (numbers present and positive; never a timing)."""

from __future__ import annotations

import math
from dataclasses import replace

from colibri_stream.bench.prefill_limit import (
    PROBES,
    PromptWork,
    best_prefill_ttft,
    calibrate_kernel,
    causal_pairs,
    compute_peaks,
    prefill_limit_line,
    prompt_multiply_adds,
)
from colibri_stream.bench.report_peers import prefill_limit_lines
from colibri_stream.bench.stress_model import StressShape, config_for
from engine.config.args import ModelArgs

TINY = StressShape(
    hidden_size=8,
    moe_intermediate_size=4,
    intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=3,  # layer 0 dense, 1-2 MoE (one shared expert each: config_for)
    first_k_dense_replace=1,
    num_attention_heads=2,
    kv_lora_rank=4,
    q_lora_rank=6,
    qk_rope_head_dim=2,
    qk_nope_head_dim=4,
    v_head_dim=4,
    vocab_size=10,
    n_group=1,
    topk_group=1,
)


def test_causal_pairs_with_and_without_a_window():
    assert causal_pairs(3) == 1 + 2 + 3
    assert causal_pairs(3, window=2) == 1 + 2 + 2
    assert causal_pairs(3, window=8) == 6


def test_a_prompts_multiply_adds_on_a_hand_computed_geometry():
    args = ModelArgs.from_hf_config(config_for(TINY))
    work = prompt_multiply_adds(args, 3)
    expert = 3 * 8 * 4  # gate, up, down: hidden x moe_intermediate each
    assert work.experts == 2 * 3 * (2 * expert + 8 * 4)  # 2 MoE layers x 3 tokens x (top-2 + the router)
    assert work.shared == 2 * 3 * expert
    assert work.dense == 1 * 3 * 3 * 8 * 16
    q = 8 * 6 + 6 * 2 * (4 + 2)  # q_a, q_b to 2 heads x qk_head_dim 6
    kv = 8 * (4 + 2) + 4 * 2 * (4 + 4)  # kv_a (latent + rope key), kv_b (nope key + value per head)
    o = 2 * 4 * 8
    assert work.projections == 3 * 3 * (q + kv + o) == 2664
    assert work.attention == 3 * 2 * 6 * (6 + 4)  # layers x heads x causal pairs x (qk + v dims)
    assert work.indexer == 0
    assert work.head == 8 * 10  # the last position only
    assert work.total == 1344 + 576 + 1152 + 2664 + 360 + 80
    assert work.as_dict()["total"] == work.total


def test_the_dsa_indexer_and_its_top_k_window_are_counted():
    args = ModelArgs.from_hf_config(config_for(TINY))
    dsa = replace(args, index_n_heads=2, index_head_dim=4, index_topk=2, indexer_types=("full", "shared", "full"))
    work = prompt_multiply_adds(dsa, 3)
    assert work.attention == 3 * 2 * (1 + 2 + 2) * (6 + 4)  # each query attends to at most 2 selected keys
    per_token = 6 * 2 * 4 + 8 * 4 + 8 * 2  # wq_b, wk, weights_proj
    assert work.indexer == 2 * (3 * per_token + 2 * 4 * 6)  # two layers run their own; scores over all pairs


def test_the_fraction_of_the_limit_per_contender_and_length():
    peaks = {"threads": 2, "GMACps": {"int8": 1.0, "fp32": 0.5}, "kernels": {}}
    work = {1024: PromptWork(2 * 10**9, 0, 0, 0, 0, 0, 0), 128: PromptWork(10**8, 0, 0, 0, 0, 0, 0)}
    line = prefill_limit_line(peaks, work, {"ours": {1024: 4.0}, "theirs": {1024: 8.0, 128: 0.1}})
    assert line["limit_format"] == "int8" and line["compute_peak_GMACps"]["int8"] == 1.0
    assert line["prompts"]["1024"]["fastest_ttft_s"] == 2.0  # 2e9 multiply-adds at 1e9 per second
    assert line["prompts"]["1024"]["fastest_tok_per_s"] == 512.0
    assert line["contenders"]["ours"]["1024"] == {
        "measured_ttft_s": 4.0,
        "measured_GMACps": 0.5,
        "fraction_of_limit": 0.5,
    }
    assert line["contenders"]["theirs"]["1024"]["fraction_of_limit"] == 0.25
    assert line["contenders"]["theirs"]["128"]["fraction_of_limit"] == 1.0
    assert "128" not in line["contenders"]["ours"]
    report = "\n".join(prefill_limit_lines(line))
    assert "| ours |  | 4.0 | 0.5 | 0.5 |" in report and "int8 1.0, fp32 0.5" in report
    no_peak = prefill_limit_line({"threads": 2, "GMACps": {}, "kernels": {}}, work, {"ours": {1024: 4.0}})
    assert no_peak["contenders"]["ours"]["1024"]["fraction_of_limit"] is None


def test_only_warm_full_budget_prefill_rows_count_the_best_of_them():
    def row(pct, cold, ttft, **extra):
        return {"budget_pct": pct, "cold": cold, "ttft_s": ttft, "prompt_tokens": 1024} | extra

    prefill = {
        "ours": [row(100, True, 3.0), row(100, False, 2.0), row(25, True, 1.0)],
        "rows": [
            row(100, False, 9.0, file="q4_0"),
            row(100, False, 7.0, file="q4_0"),  # repacked: its best mode counts
            row(100, True, 1.0, file="q4_0"),  # cold at 100% does not count
            row(100, False, 0.0, file="q4e_q8"),  # no first token
        ],
    }
    assert best_prefill_ttft(prefill) == {"colibri-stream int8": {1024: 2.0}, "llama.cpp q4_0": {1024: 7.0}}


def test_calibration_stops_at_the_first_probe_without_budget_and_measures_what_fits():
    called = []

    def make(m, k, n):
        called.append((m, k, n))
        return lambda: sum(range(100))

    rate, shape = calibrate_kernel(make, budget_s=0.0, shapes=[(256, 2048, 2048)])
    assert shape == PROBES[0] and called == [PROBES[0]] and rate > 0
    called.clear()
    rate, shape = calibrate_kernel(make, budget_s=0.05, shapes=[(32, 64, 64)])
    assert called[: len(PROBES)] == list(PROBES) and set(called[len(PROBES) :]) == {(32, 64, 64)}
    assert shape == (32, 64, 64) and len(called) > len(PROBES) + 1  # the budget left buys more tries


def test_compute_peaks_on_a_tiny_shape_gives_every_format_a_positive_rate():
    peaks = compute_peaks(threads=1, budget_s=0.4, shapes=[(32, 64, 64)])
    assert peaks["threads"] == 1
    assert {"int8", "fp32"} <= set(peaks["GMACps"])
    for fmt, rate in peaks["GMACps"].items():
        assert math.isfinite(rate) and rate > 0, fmt
    for row in peaks["kernels"].values():
        assert row["format"] in peaks["GMACps"] and len(row["shape"]) == 3 and row["GMACps"] > 0
