"""The llama.cpp section of the bench: both GGUF files at each budget, cold and warm, in the same limit as
ours, and the ratios against our decode rows.

Rows per file and budget: memory-mapped (the page cache as its expert cache), page cache dropped
(cold) then at once again (warm); at 100% also with weight repacking (llama.cpp's default, which copies
the repacked weights into anonymous memory, so below 100% it cannot fit the limit by construction).
The ratios take llama.cpp's best row of the quality-matched file at the budget, both cold: its highest
decode tok/s and, separately, its lowest TTFT.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from colibri_stream.bench.alternated_rows import alternated_ratios
from colibri_stream.bench.contenders import RunInputs
from colibri_stream.bench.limit_line import TouchedBytes, gguf_touched, llama_cpp_kv_bytes
from colibri_stream.bench.llama_cpp import MATCHED_CONTAINERS
from colibri_stream.bench.prefill_rows import prefill_section_ratios
from colibri_stream.bench.system import MemoryLimit, children_cpu_s, cpu_times, drop_page_cache, other_cpu_share

REPACK_BUDGET = 100  # repacked weights are anonymous memory: only the all-in-RAM budget can hold them


def llama_cpp_grid(budgets_pct: tuple[int, ...]) -> list[tuple[int, bool, bool]]:
    """(budget %, repack, cold) in the order they run: each warm row right after its cold one."""
    grid = []
    for pct in budgets_pct:
        for repack in (False, True) if pct >= REPACK_BUDGET else (False,):
            grid += [(pct, repack, True), (pct, repack, False)]
    return grid


def run_llama_cpp_contender(
    gguf: Path,
    kind: str,
    budget_pct: int,
    repack: bool,
    cold: bool,
    inputs: RunInputs,
    limit: MemoryLimit,
    threads: int,
) -> dict:
    dropped = drop_page_cache() if cold else False
    argv = [sys.executable, "-m", "colibri_stream.bench.llama_cpp_peer", str(gguf)]
    argv += ["--ids", ",".join(map(str, inputs.ids)), "--max-new-tokens", str(inputs.new_tokens)]
    argv += ["--threads", str(threads)] + (["--repack"] if repack else []) + (["--cold"] if cold else [])
    cpu_before, own_before = cpu_times(), children_cpu_s()
    done = limit.run(argv, inputs.timeout_s, keep=cold)  # the warm row that follows runs in the same group
    others = other_cpu_share(cpu_before, cpu_times(), children_cpu_s() - own_before, done.wall_s)
    out = json.loads(done.last_json_line())
    mode = "repacked" if repack else "mmap"
    return {
        "contender": "llama.cpp",
        "name": f"llama.cpp {kind} {budget_pct}% {mode} {'cold' if cold else 'warm'}",
        "file": kind,
        "budget_pct": budget_pct,
        "repack": repack,
        "cold": cold,
        "threads": threads,
        "ids": out["ids"],
        "load_s": round(out["load_s"], 3),
        "ttft_s": round(out["ttft_s"], 6),
        "decode_tok_per_s": round(out["decode_tok_per_s"], 4),
        "disk_bytes_per_token": int(out["read_bytes_per_token"]),
        "prefill_read_bytes": out["prefill_read_bytes"],
        "peak_rss_bytes": out["peak_rss_bytes"],
        "peak_anon_bytes": out["peak_anon_bytes"],
        "omp_wait_policy": out["omp_wait_policy"],
        "peak_group_bytes": done.peak_bytes,
        "hit_memory_limit": done.hit_limit,
        "page_cache_dropped": dropped,
        "wall_s": round(done.wall_s, 2),
        # llama.cpp's OpenMP threads spin by default: another busy process on the machine slows it a lot
        "other_cpu_share": others,
    }


def gguf_facts(path: Path, context: int) -> dict:
    """What the report says about one file: size, tensor types, bytes a decode step touches."""
    from gguf import GGUFReader  # the peers extra

    reader = GGUFReader(path)

    def field(key: str):
        return reader.fields[key].contents()

    arch = field("general.architecture")
    tensors = [(t.name, int(t.n_bytes)) for t in reader.tensors]
    layers, rank = field(f"{arch}.block_count"), field(f"{arch}.attention.kv_lora_rank")
    kv = llama_cpp_kv_bytes(layers, rank, field(f"{arch}.rope.dimension_count"), context)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    touched = gguf_touched(tensors, field(f"{arch}.expert_count"), field(f"{arch}.expert_used_count"), n_vocab, kv)
    return {
        "file_bytes": path.stat().st_size,
        "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
        "touched_per_token": touched.as_dict(),
    }


def touched_from_facts(facts: dict) -> TouchedBytes:
    t = facts["touched_per_token"]
    return TouchedBytes(t["dense"], t["experts"], t["kv"])


def rows_of(rows: list[dict], kind: str, budget_pct: int) -> list[dict]:
    """llama.cpp's rows of file ``kind`` at the budget, cold and warm."""
    return [r for r in rows if r["file"] == kind and r["budget_pct"] == budget_pct]


