"""The llama.cpp section's 100% decode once more, in alternation: ours (the quality-matched container, warm)
then llama.cpp's fastest warm mode of the matching file in the section's rows (repacked where it runs),
round after round, and the ratio of their medians.

Why: on this kind of host one row's decode rate moves by up to 2x within minutes (the memory's speed
switches between regimes; docs/benchmarks-log.md, "Resident experts interleaved: the ceiling is the memory").
The section's grid runs our rows, then llama.cpp's, minutes apart, so its single-row ratios
(``vs_llama_cpp_100``) can rest on one contender's slow minutes. Here each round puts both in the same
minute, and the medians drop one slow round of either. Longer decodes than the grid's rows (``tokens``)
keep a row's rate from resting on a second of work.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from colibri_stream.bench.prefill_rows import RATIO_PREFIXES

ALTERNATED_BUDGET = 100  # where both hold every weight in RAM: the rows measure compute and memory, not disks


def alternated_rows(kind: str, rounds: int, ours: Callable[[], dict], theirs: Callable[[], dict]) -> list[dict]:
    """``rounds`` x (our row, llama.cpp's row of file ``kind``), in that order; each row tagged with the
    pair's file kind and its round (``ours()`` / ``theirs()`` run one row)."""
    rows = []
    for number in range(1, rounds + 1):
        for run in (ours, theirs):
            row = run()
            rows.append(row | {"pair": kind, "round": number, "name": f"round {number}: {row['name']}"})
    return rows


def alternated_ratios(rows: list[dict]) -> dict[str, float]:
    """``vs_<prefix>_alternated_100``: the median of our decode tok/s over the median of llama.cpp's, per
    file kind that has rows of both (above 1, ours is faster)."""
    ratios = {}
    for kind, prefix in RATIO_PREFIXES.items():
        pair = [r for r in rows if r["pair"] == kind]
        mine = [r["decode_tok_per_s"] for r in pair if r["contender"] == "colibri-stream"]
        theirs = [r["decode_tok_per_s"] for r in pair if r["contender"] == "llama.cpp"]
        if mine and theirs and statistics.median(theirs) > 0:
            value = statistics.median(mine) / statistics.median(theirs)
            ratios[f"vs_{prefix}_alternated_{ALTERNATED_BUDGET}"] = round(value, 2)
    return ratios
