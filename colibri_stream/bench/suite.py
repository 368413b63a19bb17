"""`colibri-stream bench`: every contender side by side, in one run, under one memory limit.

Sections (docs/benchmarks-log.md, "How the bench measures", says how to read the output):
  1. disk      raw O_DIRECT sequential and expert-sized random reads vs our cold reads;
  2. decode    our tok/s, TTFT, hit rate, bytes/token and I/O-wait share per RAM budget, policy,
               prefetch on/off, cold and warm page cache; the same store on a bf16 container;
  3. peer      transformers + accelerate disk offload at the same budgets and limits;
  4. caching   each policy vs Belady's MIN on the recorded traces (this model's and the demo's);
  5. sessions  resuming a ~2k-token conversation from its KV log vs re-prefilling it;
  6. llama_cpp the same checkpoint converted by llama.cpp (all-Q4_0 and quality-matched GGUF), mmapped,
               at the ratio budget and 100%, cold and warm (needs the `peers` extra: skipped and said otherwise);
  7. load      our decode beside a competing CPU-bound process vs idle (`loaded_vs_idle`);
  8. mtp       the demo model's MTP drafts: plain vs the governor vs forced on, at 100% and 25%;
  9. batch     the demo model served to 1/4/8 concurrent clients vs the same requests one after another.
Then the limit lines at 100%: memory bandwidth / bytes each contender touches per token (decode), and the
int8 compute peak / multiply-adds a prompt needs (prefill: the llama_cpp section's long-prompt rows).
`sections` picks a subset (caching replays decode's trace, so it needs decode).
The model is generated (DeepSeek-V3 proportions, random weights) and converted once into the work
directory; later runs reuse it.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from colibri_stream.bench.batch_rows import BatchSettings, batch_section
from colibri_stream.bench.cache import gap_to_belady_pp, trace_section
from colibri_stream.bench.contenders import OurConfig, RunInputs, run_ours, run_peer_contender
from colibri_stream.bench.disk import disk_section
from colibri_stream.bench.limit_line import limit_line, memory_bandwidth, ours_touched
from colibri_stream.bench.llama_cpp import (
    default_llama_cpp_dir,
    skip_reason,
)
from colibri_stream.bench.llama_cpp_race import INT4_MATCHED, INT8_MATCHED, LlamaCppRace
from colibri_stream.bench.llama_cpp_section import (
    matched_container,
    section_ratios,
    touched_from_facts,
)
from colibri_stream.bench.load import loaded_vs_idle
from colibri_stream.bench.mtp_rows import mtp_section
from colibri_stream.bench.prefill_limit import (
    CALIBRATION_BUDGET_S,
    best_prefill_ttft,
    compute_peaks,
    prefill_limit_line,
    prompt_multiply_adds,
)
from colibri_stream.bench.sessions import random_prompt_ids, sessions_section
from colibri_stream.bench.stress_model import QUICK, StressShape, checkpoint_bytes, write_stress_checkpoint
from colibri_stream.bench.system import (
    MemoryLimit,
    cgroup_available,
    cli_argv,
    convert,
    cpu_times,
    machine_facts,
    steal_share,
)
from colibri_stream.checkpoint.demo_model import DEMO_PROMPT, demo_container_path, demo_model_dir
from colibri_stream.planning.geometry import geometry_from_container
from colibri_stream.planning.placement import plan
from colibri_stream.runtime.loader import kv_b_codes_kept
from engine.kernels.bf16 import KEEP_FLOAT32
from storage.container.layout import stored_shape
from storage.container.reader import Container, DenseEntry
from storage.errors import DiskFullError, free_bytes
from storage.tiers.config import StoreConfig
from storage.tiers.policy import DEFAULT_POLICY, POLICY_NAMES
from storage.tiers.tiered import minimum_slots, total_records

GiB = 1 << 30
RATIO_BUDGET = 25  # the budget (% of int4 expert bytes) at which the headline ratios (and sessions) are taken
SECTIONS = ("disk", "decode", "peer", "caching", "sessions", "llama_cpp", "load", "mtp", "batch")


@dataclass(frozen=True)
class BenchSettings:
    shape: StressShape
    prompt_tokens: int
    new_tokens: int  # generated tokens per run, ours and the peer's alike
    budgets_pct: tuple[int, ...] = (10, 25, 50, 100)
    # the bf16 container and the peer (each run a process start, ~10-15 s at --quick): None = budgets_pct
    side_budgets_pct: tuple[int, ...] | None = None
    no_prefetch_policies: tuple[str, ...] = POLICY_NAMES  # the prefetch-off runs at RATIO_BUDGET
    sequential_bytes: int = 2 * GiB
    disk_records: int = 256
    conversation_tokens: int = 2000
    sweep_points: int = 12
    overhead_bytes: int = GiB  # the memory limit above budget + dense + KV: interpreter, torch, activations
    timeout_s: float = 900.0
    demo_tokens: int = 128
    llama_cpp_budgets_pct: tuple[int, ...] = (RATIO_BUDGET, 100)
    prefill_tokens: int = 1024  # the llama.cpp section's long-prompt TTFT rows (bench/prefill_rows.py)
    # our prompt path in those rows: None = the fastest this CPU has (int8-tiles with AVX-512 VNNI, else int8)
    prefill_activations: str | None = None
    alternation_rounds: int = 3  # the section's 100% decode pairs again, alternating (bench/alternated_rows.py)
    alternation_tokens: int = 128
    batch: BatchSettings = BatchSettings()  # the batch section's client counts, tokens and rounds
    calibration_budget_s: float = CALIBRATION_BUDGET_S  # the prefill limit line's compute-peak kernels, all together


FULL = BenchSettings(shape=StressShape(), prompt_tokens=32, new_tokens=32)
QUICK_SETTINGS = BenchSettings(
    shape=replace(QUICK, num_hidden_layers=12),  # 11 MoE layers: one layer's experts fit in a 10% budget
    prompt_tokens=16,
    prefill_tokens=128,
    new_tokens=12,
    sequential_bytes=64 << 20,
    disk_records=48,
    conversation_tokens=256,
    sweep_points=6,
    timeout_s=300.0,
    demo_tokens=48,
    alternation_rounds=2,
    alternation_tokens=24,
    batch=BatchSettings(clients=(1, 4), max_tokens=16, rounds=1),
    calibration_budget_s=2.0,
    # --quick checks every invariant at fewer points: the ratio budget and all-in-RAM for the side
    # contenders, prefetch off for the default policy only (the full run keeps every point)
    side_budgets_pct=(RATIO_BUDGET, 100),
    no_prefetch_policies=(DEFAULT_POLICY,),
)


@dataclass
class Bench:
    settings: BenchSettings
    work: Path
    out: Path
    log: Callable[[str], None]
    results: dict = field(default_factory=dict)
    llama_cpp_dir: Path = field(default_factory=default_llama_cpp_dir)

    # ---------------------------------------------------------------------------------- models
    def prepare_models(self) -> None:
        shape = self.settings.shape
        self.hf = self.work / "hf"
        marker = self.hf / "bench-shape.json"
        if not marker.is_file() or json.loads(marker.read_text()) != asdict(shape):
            self.log(f"generating the bench model into {self.hf}")
            for stale in ("int4", "bf16"):  # containers of a previous model would refuse the new source
                shutil.rmtree(self.work / f"{stale}.cstream", ignore_errors=True)
            write_stress_checkpoint(self.hf, shape, progress=sys.stderr.isatty())
            marker.write_text(json.dumps(asdict(shape)))
        self.int4 = self.convert_container("int4")
        self.container = Container(self.int4)
        self.record_bytes = self.container.layout.record_bytes
        self.expert_bytes = self.container.expert_bytes
        placement = plan(geometry_from_container(self.container), StoreConfig(ram_bytes=0))
        self.placement = placement
        self.dense_bytes = placement.dense_bytes
        context = self.settings.conversation_tokens + 64
        self.kv_bytes = placement.kv_bytes_per_token * context
        self.results["model"] = {
            "shape": asdict(shape),
            "int4_expert_bytes": self.expert_bytes,
            "int4_record_bytes": self.record_bytes,
            "dense_bytes_resident": self.dense_bytes,
            "moe_layers": len(self.container.moe_layers),
            "experts_per_layer": self.container.n_experts,
        }

    def convert_container(self, experts: str, dense: str = "bf16") -> Path:
        dst = self.work / f"{experts}{'' if dense == 'bf16' else '-' + dense + 'dense'}.cstream"
        self.log(f"container {dst.name}")
        return convert(self.hf, dst, experts, progress=sys.stderr.isatty(), dense=dense)

    def ram_bytes(self, pct: int) -> int:
        return self.expert_bytes * pct // 100

    def limit(self, pct: int) -> MemoryLimit:
        """The one memory limit of every contender at this budget: expert budget + our resident dense
        part + KV + a fixed runtime overhead."""
        return MemoryLimit(self.ram_bytes(pct) + self.dense_bytes + self.kv_bytes + self.settings.overhead_bytes)

    def inputs(self, seed: int = 0) -> RunInputs:
        ids = random_prompt_ids(self.settings.shape.vocab_size, self.settings.prompt_tokens, seed)
        return RunInputs(ids, self.settings.new_tokens, self.settings.timeout_s)

    # -------------------------------------------------------------------------------- sections
    def disk(self) -> None:
        self.log("1/5 disk: raw O_DIRECT vs our cold reads")
        self.results["disk"] = disk_section(
            self.container,
            self.work / "sequential.scratch",
            self.settings.sequential_bytes,
            self.settings.disk_records,
            threads=StoreConfig(ram_bytes=0).threads,  # the store's default: the reads a user's store makes
        )

    def _convert_bf16(self) -> None:
        """The bf16 container: only decode's side rows use it (another ~4x the int4 bytes to write)."""
        self.bf16 = self.convert_container("bf16")
        self.results["model"]["bf16_record_bytes"] = Container(self.bf16).layout.record_bytes

    def decode(self) -> None:
        if self.side_budgets:
            self._convert_bf16()
        history = self.work / "history.json"
        history.unlink(missing_ok=True)
        self.log("2/5 decode: learning the hot store from one run on another prompt")
        run_ours(
            self.int4,
            OurConfig(RATIO_BUDGET),
            self.ram_bytes(RATIO_BUDGET),
            self.inputs(seed=7),
            self.limit(RATIO_BUDGET),
            ["--history", str(history), "--trace", str(self.out / "learn-trace.jsonl")],
        )
        rows = []
        for config in self.decode_grid():
            self.log(f"2/5 decode: {config.name}")
            extra = ["--history", str(self._pins_from(history))] if config.policy == "pinned" else []
            if config == OurConfig(RATIO_BUDGET):
                extra += ["--trace", str(self.out / "trace.jsonl")]
            ram = self.ram_bytes(config.budget_pct)
            if config.container == "bf16" and ram < minimum_slots(self.container) * self.bf16_record_bytes:
                continue  # below the floor (top-k bf16 records): that store cannot run at this budget
            rows.append(run_ours(self._path(config), config, ram, self.inputs(), self.limit(config.budget_pct), extra))
        self.results["decode"] = rows

    def _pins_from(self, history: Path) -> Path:
        """A copy of the learned history for one run: a run saves its own usage into the file it is
        given, and pins must come from the other prompt's run, never from a measured one."""
        copy = self.work / "history-run.json"
        shutil.copyfile(history, copy)
        return copy

    @property
    def bf16_record_bytes(self) -> int:
        return self.results["model"]["bf16_record_bytes"]

    def _path(self, config: OurConfig) -> Path:
        return self.bf16 if config.container == "bf16" else self.int4  # the matched rows: LlamaCppRace's

    def decode_grid(self) -> list[OurConfig]:
        grid = []
        for pct in self.settings.budgets_pct:
            grid.append(OurConfig(pct))
            if pct in (RATIO_BUDGET, 100):  # again at once: the page cache as the cold run left it
                grid.append(OurConfig(pct, cold=False))
        grid += [OurConfig(RATIO_BUDGET, policy) for policy in POLICY_NAMES if policy != DEFAULT_POLICY]
        grid += [OurConfig(RATIO_BUDGET, policy, prefetch=False) for policy in self.settings.no_prefetch_policies]
        grid += [OurConfig(pct, container="bf16") for pct in self.side_budgets]
        return grid

    @property
    def side_budgets(self) -> tuple[int, ...]:
        side = self.settings.side_budgets_pct
        return self.settings.budgets_pct if side is None else side

    def peer(self) -> None:
        rows = []
        for pct in self.side_budgets:
            self.log(f"3/5 peer: transformers + accelerate at {pct}%")
            max_memory = self.ram_bytes(pct) + self.dense_bytes + self.kv_bytes
            rows.append(
                run_peer_contender(self.hf, pct, max_memory, self.inputs(), self.limit(pct), self.work / "offload")
            )
        self.results["peer"] = rows

    def caching(self) -> None:
        self.log("4/5 caching: policies vs Belady on the recorded traces")
        budgets = {f"{pct}%": self.ram_bytes(pct) for pct in self.settings.budgets_pct}
        ours = trace_section(
            self.out / "trace.jsonl",
            self.record_bytes,
            self.container.n_experts,
            total_records(self.container),
            budgets,
            self.settings.sweep_points,
            len(self.container.moe_layers),
            learned_from=self.out / "learn-trace.jsonl",
        )
        self.results["caching"] = {"bench_model": ours, "demo_model": self._demo_trace()}

    def _demo_trace(self) -> dict:
        model_dir = demo_model_dir()
        demo = convert(model_dir, demo_container_path(model_dir, self.work / "demo"))  # cheap once converted
        trace = self.out / "demo-trace.jsonl"
        argv = cli_argv("run", str(demo), "--prompt", DEMO_PROMPT, "--max-new-tokens", str(self.settings.demo_tokens))
        argv += [
            "--ram",
            "40%",
            "--json",
            "--trace",
            str(trace),
            "--kv-dir",
            str(self.work / "kv"),
            "--no-prefix-cache",
        ]
        MemoryLimit(self.settings.overhead_bytes).run(argv, self.settings.timeout_s).last_json_line()
        container = Container(demo)
        budgets = {f"{pct}%": container.expert_bytes * pct // 100 for pct in (35, 40, 50, 75)}
        records = total_records(container)
        layout, layers = container.layout, len(container.moe_layers)
        return trace_section(
            trace, layout.record_bytes, container.n_experts, records, budgets, self.settings.sweep_points, layers
        )

    def sessions(self) -> None:
        self.log(f"5/5 sessions: resume a {self.settings.conversation_tokens}-token conversation vs re-prefill")
        kv_dir = self.work / "kv"
        for old in kv_dir.glob("bench-resume*"):
            old.unlink()
        self.results["sessions"] = sessions_section(
            self.int4,
            self.settings.shape.vocab_size,
            self.settings.conversation_tokens,
            8,
            f"{RATIO_BUDGET}%",
            kv_dir,
            self.limit(RATIO_BUDGET),
            self.settings.timeout_s,
        )

    @property
    def threads(self) -> int:
        return self.results["machine"]["torch_threads"]  # ours runs with torch's default; llama.cpp gets as many

    def llama_cpp(self) -> None:
        reason = skip_reason(self.llama_cpp_dir)
        if reason:
            self.log(reason)
            self.results["llama_cpp"] = {"skipped": reason}
            return
        self.log("6/7 llama.cpp: the same checkpoint as GGUF (converted once, cached in --work)")
        self.results["llama_cpp"] = LlamaCppRace(self).run()

    def load(self) -> None:
        self.log("7/7 load: our decode at 100% (warm) idle, beside a busy loop, idle again")
        config = OurConfig(100, cold=False)

        def run() -> dict:
            return run_ours(self.int4, config, self.ram_bytes(100), self.inputs(), self.limit(100))

        self.results["load"] = loaded_vs_idle(run)

    def mtp(self) -> None:
        self.log("8/9 mtp: the demo model's MTP drafts, plain vs governor vs forced, at 100% and 25%")
        model_dir = demo_model_dir()
        demo = convert(model_dir, demo_container_path(model_dir, self.work / "demo"))  # cheap once converted
        tokens = self.settings.demo_tokens * 2
        limit = Container(demo).expert_bytes + self.settings.overhead_bytes
        self.results["mtp"] = mtp_section(demo, DEMO_PROMPT, tokens, self.work / "kv", limit, self.settings.timeout_s)

    def batch(self) -> None:
        self.log("9/9 batch: the demo model served to concurrent clients vs one after another, 100% RAM")
        model_dir = demo_model_dir()
        demo = convert(model_dir, demo_container_path(model_dir, self.work / "demo"))  # cheap once converted
        self.results["batch"] = batch_section(demo, self.work / "kv-batch", self.settings.batch)

    # --------------------------------------------------------------------------------- summary
    def ratios(self) -> dict:
        """The headline ratios of the sections that ran."""
        ratios, results = {}, self.results
        ours = {r["budget_pct"]: r for r in results.get("decode", []) if r["name"] == OurConfig(r["budget_pct"]).name}
        if "peer" in results and RATIO_BUDGET in ours:
            peer = next(r for r in results["peer"] if r["budget_pct"] == RATIO_BUDGET)
            ratios["vs_accelerate"] = round(ours[RATIO_BUDGET]["decode_tok_per_s"] / peer["decode_tok_per_s"], 1)
        if "disk" in results:
            ratios["io_efficiency"] = results["disk"]["io_efficiency"]
        if "caching" in results:
            rows = results["caching"]["bench_model"]["at_budgets"]
            ratios["hit_vs_belady_pp"] = gap_to_belady_pp(next(r for r in rows if r["budget"] == f"{RATIO_BUDGET}%"))
        if "sessions" in results:
            ratios["resume_speedup"] = results["sessions"]["resume_speedup"]
        if "rows" in results.get("llama_cpp", {}):
            ratios |= section_ratios(results["llama_cpp"], ours)
        if "load" in results:
            ratios["loaded_vs_idle"] = results["load"]["loaded_vs_idle"]
        if "mtp" in results:
            ratios |= {f"mtp_{name}": value for name, value in results["mtp"]["ratios"].items()}
        if "batch" in results:
            ratios |= results["batch"]["ratios"]
        return ratios

    def limit_line_summary(self) -> dict:
        """Bandwidth / bytes per token at 100%, and each contender's best 100% decode as a fraction of it."""
        p, shape = self.placement, self.settings.shape
        context = self.settings.prompt_tokens
        touched = {
            "colibri-stream": ours_touched(
                p.dense_bytes_per_token,
                self.record_bytes,
                shape.num_experts_per_tok,
                len(self.container.moe_layers),
                p.kv_bytes_per_token,
                context,
            )
        }
        names = {"int4": "colibri-stream", INT8_MATCHED: "colibri-stream int8", INT4_MATCHED: "colibri-stream int4"}
        for label, path in self.results.get("llama_cpp", {}).get("matched_containers", {}).items():
            matched = Container(Path(path))
            m = plan(geometry_from_container(matched), StoreConfig(ram_bytes=0))
            touched[names[label]] = ours_touched(
                coded_dense_bytes_per_token(matched.dense),
                matched.layout.record_bytes,
                shape.num_experts_per_tok,
                len(matched.moe_layers),
                m.kv_bytes_per_token,
                context,
            )
        best: dict[str, float] = {}
        matched_rows = self.results.get("llama_cpp", {}).get("ours_matched", [])
        for r in self.results.get("decode", []) + matched_rows:
            name = names.get(matched_container(r))
            if name is not None and r["budget_pct"] == 100:
                best[name] = max(best.get(name, 0.0), r["decode_tok_per_s"])
        for kind, facts in self.results.get("llama_cpp", {}).get("files", {}).items():
            name = f"llama.cpp {kind}"
            touched[name] = touched_from_facts(facts)
            rows = [r for r in self.results["llama_cpp"]["rows"] if r["file"] == kind and r["budget_pct"] == 100]
            if rows:
                best[name] = max(r["decode_tok_per_s"] for r in rows)
        # measured again now: a machine busy at the start would understate it (the better one counts)
        machine = self.results["machine"]
        machine["memory_bandwidth_Bps_at_end"] = round(memory_bandwidth(self.threads))
        bandwidth = max(machine["memory_bandwidth_Bps"], machine["memory_bandwidth_Bps_at_end"])
        return limit_line(bandwidth, touched, best)

    def prefill_limit_summary(self) -> dict:
        """The int8 compute peak / the multiply-adds of each prompt length the prefill rows measured (the
        bench's prefill length where none ran), and each contender's best 100% warm TTFT as a fraction of it."""
        measured = best_prefill_ttft(self.results.get("llama_cpp", {}).get("prefill", {}))
        lengths = {n for by_length in measured.values() for n in by_length} or {self.settings.prefill_tokens}
        args = geometry_from_container(self.container).args
        work = {n: prompt_multiply_adds(args, n) for n in lengths}
        return prefill_limit_line(compute_peaks(self.threads, self.settings.calibration_budget_s), work, measured)


def run_bench(
    settings: BenchSettings,
    work: Path,
    out: Path,
    command: str,
    log: Callable[[str], None],
    sections: tuple[str, ...] = SECTIONS,
    llama_cpp_dir: Path | None = None,
) -> dict:
    """The chosen sections in SECTIONS order; returns the results (written to ``out``/results.json by the caller)."""
    unknown = set(sections) - set(SECTIONS)
    if unknown or ("caching" in sections and "decode" not in sections):
        raise ValueError(f"sections must be among {SECTIONS} and caching needs decode, not {sorted(sections)}")
    work.mkdir(parents=True, exist_ok=True)
    check_work_space(work, work_bytes_needed(settings, sections))  # before minutes of writing into it
    out.mkdir(parents=True, exist_ok=True)
    start, cpu_start = time.perf_counter(), cpu_times()
    bench = Bench(settings, work, out, log, llama_cpp_dir=llama_cpp_dir or default_llama_cpp_dir())
    bench.results.update(command=command, sections=list(sections), machine=machine_facts(work), warnings=[])
    if not cgroup_available():
        warning = "no writable cgroup-v1 memory controller: contenders ran WITHOUT a RAM limit (page cache unbounded)"
        bench.results["warnings"].append(warning)
        log(f"warning: {warning}")
    bench.prepare_models()
    bench.results["memory_limits"] = {f"{pct}%": bench.limit(pct).limit_bytes for pct in settings.budgets_pct} | {
        "enforced": cgroup_available(),
        "overhead_bytes": settings.overhead_bytes,
    }
    for name in SECTIONS:
        if name in sections:
            getattr(bench, name)()
    bench.results["ratios"] = bench.ratios()
    bench.results["limit_line"] = bench.limit_line_summary()
    bench.results["prefill_limit_line"] = bench.prefill_limit_summary()
    bench.results["machine"]["cpu_steal_share"] = steal_share(cpu_start, cpu_times())
    bench.results["elapsed_s"] = round(time.perf_counter() - start, 1)
    return bench.results


def work_bytes_needed(settings: BenchSettings, sections: tuple[str, ...]) -> int:
    """About the most the sections write into --work: the bf16 model and its int4 container, the bf16
    container (decode), llama.cpp's files with their bf16 intermediate and the int8- and int4-dense containers
    (llama_cpp), the disk section's scratch file. An estimate from the model's bf16 bytes, not a bound."""
    model = checkpoint_bytes(settings.shape)
    need = model + model // 4
    if "decode" in sections:
        need += model
    if "llama_cpp" in sections:
        need += 2 * model + model // 4
    if "disk" in sections:
        need += settings.sequential_bytes
    return need


def check_work_space(work: Path, needed: int) -> None:
    """Refuse, in one line, a --work without room for what the bench writes: on a full disk it would die
    minutes in, quoting the tail of a progress bar. Files already there (a previous run's model and
    containers, reused) count as room."""
    present = sum(f.lstat().st_size for f in work.rglob("*") if f.is_file() and not f.is_symlink())
    free = free_bytes(work)
    if free is not None and free + present < needed:
        raise DiskFullError(
            f"--work {work}: {free:,} bytes free there, the bench needs about {needed - present:,} "
            "(the generated model, its containers and scratch files); free space or pass --work on a bigger disk"
        )


def coded_dense_bytes_per_token(dense: Mapping[str, DenseEntry]) -> int:
    """Dense bytes a token reads with int8 activations, of a container's ``dense`` entries: int8 and int4
    records as stored (codes + float16 scales), except those kept float32 (engine.kernels.bf16.KEEP_FLOAT32,
    dequantised at load); but an int8 wkv_b is read as the records MLA.hold_kv_b_int8 keeps for decode
    (codes + float32 scales); other arrays as stored; the embedding one row (float32, dequantised)."""
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}
    total = 0
    for name, entry in dense.items():
        elements = entry.shape[-1] if name == "embed.weight" else math.prod(entry.shape)
        module = name.removesuffix(".weight")
        if entry.scales is None or name == "embed.weight":
            total += (4 if entry.scales is not None else itemsize[entry.dtype]) * elements
        elif not module.endswith(KEEP_FLOAT32):
            total += math.prod(stored_shape(entry.shape, entry.dtype)) + 2 * math.prod(entry.scales.shape)
        elif kv_b_codes_kept(name, entry.dtype):
            total += elements + 4 * math.prod(entry.scales.shape)
        else:
            total += 4 * elements
    return total
