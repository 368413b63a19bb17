"""The bench's human-readable output: a markdown report and three PNG plots, both drawn from the
results dict alone (so a results.json from another machine renders the same way)."""

from __future__ import annotations

from pathlib import Path

from colibri_stream.bench.batch_rows import batch_table
from colibri_stream.bench.mtp_rows import mtp_table
from colibri_stream.bench.report_peers import (
    limit_line_lines,
    llama_cpp_lines,
    load_lines,
    machine_lines,
    plot_llama_cpp,
    prefill_limit_lines,
)
from colibri_stream.bench.report_peers import table as _table
from storage.tiers.policy import DEFAULT_POLICY, POLICY_NAMES

GOALS = {  # ratio -> (goal text, test)
    "vs_accelerate": (">= 30x", lambda v: v >= 30),
    "io_efficiency": (">= 0.9", lambda v: v >= 0.9),
    "hit_vs_belady_pp": ("<= 5 pp", lambda v: v <= 5),
    "resume_speedup": (">= 50x", lambda v: v >= 50),
    "vs_llama_cpp_100": (">= 1.0", lambda v: v >= 1.0),
    "vs_llama_cpp_25": (">= 10", lambda v: v >= 10),
    "vs_llama_cpp_alternated_100": (">= 1.2", lambda v: v >= 1.2),  # issue #45's goal, both warm
    "vs_llama_cpp_q4_0_alternated_100": (">= 1.2", lambda v: v >= 1.2),
    "ttft_vs_llama_cpp_100": (">= 1.0", lambda v: v >= 1.0),
    "exact_vs_int8_100": (">= 0.5", lambda v: v >= 0.5),
    "loaded_vs_idle": (">= 0.5", lambda v: v >= 0.5),
    "mtp_governor_vs_plain_100": (">= 1.3", lambda v: v >= 1.3),
    "mtp_governor_vs_plain_25": (">= 1.0", lambda v: v >= 1.0),
    "batch_4_clients": (">= 1.6", lambda v: v >= 1.6),
}
MB = 1e6


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MB:,.1f}"


def markdown(results: dict) -> str:
    machine, model = results["machine"], results["model"]
    limits = results["memory_limits"]
    lines = [
        f"# colibri-stream bench ({results['mode']})",
        "",
        f"Command: `{results['command']}` — {results['elapsed_s']} s, {results.get('date', '')}",
        "",
        *machine_lines(machine),
        "",
        f"Model: generated DeepSeek-V3-style, {model['moe_layers']} MoE layers x {model['experts_per_layer']} experts, "
        f"int4 experts {model['int4_expert_bytes'] / 2**30:.2f} GiB ({_mb(model['int4_record_bytes'])} MB/record, "
        f"bf16 {_mb(model.get('bf16_record_bytes'))} MB/record), "
        f"resident dense part {_mb(model['dense_bytes_resident'])} MB.",
        "",
        "Memory limit per contender (cgroup, page cache counted; "
        f"{'enforced' if limits['enforced'] else 'NOT enforced'}): "
        + ", ".join(f"{k} -> {v / 2**30:.2f} GiB" for k, v in limits.items() if k.endswith("%")),
        "",
    ]
    lines += [f"**Warning:** {w}" for w in results["warnings"]]
    lines += ["## Ratios", ""]
    lines += _table(["ratio", "value", "goal", "met"], [_ratio_row(k, v) for k, v in results["ratios"].items()])
    if "disk" in results:
        lines += ["", "## 1. Disk", ""] + _disk_table(results["disk"])
    if "decode" in results or "peer" in results:
        rows = results.get("decode", []) + results.get("peer", [])
        lines += ["", "## 2-3. Decode: ours and the peer", ""] + _decode_table(rows)
    if "caching" in results:
        lines += ["", "## 4. Caching: policies vs Belady (hit rate over the recorded trace)", ""]
        lines += _caching_table(results["caching"])
    if "sessions" in results:
        lines += ["", "## 5. Sessions", ""] + _sessions_lines(results["sessions"])
    if "llama_cpp" in results:
        lines += ["", "## 6. llama.cpp, same checkpoint, same limits", ""] + llama_cpp_lines(results)
    if "load" in results:
        lines += ["", "## 7. Decode beside a CPU-bound process", ""] + load_lines(results["load"])
    if "mtp" in results:
        mtp = results["mtp"]
        lines += ["", f"## 8. MTP drafts on the demo model ({mtp['tokens']} tokens, depth {mtp['depth']})", ""]
        lines += mtp_table(mtp) + ["", f"Same tokens in every mode: {mtp['same_tokens']}."]
    if "batch" in results:
        batch = results["batch"]
        tokens, prompt = batch["settings"]["max_tokens"], batch["settings"]["prompt_tokens"]
        title = f"## 9. Serving the demo model: concurrent clients vs one after another ({prompt}-token prompts, "
        lines += ["", title + f"{tokens} tokens each)", ""]
        lines += batch_table(batch)
    if "limit_line" in results:
        lines += ["", "## The limit line (100%: everything in RAM)", ""] + limit_line_lines(results["limit_line"])
    if "prefill_limit_line" in results:
        lines += ["", "## The prefill limit line (100%: everything in RAM)", ""]
        lines += prefill_limit_lines(results["prefill_limit_line"])
    return "\n".join(lines) + "\n"


