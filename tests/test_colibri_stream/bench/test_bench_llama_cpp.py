"""The bench's llama.cpp contender, loaded_vs_idle and the limit line: their arithmetic and bookkeeping
without llama.cpp, and one end-to-end conversion + decode that runs only where the peers extra and the
converter are installed (skipped otherwise)."""

from __future__ import annotations

import importlib.util
import io
import json
import signal
import subprocess
import sys
import tarfile

import pytest

from colibri_stream import cli
from colibri_stream.bench import llama_cpp, suite, system
from colibri_stream.bench.alternated_rows import alternated_ratios, alternated_rows
from colibri_stream.bench.limit_line import TouchedBytes, gguf_touched, limit_line, llama_cpp_kv_bytes, ours_touched
from colibri_stream.bench.llama_cpp_race import INT8_MATCHED
from colibri_stream.bench.llama_cpp_section import (
    best_row,
    fastest_warm_mode,
    llama_cpp_grid,
    llama_cpp_ratios,
    same_limit_ratios,
    warm_ttft_ratios,
)
from colibri_stream.bench.load import loaded_vs_idle
from colibri_stream.bench.prefill_rows import as_prefill_row, llama_cpp_prefill_rows, long_decode_ratios, prefill_ratios
from colibri_stream.bench.report_peers import alternated_lines, llama_cpp_lines, machine_lines, prefill_lines
from colibri_stream.bench.system import ContenderFailed, ProcessRun, steal_share


# ------------------------------------------------------------------------------------ limit line
def test_the_limit_line_holds_our_matched_rows_when_the_llama_cpp_section_runs_alone(tmp_path, monkeypatch):
    """`tools/bench_llama_cpp.py` runs the llama_cpp section without the decode one: our quality-matched
    containers' 100% rows are on the limit line anyway, measured, since the section hands their paths over
    in its results (the suite looked for them on itself and found none: "measured None")."""
    bench = suite.Bench(suite.QUICK_SETTINGS, tmp_path, tmp_path / "out", lambda line: None)
    bench.prepare_models()
    int8 = bench.convert_container("int4", dense="int8")
    row = {"container": INT8_MATCHED, "budget_pct": 100, "decode_tok_per_s": 7.0}
    bench.results.update(
        machine={"memory_bandwidth_Bps": 10**10, "torch_threads": 1},
        llama_cpp={
            "matched_containers": {INT8_MATCHED: str(int8)},
            "ours_matched": [row, {**row, "budget_pct": 25, "decode_tok_per_s": 99.0}],  # 25% never counts
            "files": {},
            "rows": [],
        },
    )
    monkeypatch.setattr(suite, "memory_bandwidth", lambda threads: 10**10)
    line = bench.limit_line_summary()["contenders"]["colibri-stream int8"]
    assert line["measured_tok_per_s"] == 7.0
    assert line["fraction_of_limit"] == round(7.0 / line["fastest_tok_per_s"], 3)


def test_bytes_touched_per_token_and_the_limit_line():
    ours = ours_touched(
        dense_bytes_per_token=1000, record_bytes=50, top_k=6, moe_layers=3, kv_bytes_per_token=4, context=10
    )
    assert (ours.dense, ours.experts, ours.kv, ours.total) == (1000, 900, 40, 1940)

    tensors = [
        ("token_embd.weight", 8192 * 10),  # one row of 8192 is read
        ("output.weight", 500),
        ("blk.1.ffn_gate_exps.weight", 6400),  # 64 experts of 100 bytes, 6 read
        ("blk.1.ffn_down_exps.weight", 6400),
        ("blk.1.ffn_gate_shexp.weight", 70),  # the shared expert is dense
        ("blk.1.exp_probs_b.bias", 7),
    ]
    theirs = gguf_touched(tensors, n_expert=64, top_k=6, n_vocab=8192, kv_bytes=llama_cpp_kv_bytes(2, 256, 32, 10))
    assert theirs == TouchedBytes(dense=10 + 500 + 70 + 7, experts=2 * 600, kv=2 * 288 * 2 * 10)

    line = limit_line(1e9, {"ours": ours, "theirs": theirs}, {"ours": 1e9 / 1940 / 4})
    assert line["memory_bandwidth_GBps"] == 1.0
    assert line["contenders"]["ours"]["fastest_tok_per_s"] == round(1e9 / 1940, 2)
    assert line["contenders"]["ours"]["fraction_of_limit"] == 0.25
    assert line["contenders"]["theirs"]["fraction_of_limit"] is None  # not measured: no fraction