def best_row(rows: list[dict], kind: str, budget_pct: int) -> dict | None:
    """llama.cpp's fastest cold decode and lowest cold TTFT for ``kind`` at the budget (None if no row)."""
    chosen = [r for r in rows_of(rows, kind, budget_pct) if r["cold"]]
    if not chosen:
        return None
    fastest = max(chosen, key=lambda r: r["decode_tok_per_s"])
    return {
        "decode_tok_per_s": fastest["decode_tok_per_s"],
        "decode_row": fastest["name"],
        "ttft_s": min(r["ttft_s"] for r in chosen),
    }


def fastest_decode(rows: list[dict], kind: str, budget_pct: int) -> float:
    """llama.cpp's fastest decode of ``kind`` at the budget, cold or warm (0.0 without a row): its best row
    whatever the page cache held before it. A cold row can be slowed by more than a cold page cache: under
    the 100% limit the repacked mode's copy of the weights beside the mapped file can push the file's pages
    out, and the row reads from disk while it decodes."""
    return max((r["decode_tok_per_s"] for r in rows_of(rows, kind, budget_pct)), default=0.0)


def fastest_warm_mode(rows: list[dict], kind: str, budget_pct: int) -> bool | None:
    """Whether llama.cpp's fastest warm row of ``kind`` at the budget ran repacked (None: no warm row ran). On
    some hosts the repacked mode aborts (a backend assertion) and memory-mapped is its best."""
    warm = [r for r in rows_of(rows, kind, budget_pct) if not r["cold"]]
    return bool(max(warm, key=lambda r: r["decode_tok_per_s"])["repack"]) if warm else None


def llama_cpp_ratios(ours_by_file: dict[str, dict[int, dict]], rows: list[dict]) -> dict:
    """Ours (cold, the default policy, prefetch) over llama.cpp's best cold row per budget, each file against
    our row for it (``ours_by_file``: file kind -> budget -> row; a kind without rows of its own takes
    q4e_q8's), and at 100% (``*_fastest_100``) over llama.cpp's fastest row, cold or warm; TTFT: llama.cpp's
    q4e_q8 / ours."""
    ratios = {}
    for kind, prefix in (("q4e_q8", "vs_llama_cpp"), ("q4_0", "vs_llama_cpp_q4_0")):
        for pct, ours in (ours_by_file.get(kind) or ours_by_file.get("q4e_q8", {})).items():
            best = best_row(rows, kind, pct)
            if best and best["decode_tok_per_s"] > 0:
                ratios[f"{prefix}_{pct}"] = round(ours["decode_tok_per_s"] / best["decode_tok_per_s"], 2)
            if pct == 100 and (fastest := fastest_decode(rows, kind, pct)) > 0:
                ratios[f"{prefix}_fastest_100"] = round(ours["decode_tok_per_s"] / fastest, 2)
    matched_100 = ours_by_file.get("q4e_q8", {}).get(100)
    best = best_row(rows, "q4e_q8", 100)
    if matched_100 and best and matched_100["ttft_s"] > 0:
        ratios["ttft_vs_llama_cpp_100"] = round(best["ttft_s"] / matched_100["ttft_s"], 2)
    return ratios


