"""The bench's batch rows (colibri_stream/bench/batch_rows.py): the demo model served to concurrent clients
against the same requests one after another, in one in-process server."""

from __future__ import annotations

import statistics

from colibri_stream.bench.batch_rows import BatchSettings, batch_section, batch_table
from colibri_stream.bench.report import GOALS
from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.convert.converter import Converter, ConvertOptions


def test_each_client_count_keeps_its_rounds_median_and_the_answers_batching_must_not_change(tmp_path):
    container = tmp_path / "demo.cstream"
    Converter(demo_model_dir(), container, ConvertOptions(), progress=False).run()
    settings = BatchSettings(clients=(1, 3), max_tokens=4, prompt_tokens=7, rounds=3)
    section = batch_section(container, tmp_path / "kv", settings)
    assert [row["clients"] for row in section["rows"]] == [1, 3]
    for row in section["rows"]:
        assert len(row["round_ratios"]) == 3 and row["same_answers"] is True
        assert row["ratio"] == round(statistics.median(row["round_ratios"]), 3)
        assert row["sequential_tok_per_s"] > 0 and row["concurrent_tok_per_s"] > 0
        # the rates shown are the median round's: their ratio is that round's
        shown = row["concurrent_tok_per_s"] / row["sequential_tok_per_s"]
        assert min(abs(shown - r) for r in row["round_ratios"]) < 0.01
    assert section["ratios"] == {"batch_3_clients": section["rows"][1]["ratio"]}
    assert section["settings"]["clients"] == (1, 3)


def test_the_report_shows_every_round_beside_the_median_and_the_goal_of_4_clients():
    rows = [
        {"clients": n, "sequential_tok_per_s": 100.0, "concurrent_tok_per_s": 100.0 * r, "ratio": r,
         "round_ratios": [r - 0.1, r, r + 0.2], "same_answers": True}
        for n, r in ((1, 1.0), (4, 1.7))
    ]  # fmt: skip
    table = batch_table({"rows": rows})
    assert table[-1] == "| 4 | 100.00 | 170.00 | 1.70x | 1.60, 1.70, 1.90 | True |"
    goal, met = GOALS["batch_4_clients"]
    assert goal == ">= 1.6" and met(1.6) and not met(1.59)