# ---------------------------------------------------------------------------------------- ratios
def _row(kind, pct, tok_s, ttft, cold=True, repack=False):
    name = f"llama.cpp {kind} {pct}% {'repacked' if repack else 'mmap'} {'cold' if cold else 'warm'}"
    return {"file": kind, "budget_pct": pct, "cold": cold, "repack": repack, "name": name}.__or__(
        {"decode_tok_per_s": tok_s, "ttft_s": ttft}
    )


def test_ratios_take_llama_cpps_best_cold_row_of_each_file():
    rows = [
        _row("q4e_q8", 100, 10.0, 0.8),
        _row("q4e_q8", 100, 20.0, 1.6, repack=True),  # fastest decode ...
        _row("q4e_q8", 100, 99.0, 0.1, cold=False),  # warm rows enter only the *_fastest_100 ratios
        _row("q4e_q8", 25, 0.5, 4.0),
        _row("q4_0", 100, 25.0, 0.5),
        _row("q4_0", 25, 0.4, 4.0),
    ]
    assert best_row(rows, "q4e_q8", 100) == {
        "decode_tok_per_s": 20.0,
        "decode_row": "llama.cpp q4e_q8 100% repacked cold",
        "ttft_s": 0.8,  # ... and, separately, the lowest TTFT
    }
    ours = {100: {"decode_tok_per_s": 5.0, "ttft_s": 4.0}, 25: {"decode_tok_per_s": 3.0, "ttft_s": 5.0}}
    assert llama_cpp_ratios({"q4e_q8": ours}, rows) == {
        "vs_llama_cpp_100": 0.25,
        "vs_llama_cpp_fastest_100": round(5.0 / 99.0, 2),  # at 100% also against its fastest row, cold or warm
        "vs_llama_cpp_q4_0_100": 0.2,  # no int4-dense rows of ours: the int8-dense ones stand in
        "vs_llama_cpp_q4_0_fastest_100": 0.2,
        "ttft_vs_llama_cpp_100": 0.2,  # llama.cpp's TTFT / ours: < 1 means we are slower to the first token
        "vs_llama_cpp_25": 6.0,
        "vs_llama_cpp_q4_0_25": 7.5,
    }
    int4_dense = {100: {"decode_tok_per_s": 30.0, "ttft_s": 1.0}}  # all-Q4_0 against ours with int4 dense records
    ratios = llama_cpp_ratios({"q4e_q8": ours, "q4_0": int4_dense}, rows)
    assert ratios["vs_llama_cpp_q4_0_100"] == 1.2 and "vs_llama_cpp_q4_0_25" not in ratios
    assert ratios["vs_llama_cpp_100"] == 0.25 and ratios["ttft_vs_llama_cpp_100"] == 0.2  # q4e_q8's stay ours'
    assert llama_cpp_ratios({"q4e_q8": {10: ours[25]}}, rows) == {}  # no llama.cpp row at that budget: no ratio


def test_same_limit_ratios_put_our_ram_auto_rows_over_llama_cpps_best_cold_row_of_the_matched_file():
    """Our `--ram auto` rows in a budget's memory limit: each over the best cold row of the llama.cpp file it is
    matched to, at the same budget; the report shows the slots auto chose."""
    from colibri_stream.bench.contenders import OurConfig
    from colibri_stream.bench.suite import INT4_MATCHED, INT8_MATCHED

    rows = [_row("q4e_q8", 25, 0.5, 4.0), _row("q4e_q8", 25, 0.4, 3.0), _row("q4e_q8", 25, 9.0, 1.0, cold=False)]
    rows += [_row("q4_0", 25, 0.6, 4.0), _row("q4e_q8", 100, 10.0, 1.0)]
    ours = []
    for container, tok_s in ((INT8_MATCHED, 6.0), (INT4_MATCHED, 6.6)):
        config = OurConfig(25, container=container, activations="int8", auto_ram=True)
        assert "ram-auto" in config.name
        ours.append({"name": config.name, "container": container, "budget_pct": 25, "decode_tok_per_s": tok_s})
        ours[-1] |= {"ram_slots": 410, "hit_rate": 0.84, "bytes_per_token": 2.3e8, "peak_group_bytes": 2.7e9}
    assert same_limit_ratios(ours, rows) == {
        "vs_llama_cpp_same_limit_25": 12.0,
        "vs_llama_cpp_q4_0_same_limit_25": 11.0,
    }
    assert same_limit_ratios(ours, rows[-1:]) == {}  # no llama.cpp row at the budget: no ratio
    lines = llama_cpp_lines({"llama_cpp": {"files": {}, "rows": [], "ours_same_limit": ours, "threads": 2}})
    assert any("| 410 |" in line and "6.00" in line for line in lines)


