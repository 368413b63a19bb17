"""The bench's MTP rows: decoding with the demo model's trained MTP head, plain vs the governor vs forced on.

One fresh `colibri-stream run` per (budget, mode), each on the demo container with its MTP module, the same
prompt and token count: ``--mtp off`` (plain decoding), ``--mtp auto`` (the governor decides each step) and
``--mtp on`` (drafting every step). At 100% the experts are preloaded into RAM; at 25% they stream with
O_DIRECT reads (``--direct``), so a miss is a disk read, not a page-cache copy. Each row keeps decode tok/s,
the drafts' acceptance, the governor's on-share, the decode phase's hit rate and expert bytes read per
token; the ratios are each mode's decode tok/s over plain's at the same budget, and every mode's tokens
must equal plain's (greedy).
"""

from __future__ import annotations

import json
from pathlib import Path

from colibri_stream.bench.system import MemoryLimit, cli_argv

BUDGETS = (100, 25)
MODES = ("off", "auto", "on")


def mtp_run(
    container: Path, prompt: str, tokens: int, pct: int, mode: str, depth: int, kv_dir: Path, limit: MemoryLimit,
    timeout_s: float, extra: tuple[str, ...] = (),
) -> dict:  # fmt: skip
    """One run's row; ``extra``: more `run` options (e.g. ``--activations int8``)."""
    argv = cli_argv("run", str(container), "--prompt", prompt, "--max-new-tokens", str(tokens), "--json", *extra)
    argv += ["--ram", f"{pct}%", "--kv-dir", str(kv_dir), "--no-prefix-cache", "--mtp", mode, "--mtp-depth", str(depth)]
    argv += ["--preload"] if pct >= 100 else ["--direct"]
    out = json.loads(limit.run(argv, timeout_s).last_json_line())
    stats, decode = out["stats"], out["stats"]["decode_phase"]
    mtp = stats.get("mtp") or {}
    decoded = max(1, stats["decode_tokens"])
    requests = max(1, decode["expert_requests"])
    return {
        "budget_pct": pct,
        "mode": mode,
        "ids": out["ids"],
        "decode_tok_per_s": stats["decode_tok_per_s"],
        "tokens_per_step": mtp.get("tokens_per_step"),
        "acceptance_rate": mtp.get("acceptance_rate"),
        "on_share": mtp.get("on_share"),
        "estimated_gain": mtp.get("estimated_gain"),
        "hit_rate": round((decode["hits"]["ram"] + decode["hits"]["vram"]) / requests, 4),
        "expert_bytes_per_token": decode["expert_bytes_read"] // decoded,
    }


def mtp_section(
    container: Path,
    prompt: str,
    tokens: int,
    kv_dir: Path,
    limit_bytes: int,
    timeout_s: float,
    depth: int = 2,
    repeats: int = 3,
    extra: tuple[str, ...] = (),
) -> dict:
    """Every (budget, mode) row (the run of median decode tok/s among ``repeats``, the modes interleaved so
    a noisy moment hits them alike), the ratios over plain decoding, and whether every run kept plain's tokens."""
    limit = MemoryLimit(limit_bytes, "colibri-bench-mtp")
    runs: dict[tuple[int, str], list[dict]] = {(pct, mode): [] for pct in BUDGETS for mode in MODES}
    for _ in range(repeats):
        for pct, mode in runs:
            row = mtp_run(container, prompt, tokens, pct, mode, depth, kv_dir, limit, timeout_s, extra)
            runs[pct, mode].append(row)
    rows = [sorted(found, key=lambda row: row["decode_tok_per_s"])[len(found) // 2] for found in runs.values()]
    same = all(run["ids"] == runs[pct, "off"][0]["ids"] for (pct, _), found in runs.items() for run in found)
    plain = {row["budget_pct"]: row for row in rows if row["mode"] == "off"}
    ratios = {
        f"{'governor' if row['mode'] == 'auto' else 'forced'}_vs_plain_{row['budget_pct']}": round(
            row["decode_tok_per_s"] / max(plain[row["budget_pct"]]["decode_tok_per_s"], 1e-9), 3
        )
        for row in rows
        if row["mode"] != "off"
    }
    for row in rows:
        del row["ids"]
    return {"tokens": tokens, "depth": depth, "repeats": repeats, "rows": rows, "ratios": ratios, "same_tokens": same}


def mtp_table(section: dict) -> list[str]:
    """The rows as a markdown table (budget x mode)."""
    lines = [
        "| budget | mode | decode tok/s | x plain | tokens/step | acceptance | on-share | hit rate | expert B/token |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    plain = {row["budget_pct"]: row["decode_tok_per_s"] for row in section["rows"] if row["mode"] == "off"}
    for row in section["rows"]:
        ratio = row["decode_tok_per_s"] / max(plain[row["budget_pct"]], 1e-9)
        shown = [_shown(row[key]) for key in ("tokens_per_step", "acceptance_rate", "on_share")]
        lines.append(
            f"| {row['budget_pct']}% | {row['mode']} | {row['decode_tok_per_s']:.2f} | {ratio:.2f} | "
            f"{' | '.join(shown)} | {row['hit_rate']} | {row['expert_bytes_per_token']:,} |"
        )
    return lines


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value}"
