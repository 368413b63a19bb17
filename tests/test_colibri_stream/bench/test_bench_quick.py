"""`colibri-stream bench --quick` end to end on a tiny generated model: every section, every ratio,
the plots, and the invariants the numbers must respect (never a timing).

Every measured row is a process (a torch import, ~5 s here), so the end-to-end run samples each kind of
row once (E2E: the 50% budget and the side contenders' 100% rows left out); that --quick's own grid has
every point is checked without running it."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from colibri_stream import cli
from colibri_stream.bench import suite
from colibri_stream.bench.system import cgroup_available

# --quick's settings at fewer points: every budget kind (below a layer's experts, the ratio budget, all
# in RAM), every policy, prefetch off, warm, the bf16 container and the peer at the ratio budget; a
# shorter resumed conversation and demo trace
E2E = replace(
    suite.QUICK_SETTINGS,
    budgets_pct=(10, suite.RATIO_BUDGET, 100),
    side_budgets_pct=(suite.RATIO_BUDGET,),
    conversation_tokens=64,
    demo_tokens=16,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    out = root / "out"
    argv = ["bench", "--quick", "--json", "--out", str(out), "--work", str(root / "work")]
    # llama.cpp (where the peers extra is installed) and load have their own tests (test_bench_llama_cpp.py):
    # here they would add ~1 min to the suite
    argv += ["--sections", "disk,decode,peer,caching,sessions"]
    return argv, out


def test_quick_grid_has_every_budget_policy_prefetch_and_container():
    bench = suite.Bench(suite.QUICK_SETTINGS, Path("work"), Path("out"), print)
    grid = bench.decode_grid()
    assert {c.budget_pct for c in grid if c.container == "int4"} == {10, 25, 50, 100}
    assert {(c.budget_pct, c.cold) for c in grid if not c.cold} == {(25, False), (100, False)}
    assert {c.policy for c in grid} == {"frequent", "lru", "hybrid", "pinned"}
    assert [c.policy for c in grid if not c.prefetch] == ["frequent"]
    assert bench.side_budgets == (25, 100)  # the bf16 container's rows and the peer's
    assert [c.budget_pct for c in grid if c.container == "bf16"] == [25, 100]
    # the end-to-end run below samples each of these kinds of row
    e2e = suite.Bench(E2E, Path("work"), Path("out"), print).decode_grid()
    assert {(c.policy, c.prefetch, c.cold, c.container) for c in e2e} == {
        (c.policy, c.prefetch, c.cold, c.container) for c in grid
    }


def test_quick_bench_reports_every_section_and_ratio(bench, capsys, monkeypatch):
    argv, out = bench
    monkeypatch.setattr(suite, "QUICK_SETTINGS", E2E)  # the CLI takes --quick's settings from the suite
    assert cli.main(argv) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results == json.loads((out / "results.json").read_text())

    ratios = results["ratios"]
    assert set(ratios) == {"vs_accelerate", "io_efficiency", "hit_vs_belady_pp", "resume_speedup"}
    assert all(math.isfinite(v) for v in ratios.values())
    assert ratios["vs_accelerate"] > 0 and ratios["io_efficiency"] > 0 and ratios["resume_speedup"] > 0
    assert ratios["hit_vs_belady_pp"] >= 0  # no online policy beats the optimum
    assert results["memory_limits"]["enforced"] == cgroup_available()
    assert results["machine"]["memory_bandwidth_Bps"] > 0 and len(results["machine"]["load_average_at_start"]) == 3
    ours_limit = results["limit_line"]["contenders"]["colibri-stream"]
    assert 0 < ours_limit["fraction_of_limit"] and ours_limit["bytes_per_token"]["experts"] > 0
    prefill_limit = results["prefill_limit_line"]  # no prefill rows without the llama_cpp section: the line alone
    assert prefill_limit["compute_peak_GMACps"]["int8"] > 0 and prefill_limit["contenders"] == {}
    assert prefill_limit["prompts"][str(E2E.prefill_tokens)]["multiply_adds"]["total"] > 0

    disk = results["disk"]
    for name in ("raw_sequential_odirect", "raw_expert_random_odirect", "ours_cold_buffered", "ours_cold_odirect"):
        assert disk[name]["MBps"] > 0 and disk[name]["bytes"] > 0

    # Placement changes speed, never tokens: every budget, policy, prefetch and page-cache state agrees.
    decode = results["decode"]
    int4_ids = {json.dumps(row["ids"]) for row in decode if row["container"] == "int4"}
    assert len(int4_ids) == 1 and len(json.loads(int4_ids.pop())) == 12
    budgets = {row["budget_pct"] for row in decode if row["container"] == "int4"}
    assert budgets == {10, 25, 100}
    assert {row["policy"] for row in decode} == {"frequent", "lru", "hybrid", "pinned"}
    assert any(not row["prefetch"] for row in decode) and any(not row["cold"] for row in decode)
    assert {row["container"] for row in decode} == {"int4", "bf16"}
    assert {row["budget_pct"] for row in decode if row["container"] == "bf16"} == {25}
    cold = {r["budget_pct"]: r for r in decode if r["name"].startswith("int4") and r["name"].endswith("fetch cold")}
    assert cold[100]["hit_rate"] >= cold[10]["hit_rate"]
    assert cold[100]["bytes_per_token"] <= cold[10]["bytes_per_token"]

    peer = results["peer"]
    assert [row["budget_pct"] for row in peer] == [25]  # the ratio budget
    assert all(len(row["ids"]) == 12 and row["decode_tok_per_s"] > 0 for row in peer)

    for section in results["caching"].values():
        for row in section["at_budgets"] + section["sweep"]:
            assert row["belady"] >= max(row["frequent"], row["lru"], row["hybrid"], row["pinned"])
        assert section["sweep"][-1]["capacity"] == section["total_records"]

    sessions = results["sessions"]
    assert sessions["same_first_token"]
    assert sessions["warm"]["reused_tokens"] == sessions["conversation_tokens"]
    assert sessions["warm"]["prefill_tokens"] == sessions["follow_up_tokens"] - sessions["conversation_tokens"]
    assert sessions["cold"]["prefill_tokens"] == sessions["follow_up_tokens"]

    for path in results["plots"]:
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    report = (out / "benchmarks.md").read_text()
    headings = ("## Ratios", "## 1. Disk", "## 2-3. Decode", "## 4. Caching", "## 5. Sessions", "## The prefill limit")
    for heading in headings:
        assert heading in report


def test_the_prompts_acquires_are_one_pass_over_the_layers_chunks_included():
    from colibri_stream.bench.cache import prompt_acquires

    one_each = [(1, [0, 1]), (2, [3]), (3, [1]), (1, [0]), (2, [1])]
    chunked = [(1, [0, 1]), (1, [2]), (2, [3]), (3, [1]), (3, [5]), (1, [0]), (2, [1]), (3, [2])]
    assert prompt_acquires(one_each, 3) == 3
    assert prompt_acquires(chunked, 3) == 5
    assert prompt_acquires(chunked[:2], 3) == 2  # a prompt-only trace