def test_warm_ttft_ratios_take_llama_cpps_lowest_warm_ttft_of_each_file_at_100():
    """The issue's TTFT measure: warm for both (cold, llama.cpp's first token pays faulting its file in)."""
    rows = [
        _row("q4e_q8", 100, 20.0, 0.3, repack=True),  # cold: not counted
        _row("q4e_q8", 100, 20.0, 0.6, cold=False),
        _row("q4e_q8", 100, 20.0, 0.45, cold=False, repack=True),  # the lowest warm one
        _row("q4e_q8", 25, 1.0, 0.1, cold=False),  # another budget: not counted
        _row("q4_0", 100, 25.0, 0.36, cold=False),
    ]
    ours_int8, ours_int4 = {"ttft_s": 0.3}, {"ttft_s": 0.4}
    assert warm_ttft_ratios({"q4e_q8": ours_int8, "q4_0": ours_int4}, rows) == {
        "ttft_warm_vs_llama_cpp_100": 1.5,
        "ttft_warm_vs_llama_cpp_q4_0_100": 0.9,
    }
    assert warm_ttft_ratios({"q4e_q8": ours_int8}, rows)["ttft_warm_vs_llama_cpp_q4_0_100"] == 1.2  # int8 stands in
    assert warm_ttft_ratios({}, rows) == {} and warm_ttft_ratios({"q4e_q8": ours_int8}, rows[:1]) == {}


def test_prefill_ratios_take_warm_rows_at_100_and_cold_rows_below():
    def row(file: str, pct: int, ttft: float, cold: bool) -> dict:
        decode = 40.0 / ttft if ttft else 0.0  # the decode after the prompt: faster where its TTFT was
        return {
            "file": file, "budget_pct": pct, "ttft_s": ttft, "decode_tok_per_s": decode, "cold": cold,
            "name": f"{file} {pct}",
        }  # fmt: skip

    ours = [row("", 100, 9.0, True), row("", 100, 4.0, False), row("", 25, 5.0, True), row("", 25, 1.0, False)]
    theirs = [
        row("q4_0", 100, 2.0, True),  # cold at 100%: the file faulted in during the prompt, not counted
        row("q4_0", 100, 6.0, False),
        row("q4_0", 100, 5.0, False),  # the best warm mode (repacked) counts
        row("q4_0", 25, 10.0, True),
        row("q4_0", 25, 0.5, False),  # warm below 100% is not what a limited machine sees
        row("q4e_q8", 25, 0.0, True),  # a failed row (no first token) never counts
    ]
    assert prefill_ratios(ours, theirs, {"q4_0": "llama_cpp_q4_0", "q4e_q8": "llama_cpp"}) == {
        "prefill_vs_llama_cpp_q4_0_100": 1.25,  # 5.0 / 4.0: above 1, ours is faster
        "prefill_vs_llama_cpp_q4_0_25": 2.0,
    }
    # the decode after the prompt, the same rows counted: at 100% ours warm 10 tok/s over their best warm 8
    # (not the cold 20); at 25% ours cold 8 over their cold 4 (not the warm 80)
    assert long_decode_ratios(ours, theirs, {"q4_0": "llama_cpp_q4_0", "q4e_q8": "llama_cpp"}) == {
        "long_decode_vs_llama_cpp_q4_0_100": 1.25,
        "long_decode_vs_llama_cpp_q4_0_25": 2.0,
    }
    rows = [as_prefill_row(r, 1024) for r in ours[:2]]
    report = "\n".join(prefill_lines({"ours": rows, "rows": []}))
    assert "1024-token prompt" in report and "| 4.00 | 256.0 | 10.00 |" in report  # 1024 tokens / 4.0 s


