"""The prefill rows of the llama.cpp section: the time to the first token of a long prompt, ours (the int8
path, as llama.cpp computes) beside each llama.cpp file, at each budget of the section; and the tokens after
it, decoded with the long prompt in the cache (what an agent's preamble costs every token).

At 100% both run warm (the page cache as the run just before left it: what a user who keeps chatting sees;
cold, llama.cpp would fault its file in during the prompt) and llama.cpp's best mode counts (mmap or
repacked); below 100% both run cold, under the section's memory limit, llama.cpp memory-mapped (its
repacked copy cannot fit there). Ratios are llama.cpp's TTFT over ours: above 1, ours is faster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from colibri_stream.bench.system import ContenderFailed

FULL_BUDGET = 100
PREFILL_NEW_TOKENS = 32  # the first token is the prefill's; the others decode at the prompt's context
RATIO_PREFIXES = {"q4e_q8": "llama_cpp", "q4_0": "llama_cpp_q4_0"}  # llama.cpp file kind -> ratio name


def counts(pct: int, cold: bool) -> bool:
    """Whether a row at ``pct`` with this page cache enters the ratio: warm at 100%, cold below."""
    return cold != (pct >= FULL_BUDGET)


def _side_by_side(
    ours: list[dict], llama_cpp: list[dict], kinds: dict[str, str], key: str
) -> Iterator[tuple[int, str, list[float], list[float]]]:
    """(pct, ratio prefix, our values of ``key``, llama.cpp's of that kind) per budget, rows that count only
    (a llama.cpp row without a first token never does)."""
    for pct in sorted({r["budget_pct"] for r in ours}, reverse=True):
        mine = [r[key] for r in ours if r["budget_pct"] == pct and counts(pct, r["cold"])]
        for kind, prefix in kinds.items():
            theirs = [
                r[key]
                for r in llama_cpp
                if r["file"] == kind and r["budget_pct"] == pct and counts(pct, r["cold"]) and r["ttft_s"] > 0
            ]
            if mine and theirs:
                yield pct, prefix, mine, theirs


def prefill_ratios(ours: list[dict], llama_cpp: list[dict], kinds: dict[str, str]) -> dict[str, float]:
    """prefill_vs_<prefix>_<pct>: llama.cpp's lowest TTFT of ``kind`` over ours, rows that count only.
    ``kinds``: file kind -> ratio prefix (e.g. q4_0 -> llama_cpp_q4_0)."""
    return {
        f"prefill_vs_{prefix}_{pct}": round(min(theirs) / min(mine), 2)
        for pct, prefix, mine, theirs in _side_by_side(ours, llama_cpp, kinds, "ttft_s")
        if min(mine) > 0
    }


def long_decode_ratios(ours: list[dict], llama_cpp: list[dict], kinds: dict[str, str]) -> dict[str, float]:
    """long_decode_vs_<prefix>_<pct>: our best decode tok/s after the long prompt over llama.cpp's best of
    ``kind``, the rows ``prefill_ratios`` counts (above 1, ours is faster)."""
    return {
        f"long_decode_vs_{prefix}_{pct}": round(max(mine) / max(theirs), 2)
        for pct, prefix, mine, theirs in _side_by_side(ours, llama_cpp, kinds, "decode_tok_per_s")
        if max(theirs) > 0
    }


def prefill_section_ratios(ours: list[dict], llama_cpp: list[dict]) -> dict[str, float]:
    """Both ratio kinds of the prefill rows against both llama.cpp files: ``prefill_vs_*``, ``long_decode_vs_*``."""
    return prefill_ratios(ours, llama_cpp, RATIO_PREFIXES) | long_decode_ratios(ours, llama_cpp, RATIO_PREFIXES)


def as_prefill_row(row: dict, prompt_tokens: int) -> dict:
    """A contender's row renamed as a prefill row, with its prompt length and prefill throughput."""
    ttft = row["ttft_s"]
    return row | {
        "name": f"prefill {prompt_tokens} {row['name']}",
        "prompt_tokens": prompt_tokens,
        "prefill_tok_per_s": round(prompt_tokens / ttft, 2) if ttft > 0 else 0.0,
    }


def our_prefill_rows(prompt_tokens: int, run: Callable[[bool], dict]) -> list[dict]:
    """Ours cold, then warm at once (``run(cold)`` runs one row)."""
    return [as_prefill_row(run(cold), prompt_tokens) for cold in (True, False)]


def llama_cpp_prefill_rows(
    pct: int, prompt_tokens: int, run: Callable[[bool, bool], dict], name: str, failed: list[dict]
) -> list[dict]:
    """One llama.cpp file's modes at ``pct``, each cold then warm (repacked too at 100%: ``run(repack, cold)``).
    A mode that fails goes into ``failed`` (``name`` and its mode) and the other mode's rows stay: on some
    hosts llama.cpp's repacked mode aborts, and memory-mapped is then its best."""
    rows = []
    for repack in (False, True) if pct >= FULL_BUDGET else (False,):
        try:
            rows += [as_prefill_row(run(repack, cold), prompt_tokens) for cold in (True, False)]
        except ContenderFailed as exc:  # e.g. killed at its memory limit: a result, not a crash
            failed.append({"name": f"{name} {'repacked' if repack else 'mmap'}", "error": str(exc)})
    return rows
