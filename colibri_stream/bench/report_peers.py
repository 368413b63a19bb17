"""The report's parts about llama.cpp, load and the machine: the llama.cpp table and plot, loaded_vs_idle,
the limit lines (decode and prefill) and the machine facts that explain one machine's numbers against another's."""

from __future__ import annotations

from pathlib import Path

from colibri_stream.bench.llama_cpp import MATCHED_CONTAINERS
from storage.tiers.policy import DEFAULT_POLICY

MB = 1e6


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def machine_lines(machine: dict) -> list[str]:
    line = (
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['ram_bytes'] / 2**30:.1f} GiB RAM, "
        f"disk {machine['filesystem']}, Linux {machine['kernel']}, Python {machine['python']}, "
        f"torch {machine['torch']} ({machine['torch_threads']} threads)."
    )
    if "isa" in machine:  # results of older runs lack it
        line += f" ISA: {', '.join(machine['isa']) or 'none of the listed SIMD extensions'}."
    if "kernels" in machine:
        line += f" Our kernels: {machine['kernels']}."
    if "memory_bandwidth_Bps" in machine:  # results of older runs lack these
        steal, end = machine.get("cpu_steal_share"), machine.get("memory_bandwidth_Bps_at_end")
        line += (
            f" Memory read bandwidth {machine['memory_bandwidth_Bps'] / 1e9:.1f} GB/s at the start"
            + (f", {machine['memory_bandwidth_Bps_at_end'] / 1e9:.1f} GB/s at the end" if end else "")
            + f" ({machine['torch_threads']} threads reading 1 GiB, best of 3); load average at start "
            f"{' / '.join(map(str, machine['load_average_at_start']))}; CPU stolen by the hypervisor during the run "
            f"{'not counted' if steal is None else f'{100 * steal:.1f}%'}."
        )
    return [line]


def llama_cpp_lines(results: dict) -> list[str]:
    section = results["llama_cpp"]
    if "skipped" in section:
        return [section["skipped"]]
    lines = []
    for kind, facts in section["files"].items():
        types = ", ".join(f"{n} {t}" for t, n in sorted(facts["tensor_types"].items()))
        lines.append(f"- `{kind}`: {facts['file_bytes'] / MB:,.1f} MB, tensors {types}.")
    ours = {r["name"]: r for r in section.get("ours_matched", [])}
    body = []
    for r in section["rows"]:  # against ours computed as that file is (MATCHED_CONTAINERS)
        state = f"int8-act {r['budget_pct']}% {DEFAULT_POLICY} prefetch {'cold' if r['cold'] else 'warm'}"
        mine = ours.get(f"{MATCHED_CONTAINERS[r['file']]} {state}") or ours.get(f"int4-int8dense {state}")
        ratio = f"{mine['decode_tok_per_s'] / r['decode_tok_per_s']:.2f}x" if mine and r["decode_tok_per_s"] else "-"
        body.append(
            [
                r["file"],
                f"{r['budget_pct']}%",
                "repacked" if r["repack"] else "mmap",
                "cold" if r["cold"] else "warm",
                f"{r['decode_tok_per_s']:.2f}",
                f"{r['ttft_s']:.3f}",
                f"{r['load_s']:.2f}",
                f"{r['disk_bytes_per_token'] / MB:,.1f}",
                "-" if r["peak_group_bytes"] is None else f"{r['peak_group_bytes'] / MB:,.1f}",
                "-" if r.get("other_cpu_share") is None else f"{100 * r['other_cpu_share']:.0f}%",
                "same" if mine and mine["ids"] == r["ids"] else "differ" if mine else "-",
                ratio,
            ]
        )
    header = ["file", "budget", "weights", "page cache", "tok/s", "TTFT s", "load s", "disk MB/token", "peak MB"]
    lines += [""] + table(header + ["others' CPU", "tokens vs ours", "ours / llama.cpp"], body)
    matched = [
        [r["name"], f"{r['decode_tok_per_s']:.2f}", f"{r['ttft_s']:.3f}", f"{r['bytes_per_token'] / MB:,.1f}"]
        for r in section.get("ours_matched", [])
    ]
    if matched:
        lines += [
            "",
            "Ours, quality-matched (int4 experts, `--activations int8`; int8 dense records against q4e_q8, int4 "
            "dense records against all-Q4_0):",
            "",
        ]
        lines += table(["run", "tok/s", "TTFT s", "expert MB read/token"], matched)
    lines += same_limit_lines(section.get("ours_same_limit", []))
    lines += prefill_lines(section.get("prefill"))
    lines += alternated_lines(section.get("alternated", []))
    failed = [f"- failed: {f['name']}: {f['error']}" for f in section.get("failed", [])]
    lines += [""] + failed if failed else []
    return lines + [
        "",
        f'{section["threads"]} threads each. "others\' CPU": the share of the machine other processes used '
        "during the row (llama.cpp's OpenMP threads spin-wait by default, which a competing process punishes). "
        "Token ids are compared with ours at the same budget and page-cache "
        "state; random weights leave near-ties that a different quantization of the dense part can flip.",
    ]