def test_alternated_rounds_run_ours_then_theirs_and_the_ratio_is_of_the_medians():
    order: list[str] = []

    def contender(who: str, rates: list[float]):
        def run() -> dict:
            order.append(who)
            return {"contender": who, "name": f"{who} 100% warm", "decode_tok_per_s": rates.pop(0), "ttft_s": 0.1}

        return run

    # llama.cpp's second q4e_q8 round is a slow minute (10): the medians leave it out, a single pair would not
    rows = alternated_rows("q4e_q8", 3, contender("colibri-stream", [48, 40, 44]), contender("llama.cpp", [40, 10, 36]))
    rows += alternated_rows("q4_0", 1, contender("colibri-stream", [50]), contender("llama.cpp", [40]))
    assert order == ["colibri-stream", "llama.cpp"] * 4
    assert [(r["pair"], r["round"]) for r in rows[:2]] == [("q4e_q8", 1), ("q4e_q8", 1)]
    assert rows[3]["name"] == "round 2: llama.cpp 100% warm" and rows[3]["decode_tok_per_s"] == 10
    assert alternated_ratios(rows) == {
        "vs_llama_cpp_alternated_100": 1.22,  # median 44 over median 36
        "vs_llama_cpp_q4_0_alternated_100": 1.25,
    }
    assert alternated_ratios(rows[:6:2]) == {}  # ours alone: no ratio
    report = "\n".join(alternated_lines(rows))
    assert "| round 2: llama.cpp 100% warm | q4e_q8 | 10.00 | 0.100 |" in report
    assert alternated_lines([]) == []


def test_the_alternated_rounds_take_llama_cpps_fastest_warm_mode_that_ran():
    rows = [
        _row("q4e_q8", 100, 30.0, 0.5, cold=False),
        _row("q4e_q8", 100, 40.0, 0.5, cold=False, repack=True),
        _row("q4e_q8", 100, 90.0, 0.5, cold=True, repack=False),  # cold rows do not choose
        _row("q4_0", 100, 25.0, 0.5, cold=False),  # its repacked mode aborted on this host: no row
        _row("q4_0", 25, 50.0, 0.5, cold=False, repack=True),  # another budget
    ]
    assert fastest_warm_mode(rows, "q4e_q8", 100) is True
    assert fastest_warm_mode(rows, "q4_0", 100) is False
    assert fastest_warm_mode(rows[:3], "q4_0", 100) is None


def test_a_prefill_mode_that_aborts_keeps_the_other_modes_rows():
    def run(repack: bool, cold: bool) -> dict:
        if repack:  # llama.cpp's repacked mode aborts on some hosts (a backend assertion)
            raise ContenderFailed("exited -6: GGML_ASSERT(*cur_backend_id != -1) failed")
        return _row("q4e_q8", 100, 20.0, 2.0 if cold else 1.5, cold=cold)

    failed: list[dict] = []
    rows = llama_cpp_prefill_rows(100, 1024, run, "prefill 1024 llama.cpp q4e_q8 100%", failed)
    assert [(r["repack"], r["cold"], r["ttft_s"]) for r in rows] == [(False, True, 2.0), (False, False, 1.5)]
    assert [f["name"] for f in failed] == ["prefill 1024 llama.cpp q4e_q8 100% repacked"]
    assert "GGML_ASSERT" in failed[0]["error"]
    assert prefill_ratios([_row("", 100, 0.0, 1.0, cold=False)], rows, {"q4e_q8": "llama_cpp"}) == {
        "prefill_vs_llama_cpp_100": 1.5  # the memory-mapped warm row counts
    }


def test_the_grid_repacks_only_where_everything_fits_and_runs_warm_after_cold():
    assert llama_cpp_grid((25, 100)) == [
        (25, False, True),
        (25, False, False),
        (100, False, True),
        (100, False, False),
        (100, True, True),
        (100, True, False),
    ]


def test_the_quality_matched_override_picks_exactly_the_routed_experts():
    import re

    names = [
        "blk.1.ffn_gate_exps.weight",
        "blk.1.ffn_up_exps.weight",
        "blk.1.ffn_down_exps.weight",
        "blk.1.ffn_gate_shexp.weight",
        "blk.1.ffn_down_shexp.weight",
        "blk.0.ffn_down.weight",
        "blk.1.ffn_gate_inp.weight",
        "blk.1.exp_probs_b.bias",
        "token_embd.weight",
        "output.weight",
    ]
    assert [n for n in names if re.search(llama_cpp.EXPERT_TENSOR, n)] == names[:3]


