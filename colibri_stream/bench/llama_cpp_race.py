"""The bench's llama.cpp section (`bench --sections llama_cpp`): the bench model converted by llama.cpp's
own converter (all-Q4_0, and Q4_0 experts + Q8_0 dense), raced against our quality-matched containers at each
budget, then a long prompt's first token at each budget, then at 100% alternating rounds of ours and
llama.cpp's fastest warm mode. The rows and ratios are llama_cpp_section.py's; this module runs them in order.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

from colibri_stream.bench.alternated_rows import ALTERNATED_BUDGET, alternated_rows
from colibri_stream.bench.contenders import OurConfig, RunInputs, run_ours
from colibri_stream.bench.llama_cpp import FILE_KINDS, MATCHED_CONTAINERS, prepare_gguf_files
from colibri_stream.bench.llama_cpp_section import (
    fastest_warm_mode,
    gguf_facts,
    llama_cpp_grid,
    run_llama_cpp_contender,
)
from colibri_stream.bench.prefill_rows import PREFILL_NEW_TOKENS, llama_cpp_prefill_rows, our_prefill_rows
from colibri_stream.bench.sessions import random_prompt_ids
from colibri_stream.bench.stress_model import StressShape
from colibri_stream.bench.system import ContenderFailed, MemoryLimit
from engine.kernels.q8 import tiles_fast

INT8_MATCHED = MATCHED_CONTAINERS["q4e_q8"]  # ours quality-matched to llama.cpp's Q4_0-experts + Q8_0 file
INT4_MATCHED = MATCHED_CONTAINERS["q4_0"]  # ours as its all-Q4_0 file: int4 dense records too (convert --dense int4)
BUSY_MACHINE = 0.25  # others' share of the CPU during a llama.cpp row above which the bench warns


class RaceSettings(Protocol):
    """The bench settings the race reads (suite.BenchSettings)."""

    @property
    def shape(self) -> StressShape: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def prefill_tokens(self) -> int: ...
    @property
    def prefill_activations(self) -> str | None: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def llama_cpp_budgets_pct(self) -> tuple[int, ...]: ...
    @property
    def alternation_rounds(self) -> int: ...
    @property
    def alternation_tokens(self) -> int: ...


class RaceHost(Protocol):
    """What the race takes from the bench (suite.Bench): its model, budgets, limits and log."""

    @property
    def settings(self) -> RaceSettings: ...

    work: Path
    hf: Path
    llama_cpp_dir: Path
    results: dict

    @property
    def log(self) -> Callable[[str], None]: ...
    @property
    def threads(self) -> int: ...
    def ram_bytes(self, pct: int) -> int: ...
    def limit(self, pct: int) -> MemoryLimit: ...
    def inputs(self, seed: int = 0) -> RunInputs: ...
    def convert_container(self, experts: str, dense: str = "bf16") -> Path: ...


@dataclass
class LlamaCppRace:
    host: RaceHost
    matched: dict[str, Path] = field(default_factory=dict)  # our quality-matched containers by name

    def run(self) -> dict:
        """The section's results: every row, budget by budget, and the files' facts."""
        host, files = self.host, self.prepare()
        context = host.settings.prompt_tokens
        matched: list[dict] = []
        rows: list[dict] = []
        failed: list[dict] = []
        # budget by budget, ours then llama.cpp's rows: the ratios compare rows minutes apart, not the whole
        # section apart (this machine's memory speed was seen to move by 1.5x within the hour)
        prefill: tuple[list[dict], list[dict]] = ([], [])
        same_limit: list[dict] = []
        for pct in host.settings.llama_cpp_budgets_pct:
            matched += self._matched_rows(pct)
            same_limit += self._same_limit_rows(pct)
            for kind in FILE_KINDS:
                self._file_rows(files[kind], kind, pct, rows, failed)
            self.prefill_rows(pct, files, prefill, failed)
        alternated = self.alternated_rows(files, rows, failed)
        busy = [r["name"] for r in rows if (r["other_cpu_share"] or 0) > BUSY_MACHINE]
        if busy:
            host.results["warnings"].append(
                f"other processes used over {BUSY_MACHINE:.0%} of the CPU during {len(busy)} of {len(rows)} llama.cpp "
                'rows (see "others\' CPU"): its spinning OpenMP threads make it collapse on a busy machine, so '
                "those ratios measure the machine, not the runtimes; rerun on an idle machine"
            )
        return {
            "threads": host.threads,
            "ours_matched": matched,
            "matched_containers": {label: str(path) for label, path in self.matched.items()},  # for the limit line
            "ours_same_limit": same_limit,
            "files": {kind: {"path": str(path)} | gguf_facts(path, context) for kind, path in files.items()},
            "rows": rows,
            "failed": failed,
            "prefill": {"ours": prefill[0], "rows": prefill[1]},
            "alternated": alternated,
        }

    def prepare(self) -> dict[str, Path]:
        """llama.cpp's files of the bench model and our quality-matched containers (each made once in --work)."""
        host = self.host
        files = prepare_gguf_files(host.hf, host.work, host.llama_cpp_dir, host.threads, host.log, sys.stderr.isatty())
        self.matched = {
            INT8_MATCHED: host.convert_container("int4", dense="int8"),
            INT4_MATCHED: host.convert_container("int4", dense="int4"),
        }
        return files

    def _file_rows(self, gguf: Path, kind: str, pct: int, rows: list[dict], failed: list[dict]) -> None:
        """One file's rows at one budget (mmap, and at 100% repacked; cold, then warm) into ``rows``."""
        host = self.host
        for _, repack, cold in llama_cpp_grid((pct,)):
            name = f"llama.cpp {kind} {pct}% {'repacked' if repack else 'mmap'} {'cold' if cold else 'warm'}"
            host.log(f"6/7 {name}")
            try:
                rows.append(
                    run_llama_cpp_contender(gguf, kind, pct, repack, cold, host.inputs(), host.limit(pct), host.threads)
                )
            except ContenderFailed as exc:  # e.g. killed at its memory limit: a result, not a crash
                failed.append({"name": name, "error": str(exc)})
                host.results["warnings"].append(f"{name} failed: {exc}")

    def prefill_rows(
        self, pct: int, files: dict[str, Path], into: tuple[list[dict], list[dict]], failed: list[dict]
    ) -> None:
        """A long prompt's first token, ours (the int8 path; its prompts as tile GEMMs where the CPU has them) and
        each llama.cpp file's, at one budget."""
        host = self.host
        n = host.settings.prefill_tokens
        prompt = random_prompt_ids(host.settings.shape.vocab_size, n, 11)
        inputs = RunInputs(prompt, PREFILL_NEW_TOKENS, host.settings.timeout_s)
        host.log(f"6/7 prefill: a {n}-token prompt at {pct}%")

        activations = host.settings.prefill_activations or ("int8-tiles" if tiles_fast() else "int8")

        def ours(cold: bool) -> dict:
            config = OurConfig(pct, container=INT8_MATCHED, activations=activations, cold=cold)
            return run_ours(self.matched[INT8_MATCHED], config, host.ram_bytes(pct), inputs, host.limit(pct))

        into[0].extend(our_prefill_rows(n, ours))
        for kind in FILE_KINDS:

            def theirs(repack: bool, cold: bool, kind: str = kind) -> dict:
                limit = host.limit(pct)
                return run_llama_cpp_contender(files[kind], kind, pct, repack, cold, inputs, limit, host.threads)

            into[1].extend(llama_cpp_prefill_rows(pct, n, theirs, f"prefill {n} llama.cpp {kind} {pct}%", failed))

    def alternated_rows(self, files: dict[str, Path], grid: list[dict], failed: list[dict]) -> list[dict]:
        """Ours (quality-matched, warm) and llama.cpp's fastest warm mode of each file in the ``grid``'s rows at
        100% (repacked where it runs), round after round."""
        if ALTERNATED_BUDGET not in self.host.settings.llama_cpp_budgets_pct:
            return []
        rows: list[dict] = []
        for kind in FILE_KINDS:
            repack = fastest_warm_mode(grid, kind, ALTERNATED_BUDGET)
            try:
                rows += [] if repack is None else self._alternated_pair(kind, files[kind], repack)
            except ContenderFailed as exc:  # e.g. killed at its memory limit: a result, not a crash
                failed.append({"name": f"alternated {kind} {ALTERNATED_BUDGET}%", "error": str(exc)})
        return rows

    def _alternated_pair(self, kind: str, gguf: Path, repack: bool) -> list[dict]:
        host, pct = self.host, ALTERNATED_BUDGET
        settings = host.settings
        inputs = RunInputs(host.inputs().ids, settings.alternation_tokens, settings.timeout_s)
        config = OurConfig(pct, container=MATCHED_CONTAINERS[kind], activations="int8", cold=False)
        mode = "repacked" if repack else "mmap"
        host.log(f"6/7 {config.name} and llama.cpp {kind} {mode}, {settings.alternation_rounds} rounds")
        limit = host.limit(pct)
        ours = partial(run_ours, self.matched[config.container], config, host.ram_bytes(pct), inputs, limit)
        theirs = partial(run_llama_cpp_contender, gguf, kind, pct, repack, False, inputs, limit, host.threads)
        return alternated_rows(kind, settings.alternation_rounds, ours, theirs)

    def _matched_rows(self, pct: int) -> list[dict]:
        """Ours as llama.cpp computes, at one budget, cold then warm: int4 experts, int8 activations and int8
        dense records (its Q4_0-experts + Q8_0 file with Q8 activations), then int4 dense records (its
        all-Q4_0 file)."""
        configs = [
            OurConfig(pct, container=container, activations="int8", cold=cold)
            for container in self.matched
            for cold in (True, False)
        ]
        return self._our_rows(configs)

    def _same_limit_rows(self, pct: int) -> list[dict]:
        """Below 100%: ours quality-matched, cold, with `--ram auto` (what `run` does without --ram) in the
        budget's memory limit. The rows above give our store ``pct`` of the expert bytes and leave the rest
        of the limit unused; llama.cpp's page cache takes the whole limit. Here ours takes what the limit
        leaves after its dense part, KV and activations (planning/machine_memory.py reads the limit)."""
        if pct >= 100:
            return []
        return self._our_rows(
            [OurConfig(pct, container=container, activations="int8", auto_ram=True) for container in self.matched]
        )

    def _our_rows(self, configs: list[OurConfig]) -> list[dict]:
        """Each config's run of its matched container, with the bench's prompt in its budget's limit."""
        host, rows = self.host, []
        for config in configs:
            host.log(f"6/7 {config.name}")
            pct = config.budget_pct
            path = self.matched[config.container]
            rows.append(run_ours(path, config, host.ram_bytes(pct), host.inputs(), host.limit(pct)))
        return rows