def same_limit_lines(rows: list[dict]) -> list[str]:
    """Ours with `--ram auto` in the budget's memory limit (bench/llama_cpp_race.py, ``_same_limit_rows``)."""
    if not rows:
        return []  # results of older runs lack them
    body = [
        [r["name"], str(r["ram_slots"]), f"{r['hit_rate']:.3f}", f"{r['decode_tok_per_s']:.2f}"]
        + [f"{r['bytes_per_token'] / MB:,.1f}", f"{r['peak_group_bytes'] / MB:,.1f}" if r["peak_group_bytes"] else "-"]
        for r in rows
    ]
    lines = ["", "Ours with `--ram auto` (what `run` does without `--ram`) in the same memory limit:", ""]
    lines += table(["run", "RAM slots", "hit rate", "tok/s", "expert MB read/token", "peak MB"], body)
    return lines + [
        "",
        "The rows above give our store the budget's share of the expert bytes and leave the rest of the limit "
        "unused, while llama.cpp's page cache fills it; here our store sizes itself from the limit "
        "(`vs_*_same_limit_<pct>`).",
    ]


def alternated_lines(rows: list[dict]) -> list[str]:
    """The 100% decode pairs in alternating rounds (bench/alternated_rows.py): each round's rows in order."""
    if not rows:
        return []  # results of older runs lack them
    body = [[r["name"], r["pair"], f"{r['decode_tok_per_s']:.2f}", f"{r['ttft_s']:.3f}"] for r in rows]
    lines = ["", "At 100%, warm, ours then llama.cpp's fastest mode of the file in alternating rounds:", ""]
    lines += table(["run", "pair", "tok/s", "TTFT s"], body)
    return lines + [
        "",
        "`vs_*_alternated_100`: the median of our rounds over the median of llama.cpp's (one slow minute of "
        "either does not decide it, as it can decide the single rows above).",
    ]


def prefill_lines(prefill: dict | None) -> list[str]:
    """The long-prompt rows (bench/prefill_rows.py): TTFT and prefill tok/s of ours and each llama.cpp file."""
    if not prefill or not prefill["ours"]:
        return []  # results of older runs lack them
    body = [
        [
            r["name"],
            f"{r['budget_pct']}%",
            "cold" if r["cold"] else "warm",
            f"{r['ttft_s']:.2f}",
            f"{r['prefill_tok_per_s']:.1f}",
            f"{r['decode_tok_per_s']:.2f}",
        ]
        for r in prefill["ours"] + prefill["rows"]
    ]
    tokens = prefill["ours"][0]["prompt_tokens"]
    lines = ["", f"Prefill of a {tokens}-token prompt (ours: the int8 path), time to the first token:", ""]
    lines += table(["run", "budget", "page cache", "TTFT s", "prompt tok/s", "decode tok/s after it"], body)
    return lines + [
        "",
        "The ratios `prefill_vs_*` (first token) and `long_decode_vs_*` (the tokens after it, the prompt in the "
        "cache) take warm rows at 100% (llama.cpp's best mode) and cold rows below it.",
    ]


def load_lines(load: dict) -> list[str]:
    idle = " and ".join(f"{v:.2f}" for v in load["idle_tok_per_s"])
    return [
        f"Ours at 100%, page cache warm: idle {idle} tok/s (before and after), beside `{load['competitor']}`, "
        f"{load['loaded_tok_per_s']:.2f} tok/s -> **loaded_vs_idle {load['loaded_vs_idle']}** (over the better idle "
        f"run); TTFT {load['idle_ttft_s']:.3f} s idle, {load['loaded_ttft_s']:.3f} s loaded; same tokens: "
        f"{load['same_tokens']}."
    ]


def limit_line_lines(limit: dict) -> list[str]:
    body = []
    for name, row in limit["contenders"].items():
        b = row["bytes_per_token"]
        measured = row["measured_tok_per_s"]
        body.append(
            [
                name,
                f"{b['dense'] / MB:,.1f}",
                f"{b['experts'] / MB:,.1f}",
                f"{b['kv'] / MB:,.2f}",
                f"{b['total'] / MB:,.1f}",
                row["fastest_tok_per_s"],
                "-" if measured is None else f"{measured:.2f}",
                "-" if row["fraction_of_limit"] is None else row["fraction_of_limit"],
            ]
        )
    header = ["contender", "dense MB", "experts MB", "KV MB", "MB/token", "fastest tok/s", "best tok/s", "fraction"]
    return [
        f"Memory bandwidth {limit['memory_bandwidth_GBps']} GB/s over the bytes one decode step reads "
        "(dense part as stored, top-k experts per MoE layer, KV at the prompt length):",
        "",
        *table(header, body),
    ]