# ---------------------------------------------------------------------------------- load, machine
class FakeCompetitor:
    def __init__(self, events):
        self.events = events
        events.append("start")

    def kill(self):
        self.events.append("kill")

    def wait(self):
        self.events.append("wait")


def test_loaded_vs_idle_is_loaded_over_the_better_idle_run_with_the_competitor_only_around_the_loaded_one():
    events, rates = [], iter([4.0, 2.5, 5.0])

    def run():
        events.append("run")
        return {"decode_tok_per_s": next(rates), "ttft_s": 1.0, "ids": [1, 2]}

    out = loaded_vs_idle(run, lambda: FakeCompetitor(events), settle_s=0)
    assert events == ["run", "start", "run", "kill", "wait", "run"]
    assert out["loaded_vs_idle"] == 0.5 and out["idle_tok_per_s"] == [4.0, 5.0] and out["same_tokens"]


def test_the_competitor_is_killed_when_the_loaded_run_fails():
    events = []

    def run():
        if "start" in events:
            raise RuntimeError("contender failed")
        return {"decode_tok_per_s": 1.0, "ttft_s": 1.0, "ids": []}

    with pytest.raises(RuntimeError):
        loaded_vs_idle(run, lambda: FakeCompetitor(events), settle_s=0)
    assert events == ["start", "kill", "wait"]


def test_other_cpu_share_is_the_busy_time_the_contender_did_not_use(monkeypatch):
    monkeypatch.setattr(system.os, "sysconf", lambda name: 100)
    monkeypatch.setattr(system.os, "cpu_count", lambda: 2)
    before = [0, 0, 0, 0, 0, 0, 0, 0]
    after = [300, 0, 100, 150, 50, 0, 0, 0]  # 4 s busy of 6 s (idle 1.5 s, iowait 0.5 s)
    assert system.other_cpu_share(before, after, own_cpu_s=2.5, wall_s=3.0) == 0.25  # 1.5 s of 2 cores x 3 s
    assert system.other_cpu_share(before, after, own_cpu_s=9.0, wall_s=3.0) == 0.0
    assert system.other_cpu_share([], after, own_cpu_s=1.0, wall_s=3.0) is None


def test_steal_share_counts_only_steal_over_all_cpu_time():
    before = [100, 0, 50, 800, 10, 0, 0, 40, 0, 0]
    after = [200, 0, 100, 1600, 10, 0, 0, 90, 7, 0]  # +1000 ticks, 50 of them stolen; guest is inside user
    assert steal_share(before, after) == 0.05
    assert steal_share([], after) is None


# ------------------------------------------------------------------------------- setup and skips
def test_machine_facts_name_the_hosts_simd_extensions():
    x86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni amx_int8 avx512vbmi\nflags : avx\n"
    assert system.isa_of(x86) == ["avx2", "fma", "avx512f", "avx512_vnni", "amx_int8"]  # the first line only
    assert system.isa_of("Features\t: fp asimd asimddp i8mm\n") == ["asimd", "asimddp", "i8mm"]  # aarch64
    assert system.isa_of("model name : a CPU\n") == []
    machine = {"cpu": "c", "cores": 2, "ram_bytes": 2**30, "filesystem": "f", "kernel": "k", "python": "3"}
    machine |= {"torch": "2", "torch_threads": 2}
    assert "ISA" not in machine_lines(machine)[0]  # an older run's results
    assert machine_lines(machine | {"isa": ["avx2", "fma"]})[0].endswith(" ISA: avx2, fma.")
    capped = machine | {"isa": ["avx2", "avx512f"], "kernels": "AVX2 (capped by COLIBRI_STREAM_ISA=avx2)"}
    assert machine_lines(capped)[0].endswith(
        " ISA: avx2, avx512f. Our kernels: AVX2 (capped by COLIBRI_STREAM_ISA=avx2)."
    )