def _ratio_row(name: str, value: float) -> list:
    goal, met = GOALS.get(name, ("-", None))
    return [name, value, goal, "-" if met is None else "yes" if met(value) else "no"]


def _disk_table(disk: dict) -> list[str]:
    rows = [
        [name, entry["MBps"], entry.get("threads", 1), _mb(entry["bytes"])]
        for name, entry in disk.items()
        if isinstance(entry, dict)
    ]
    table = _table(["reads", "MB/s", "in flight", "MB read"], rows)
    return table + [
        "",
        f"io_efficiency (ours, O_DIRECT as by default / raw random O_DIRECT): {disk['io_efficiency']}; "
        f"ours buffered: {disk['io_efficiency_buffered']}; vs raw sequential: {disk['io_efficiency_vs_sequential']}",
    ]


def _decode_table(rows: list[dict]) -> list[str]:
    header = ["contender", "budget", "policy", "prefetch", "page cache", "tok/s", "TTFT s", "hit rate"]
    header += ["disk MB/token", "expert MB/token", "I/O wait", "peak MB"]
    body = []
    for r in rows:
        ours = r["contender"] == "colibri-stream"
        body.append(
            [
                r["contender"] + ("" if not ours else f" ({r['container']})"),
                f"{r['budget_pct']}%",
                r.get("policy", "-"),
                ("on" if r["prefetch"] else "off") if ours else "-",
                "cold" if r.get("cold", True) else "warm",
                f"{r['decode_tok_per_s']:.2f}",
                f"{r['ttft_s']:.3f}",
                r.get("hit_rate", "-"),
                _mb(r["disk_bytes_per_token"]),
                _mb(r.get("bytes_per_token")) if ours else "-",
                r.get("io_wait_share", "-"),
                _mb(r["peak_group_bytes"]),
            ]
        )
    return _table(header, body)


def _caching_table(caching: dict) -> list[str]:
    rows = []
    for trace, section in caching.items():
        for row in section["at_budgets"]:
            best = max(row[p] for p in POLICY_NAMES)
            gap = round(100 * (row["belady"] - best), 2)
            rows.append([trace, row["budget"], row["capacity"], *(row[p] for p in POLICY_NAMES), row["belady"], gap])
    header = ["trace", "budget", "slots", *(p.upper() if p == "lru" else p for p in POLICY_NAMES), "Belady", "gap pp"]
    return _table(header, rows)