def warm_ttft_ratios(ours_warm: dict[str, dict], rows: list[dict]) -> dict:
    """The short prompt's TTFT at 100% with the page cache warm for both (issue #45's measure: cold,
    llama.cpp's first token pays faulting its file in): llama.cpp's lowest warm TTFT of each file over our
    warm row matched to that file (``ours_warm``: file kind -> row; a kind without one takes q4e_q8's)."""
    ratios = {}
    for kind, name in (("q4e_q8", "ttft_warm_vs_llama_cpp_100"), ("q4_0", "ttft_warm_vs_llama_cpp_q4_0_100")):
        ours = ours_warm.get(kind) or ours_warm.get("q4e_q8")
        theirs = [r["ttft_s"] for r in rows_of(rows, kind, 100) if not r["cold"]]
        if ours and theirs and ours["ttft_s"] > 0:
            ratios[name] = round(min(theirs) / ours["ttft_s"], 2)
    return ratios


def matched_container(row: dict) -> str:
    """The container a row of ours ran (rows of older results lack the key: the int8-dense one)."""
    return str(row.get("container", MATCHED_CONTAINERS["q4e_q8"]))


def section_ratios(section: dict, ours_exact: dict[int, dict]) -> dict:
    """Every ratio of a finished section (results.json's "llama_cpp"): decode and TTFT of our quality-matched
    rows (cold; the short prompt's TTFT warm too), ``exact_*`` of our default float path (``ours_exact``:
    budget -> section 2's row), against llama.cpp and against our int8 path, the prefill rows' and the
    alternated rounds' (``vs_*_alternated_100``)."""
    matched, rows = section["ours_matched"], section["rows"]
    by_file = {
        file: cold
        for file, container in MATCHED_CONTAINERS.items()
        if (cold := {r["budget_pct"]: r for r in matched if r["cold"] and matched_container(r) == container})
    }
    warm = {
        file: row
        for file, container in MATCHED_CONTAINERS.items()
        for row in matched
        if not row["cold"] and row["budget_pct"] == 100 and matched_container(row) == container
    }
    exact = llama_cpp_ratios({"q4e_q8": ours_exact}, rows)
    prefill = section["prefill"]
    return (
        llama_cpp_ratios(by_file, rows)
        | warm_ttft_ratios(warm, rows)
        | {f"exact_{k}": v for k, v in exact.items()}
        | exact_over_int8(ours_exact, by_file.get("q4e_q8", {}))
        | prefill_section_ratios(prefill["ours"], prefill["rows"])
        | alternated_ratios(section.get("alternated", []))  # results of older runs lack them
        | same_limit_ratios(section.get("ours_same_limit", []), rows)
    )


def same_limit_ratios(same_limit: list[dict], rows: list[dict]) -> dict[str, float]:
    """``vs_llama_cpp[_q4_0]_same_limit_<pct>``: ours with `--ram auto` in the budget's memory limit
    (LlamaCppRace._same_limit_rows) over llama.cpp's best cold row of the file it is matched to."""
    ratios = {}
    for kind, prefix in (("q4e_q8", "vs_llama_cpp"), ("q4_0", "vs_llama_cpp_q4_0")):
        for ours in same_limit:
            best = best_row(rows, kind, ours["budget_pct"])
            if matched_container(ours) == MATCHED_CONTAINERS[kind] and best and best["decode_tok_per_s"] > 0:
                ratios[f"{prefix}_same_limit_{ours['budget_pct']}"] = round(
                    ours["decode_tok_per_s"] / best["decode_tok_per_s"], 2
                )
    return ratios


def exact_over_int8(exact: dict[int, dict], int8: dict[int, dict]) -> dict[str, float]:
    """``exact_vs_int8_<pct>``: our default float path's decode tok/s over the int8 path's (the quality-matched
    rows), cold, per budget both ran (issue #45 asks >= 0.5 at 100%)."""
    return {
        f"exact_vs_int8_{pct}": round(row["decode_tok_per_s"] / int8[pct]["decode_tok_per_s"], 2)
        for pct, row in sorted(exact.items())
        if pct in int8 and int8[pct]["decode_tok_per_s"] > 0
    }