def test_skip_reason_says_what_to_run(tmp_path, monkeypatch):
    # the extra's modules as this machine may or may not have them: llama_cpp absent, gguf present
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llama_cpp" else object())
    reason = llama_cpp.skip_reason(tmp_path)
    assert "llama_cpp not installed" in reason and "pip install 'colibri-stream[peers]'" in reason
    assert llama_cpp_lines({"llama_cpp": {"skipped": reason}}) == [reason]  # the report's one line

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    reason = llama_cpp.skip_reason(tmp_path)
    assert str(tmp_path) in reason and "--setup-peers" in reason and "\n" not in reason
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    assert llama_cpp.skip_reason(tmp_path) is None


def _tar(path, members: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_setup_extracts_only_the_converter_its_package_and_its_gguf_py(tmp_path):
    root = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
    members = {
        root + "convert_hf_to_gguf.py": b"# converter",
        root + "conversion/deepseek.py": b"# arch",
        root + "gguf-py/gguf/gguf_writer.py": b"# writer",
        root + "LICENSE": b"MIT",
        root + "src/llama.cpp": b"// not needed",
        root + "conversion/../../../escape.py": b"# refused",
        "llama_cpp_python-0.3.36/setup.py": b"",
    }
    _tar(tmp_path / "sdist.tar.gz", members)
    dest = tmp_path / "peers"
    assert llama_cpp.extract_converter(tmp_path / "sdist.tar.gz", dest) == 4
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert files == [
        "LICENSE",
        "SOURCE",
        "conversion/deepseek.py",
        "convert_hf_to_gguf.py",
        "gguf-py/gguf/gguf_writer.py",
    ]

    # the same through the CLI, into another folder
    argv = ["bench", "--setup-peers", str(tmp_path / "sdist.tar.gz"), "--llama-cpp-dir", str(tmp_path / "cli")]
    assert cli.main(argv) == 0 and (tmp_path / "cli" / "conversion" / "deepseek.py").read_bytes() == b"# arch"

    _tar(tmp_path / "other.tar.gz", {"x/setup.py": b""})
    with pytest.raises(llama_cpp.PeerSetupError, match="other.tar.gz.*convert_hf_to_gguf.py"):
        llama_cpp.extract_converter(tmp_path / "other.tar.gz", tmp_path / "peers2")


def test_the_generated_tokenizer_is_deterministic_and_fits_the_vocabulary(tmp_path):
    from tokenizers import Tokenizer

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        llama_cpp.write_byte_tokenizer(tmp_path / folder, vocab_size=300, bos_id=0, eos_id=1)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    tokenizer = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    assert vocab["<|bos|>"] == 0 and vocab["<|eos|>"] == 1 and max(vocab.values()) < 300 and len(vocab) == 260
    assert tokenizer.decode(tokenizer.encode("the cat").ids) == "the cat"
    with pytest.raises(llama_cpp.PeerSetupError, match="cannot hold"):
        llama_cpp.write_byte_tokenizer(tmp_path / "a", vocab_size=100, bos_id=0, eos_id=1)


@pytest.mark.parametrize("sections", ["decode,nope", "caching,load", ""])
def test_bench_refuses_unknown_or_incomplete_sections(sections, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--quick", "--sections", sections])
    assert exit_info.value.code == 2 and "--sections" in capsys.readouterr().err


# --------------------------------------------------------------------------------- end to end
# resolved at collection, before the session's private user cache (conftest) hides the developer's converter
LLAMA_CPP_DIR = llama_cpp.default_llama_cpp_dir()


def _peers_ready() -> bool:
    return llama_cpp.skip_reason(LLAMA_CPP_DIR) is None


@pytest.mark.slow  # ~20 s: the converter's own process imports torch and transformers
@pytest.mark.skipif(not _peers_ready(), reason="needs the peers extra and `colibri-stream bench --setup-peers`")
def test_llama_cpp_converts_quantizes_and_decodes_the_stress_model(tmp_path):
    from colibri_stream.bench.llama_cpp_section import gguf_facts
    from colibri_stream.bench.stress_model import QUICK, write_stress_checkpoint

    hf = write_stress_checkpoint(tmp_path / "hf", QUICK, progress=False)
    files = llama_cpp.prepare_gguf_files(hf, tmp_path, LLAMA_CPP_DIR, 2, lambda _: None, False)
    assert sorted(p.name for p in files["q4e_q8"].parent.iterdir()) == ["q4_0.gguf", "q4e_q8.gguf"]  # no leftovers
    matched = gguf_facts(files["q4e_q8"], context=8)
    moe_layers = QUICK.num_hidden_layers - QUICK.first_k_dense_replace
    assert matched["tensor_types"]["Q4_0"] == 3 * moe_layers  # exactly the experts' gate/up/down
    assert set(matched["tensor_types"]) == {"Q4_0", "Q8_0", "F32"}
    assert gguf_facts(files["q4_0"], context=8)["tensor_types"]["Q4_0"] > 3 * moe_layers

    argv = [sys.executable, "-m", "colibri_stream.bench.llama_cpp_peer", str(files["q4e_q8"])]
    argv += ["--ids", "5,17,300,2", "--max-new-tokens", "4", "--threads", "1", "--cold"]
    out = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    assert len(out["ids"]) == 4 and all(0 <= i < QUICK.vocab_size for i in out["ids"])
    assert out["decode_tokens"] == 3 and out["omp_wait_policy"] == "(OpenMP default)" and not out["repack"]


def test_the_headline_ratios_are_ours_quality_matched_and_the_exact_path_is_reported_beside():
    """vs_llama_cpp_* compare llama.cpp's Q4_0 + Q8_0 file with ours computed the same way (int4 experts, int8
    dense, int8 activations: the llama.cpp section's cold rows); exact_* with our default float path."""
    from colibri_stream.bench.contenders import OurConfig
    from colibri_stream.bench.suite import INT4_MATCHED, INT8_MATCHED, Bench

    def ours(config, tok_s, ttft):
        return {
            "name": config.name,
            "container": config.container,
            "budget_pct": config.budget_pct,
            "cold": config.cold,
            "decode_tok_per_s": tok_s,
            "ttft_s": ttft,
        }

    bench = Bench.__new__(Bench)
    matched = [OurConfig(100, container=INT8_MATCHED, activations="int8", cold=c) for c in (True, False)]
    int4_dense = [OurConfig(100, container=INT4_MATCHED, activations="int8", cold=c) for c in (True, False)]
    bench.results = {
        "decode": [ours(OurConfig(100), 5.0, 4.0), ours(OurConfig(100, cold=False), 50.0, 0.1)],
        "llama_cpp": {
            "rows": [_row("q4e_q8", 100, 10.0, 0.8), _row("q4_0", 100, 20.0, 0.5)],
            "ours_matched": [ours(matched[0], 12.0, 0.4), ours(matched[1], 99.0, 0.01)]  # warm never counts
            + [ours(int4_dense[0], 16.0, 0.3), ours(int4_dense[1], 90.0, 0.01)],
            "prefill": {
                "ours": [ours(matched[1], 0.0, 8.0)],
                "rows": [_row("q4_0", 100, 0.0, 10.0, cold=False, repack=True)],
            },
        },
    }
    assert bench.ratios() == {
        "vs_llama_cpp_100": 1.2,
        "vs_llama_cpp_fastest_100": 1.2,  # llama.cpp's rows here are all cold
        "vs_llama_cpp_q4_0_100": 0.8,  # all-Q4_0 against ours with int4 dense records
        "vs_llama_cpp_q4_0_fastest_100": 0.8,
        "ttft_vs_llama_cpp_100": 2.0,
        "exact_vs_llama_cpp_100": 0.5,
        "exact_vs_llama_cpp_fastest_100": 0.5,
        "exact_vs_llama_cpp_q4_0_100": 0.25,
        "exact_vs_llama_cpp_q4_0_fastest_100": 0.25,
        "exact_ttft_vs_llama_cpp_100": 0.2,
        "exact_vs_int8_100": 0.42,  # the exact path's 5 tok/s over the int8 path's 12 (cold rows)
        "prefill_vs_llama_cpp_q4_0_100": 1.25,  # a 1024-token prompt, both warm: llama.cpp 10 s, ours 8 s
    }


def test_a_cold_run_keeps_its_memory_group_for_the_warm_run_and_each_run_counts_its_own_peak(tmp_path, monkeypatch):
    """Removing a group hands its cached pages to the parent, uncharged: a warm row in a new group would read
    them beyond its limit. So a kept group serves the next run, whose peak and limit hits start from zero."""
    removed = []
    monkeypatch.setattr(system, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(system, "_remove_group", removed.append)
    limit = system.MemoryLimit(1 << 30)
    limit.enforced = True
    group = tmp_path / limit.name
    group.mkdir()
    (group / "memory.max_usage_in_bytes").write_text("123456")  # what the cold run's own peak left behind
    done = limit.run([sys.executable, "-c", "print('{}')"], 30, keep=True)
    assert done.returncode == 0 and done.peak_bytes == 0 and not done.hit_limit
    assert removed == [] and (group / "memory.limit_in_bytes").read_text() == str(1 << 30)
    limit.run([sys.executable, "-c", "print('{}')"], 30)
    assert removed == [group]


ABORTED_STDERR = """load_tensors: CPU_REPACK model buffer size =  3920.00 MiB
/tmp/vendor/llama.cpp/ggml/src/ggml-backend.cpp:1294: GGML_ASSERT(*cur_backend_id != -1) failed
[New LWP 11266]
#41 0x00007f9f84e45305 in __libc_start_main_impl (main=0x557a0f7f2050 <main>) at ../csu/libc-start.c:360
360\t../csu/libc-start.c: No such file or directory.
[Inferior 1 (process 11157) detached]
"""


def _failed_run(returncode: int, stderr: str, hit_limit: bool) -> str:
    run = ProcessRun(["python", "-m", "peer", "f.gguf", "--repack"], returncode, "", stderr, 1.0, 1 << 30, hit_limit)
    with pytest.raises(ContenderFailed) as failed:
        run.last_json_line()
    return str(failed.value)


def test_an_abort_in_a_group_that_reclaimed_is_reported_as_the_abort_not_as_the_limit():
    message = _failed_run(-signal.SIGABRT, ABORTED_STDERR, hit_limit=True)
    assert "GGML_ASSERT(*cur_backend_id != -1) failed" in message
    assert "killed at its memory limit" not in message and "pages reclaimed" in message
    assert "libc-start" not in message


def test_a_sigkill_at_the_limit_is_the_limits_doing_and_a_traceback_gives_its_last_error():
    assert "killed at its memory limit" in _failed_run(-signal.SIGKILL, "", hit_limit=True)
    traceback = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: no such file\nbye\n'
    message = _failed_run(1, traceback, hit_limit=False)
    assert message.endswith("ValueError: no such file") and "memory limit" not in message


def test_the_race_runs_ours_matched_cold_then_warm_and_ram_auto_only_below_100(monkeypatch, tmp_path):
    """LlamaCppRace's own rows: each matched container cold then warm at every budget, and below 100% once more
    with `--ram auto`, each in its budget's limit with its container's path."""
    from colibri_stream.bench import llama_cpp_race
    from colibri_stream.bench.llama_cpp_race import INT4_MATCHED, INT8_MATCHED, LlamaCppRace

    class Host:
        log = staticmethod(lambda line: None)

        def ram_bytes(self, pct):
            return pct

        def limit(self, pct):
            return f"limit {pct}"

        def inputs(self):
            return "inputs"

    ran = []
    monkeypatch.setattr(
        llama_cpp_race, "run_ours", lambda path, config, ram, inputs, limit: ran.append((path.name, config, ram, limit))
    )
    race = LlamaCppRace(Host())  # type: ignore[arg-type]
    race.matched = {INT8_MATCHED: tmp_path / INT8_MATCHED, INT4_MATCHED: tmp_path / INT4_MATCHED}
    race._matched_rows(25)
    assert race._same_limit_rows(100) == [] and len(ran) == 4
    race._same_limit_rows(25)
    got = [(path, c.container, c.cold, c.auto_ram, ram, limit) for path, c, ram, limit in ran]
    assert got == [
        (INT8_MATCHED, INT8_MATCHED, True, False, 25, "limit 25"),
        (INT8_MATCHED, INT8_MATCHED, False, False, 25, "limit 25"),
        (INT4_MATCHED, INT4_MATCHED, True, False, 25, "limit 25"),
        (INT4_MATCHED, INT4_MATCHED, False, False, 25, "limit 25"),
        (INT8_MATCHED, INT8_MATCHED, True, True, 25, "limit 25"),
        (INT4_MATCHED, INT4_MATCHED, True, True, 25, "limit 25"),
    ]