def prefill_limit_lines(line: dict) -> list[str]:
    """The prefill limit line (bench/prefill_limit.py): the peaks, each prompt length's multiply-adds and
    fastest TTFT, each contender's best 100% warm TTFT as a fraction."""
    peaks = ", ".join(f"{fmt} {rate:,.1f}" for fmt, rate in line["compute_peak_GMACps"].items())
    kernels = "; ".join(
        f"{name} {row['GMACps']:,.2f} at {'x'.join(map(str, row['shape']))}"
        for name, row in line["calibration"].items()
    )
    body = []
    for tokens, prompt in line["prompts"].items():
        need = prompt["multiply_adds"]
        fastest = prompt["fastest_ttft_s"]
        body.append(
            [f"{tokens} tokens: the limit", f"{need['total'] / 1e9:,.1f}", "-" if fastest is None else fastest, "", ""]
        )
        for name, rows in line["contenders"].items():
            if tokens in rows:
                row = rows[tokens]
                fraction = "-" if row["fraction_of_limit"] is None else row["fraction_of_limit"]
                body.append([name, "", row["measured_ttft_s"], row["measured_GMACps"], fraction])
    header = ["prompt / contender", "G multiply-adds", "TTFT s", "G multiply-adds/s", "fraction"]
    return [
        f"Compute peak on {line['threads']} threads, G multiply-adds/s: {peaks} (the limit: {line['limit_format']}; "
        f"best of the calibration kernels and shapes: {kernels}). The multiply-adds a prompt needs (experts, "
        "shared experts, dense MLPs, attention projections, causal attention, DSA indexer, the last position's "
        "head) over the peak are the fastest first token at 100%; each contender's best warm 100% prefill row:",
        "",
        *table(header, body),
    ]


def plot_llama_cpp(plt, results: dict, path: Path) -> None:
    """Decode tok/s per budget: ours (int4, the default policy, prefetch) and llama.cpp's best row per file,
    cold and warm, with each contender's limit line at 100%."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, dict[tuple[int, bool], float]] = {}
    for r in results.get("decode", []) + results["llama_cpp"].get("ours_matched", []):
        if r["container"] in ("int4", *MATCHED_CONTAINERS.values()) and r["policy"] == DEFAULT_POLICY and r["prefetch"]:
            dense = {"int4-int8dense": " + int8 dense/act", "int4-int4dense": " + int4 dense, int8 act"}
            label = "colibri-stream int4" + dense.get(r["container"], "")
            series.setdefault(label, {})[(r["budget_pct"], r["cold"])] = r["decode_tok_per_s"]
    for r in results["llama_cpp"]["rows"]:
        points = series.setdefault(f"llama.cpp {r['file']}", {})
        key = (r["budget_pct"], r["cold"])
        points[key] = max(points.get(key, 0.0), r["decode_tok_per_s"])
    budgets = sorted({pct for points in series.values() for pct, _ in points})
    width = 0.8 / max(1, 2 * len(series))  # per budget: each contender cold, then warm
    for i, (label, points) in enumerate(series.items()):
        for j, (cold, hatch) in enumerate(((True, ""), (False, "//"))):
            chosen = sorted((pct, v) for (pct, c), v in points.items() if c == cold)
            x = [budgets.index(pct) + (2 * i + j) * width for pct, _ in chosen]
            color = f"C{i}"
            name = f"{label} {'cold' if cold else 'warm'}"
            alpha = 1.0 if cold else 0.6
            ax.bar(x, [v for _, v in chosen], width, color=color, hatch=hatch, alpha=alpha, label=name)
    for name, row in results.get("limit_line", {}).get("contenders", {}).items():
        if 100 in budgets:
            ax.axhline(row["fastest_tok_per_s"], linestyle=":", linewidth=1, color="gray")
            ax.annotate(f"limit {name}", (len(budgets) - 1, row["fastest_tok_per_s"]), fontsize=7)
    middle = (2 * len(series) - 1) * width / 2
    ax.set_xticks([j + middle for j in range(len(budgets))], [f"{pct}%" for pct in budgets])
    ax.set(xlabel="RAM budget (% of int4 expert bytes)", ylabel="decode tokens / s (log)", yscale="log")
    ax.set_title("Ours vs llama.cpp under the same memory limit")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