def _sessions_lines(s: dict) -> list[str]:
    return [
        f"A {s['conversation_tokens']}-token conversation, next turn {s['follow_up_tokens']} tokens: "
        f"warm resume reused {s['warm']['reused_tokens']} tokens, TTFT {s['warm']['ttft_s']} s "
        f"(KV log read {s['warm']['kv_load_s']} s + {s['warm']['prefill_tokens']}-token prefill); "
        f"cold re-prefill of {s['cold']['prefill_tokens']} tokens {s['cold']['ttft_s']} s -> "
        f"**{s['resume_speedup']}x**; same first token: {s['same_first_token']}. The KV restore alone is "
        f"{s['kv_restore_vs_reprefill']}x faster than the re-prefill.",
    ]


def plots(results: dict, out: Path) -> list[Path]:
    """tok/s vs budget, hit rate vs capacity with Belady, bytes per token. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    if "decode" in results:
        paths.append(out / "tokps_vs_budget.png")
        _plot_speed(plt, results, paths[-1])
    if "caching" in results:
        paths.append(out / "hit_rate_vs_capacity.png")
        _plot_hits(plt, results["caching"], paths[-1])
    if "decode" in results:
        paths.append(out / "bytes_per_token.png")
        _plot_bytes(plt, results, paths[-1])
    if "rows" in results.get("llama_cpp", {}) and "decode" in results:
        paths.append(out / "vs_llama_cpp.png")
        plot_llama_cpp(plt, results, paths[-1])
    return paths


def _series(rows: list[dict], **match) -> tuple[list[int], list[dict]]:
    chosen = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    chosen.sort(key=lambda r: r["budget_pct"])
    return [r["budget_pct"] for r in chosen], chosen


def _plot_speed(plt, results: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves = {
        f"colibri-stream int4 ({DEFAULT_POLICY}, prefetch, cold)": _series(
            results["decode"], container="int4", policy=DEFAULT_POLICY, prefetch=True, cold=True
        ),
        "colibri-stream bf16 container (same store)": _series(results["decode"], container="bf16"),
        "transformers + accelerate offload": _series(results.get("peer", [])),
    }
    for label, (x, rows) in curves.items():
        ax.plot(x, [r["decode_tok_per_s"] for r in rows], marker="o", label=label)
    ax.set(xlabel="RAM budget (% of int4 expert bytes)", ylabel="decode tokens / s (log)", yscale="log")
    ax.set_title("Decode speed under the same memory limit")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_hits(plt, caching: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, len(caching), figsize=(6 * len(caching), 4.5), squeeze=False)
    for ax, (trace, section) in zip(axes[0], caching.items(), strict=True):
        x = [100 * row["capacity"] / section["total_records"] for row in section["sweep"]]
        styles = (*zip(POLICY_NAMES, ("D-", "o-", "s-", "^-"), strict=True), ("belady", "k--"))
        for policy, style in styles:
            ax.plot(x, [100 * row[policy] for row in section["sweep"]], style, label=policy)
        ax.set(xlabel="cache capacity (% of expert records)", ylabel="hit rate %", title=f"{trace} trace")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_bytes(plt, results: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = {
        "colibri-stream int4": _series(
            results["decode"], container="int4", policy=DEFAULT_POLICY, prefetch=True, cold=True
        ),
        "colibri-stream bf16": _series(results["decode"], container="bf16"),
        "accelerate": _series(results.get("peer", [])),
    }
    budgets = sorted({pct for x, _ in groups.values() for pct in x})
    width = 0.8 / len(groups)
    for i, (label, (x, rows)) in enumerate(groups.items()):
        positions = [budgets.index(pct) + i * width for pct in x]
        ax.bar(positions, [max(r["disk_bytes_per_token"], 1) / MB for r in rows], width, label=label)
    ax.set_xticks([j + width for j in range(len(budgets))], [f"{pct}%" for pct in budgets])
    ax.set(xlabel="RAM budget", ylabel="MB read from disk per decoded token (log)", yscale="log")
    ax.set_title("Bytes moved per token")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
