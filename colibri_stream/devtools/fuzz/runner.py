"""Drive the surfaces with hypothesis: draw an edit, build the case, run it in the worker, judge it,
keep what is BAD. The property is checked by the caller (the CI test asserts no finding; the long
runner prints them): hypothesis only generates here, so one run collects every distinct finding
instead of stopping at the first."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from colibri_stream.devtools.fuzz.canary import CanaryWatch
from colibri_stream.devtools.fuzz.harness import BAD_PATH, Case, Verdict, Worker, judge, run_isolated
from colibri_stream.devtools.fuzz.surfaces import SURFACES


@dataclass
class Finding:
    case: Case
    verdict: Verdict
    repro_dir: Path | None = None
    confirmed: str = ""  # the judgement of the fresh-interpreter rerun, when one was made

    def summary(self) -> str:
        return (
            f"[{self.case.surface}] {self.verdict.judgement}: {self.verdict.detail}\n"
            f"    mutation: {json.dumps(self.case.mutation)[:400]}\n"
            f"    command (in {self.repro_dir or self.case.cwd}): {self.case.command()}"
        )


@dataclass
class Report:
    counts: dict[str, Counter] = field(default_factory=dict)  # surface -> judgement -> cases
    findings: dict[str, Finding] = field(default_factory=dict)  # signature -> smallest finding

    def add(self, case: Case, verdict: Verdict) -> None:
        self.counts.setdefault(case.surface, Counter())[verdict.judgement] += 1
        if not verdict.bad:
            return
        size = len(json.dumps(case.mutation))
        kept = self.findings.get(verdict.signature)
        if kept is None or size < len(json.dumps(kept.case.mutation)):
            self.findings[verdict.signature] = Finding(case, verdict)

    def bad(self) -> list[Finding]:
        return list(self.findings.values())


class Fuzzer:
    """One run's state: the base inputs, the canary watch, the worker and the report."""

    def __init__(self, root: Path, base: Path, worker: Worker):
        self.root, self.base, self.worker = root, base, worker
        self.canary = str(root / "outside" / "canary")
        self.watch = CanaryWatch(root / "outside")
        self.report = Report()
        self._serial = 0

    def run_case(self, surface_name: str, drawn: dict) -> Verdict:
        surface = SURFACES[surface_name]
        self._serial += 1
        case_dir = self.root / "cases" / f"{surface_name}-{self._serial:06d}"
        case = surface.prepare(self.base, case_dir, drawn, self.canary)
        self.watch.touched()  # forget the parent's own reads
        result = self.worker.run(case)
        verdict = judge(case, result, extra_roots=self.worker.scratch_roots())
        if self.watch.touched():  # first: an escape often ends in a traceback too (the canary is no model file)
            detail = f"opened a canary file outside the inputs (then: {verdict.judgement} {verdict.detail[:150]})"
            verdict = Verdict(BAD_PATH, detail, f"{surface_name}:{BAD_PATH}", result)
        self.report.add(case, verdict)
        if not verdict.bad:
            shutil.rmtree(case_dir, ignore_errors=True)
        return verdict

    def tmp_root(self) -> str:
        return str(self.root / "tmp")

    def fuzz(self, surface_name: str, examples: int, seed: int | None = None, derandomize: bool = False) -> None:
        """``examples`` cases of one surface (derandomize: the same cases every run, for CI)."""

        @settings(
            max_examples=examples,
            database=None,
            derandomize=derandomize,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(SURFACES[surface_name].draw())
        def one(drawn):
            self.run_case(surface_name, drawn)

        if seed is not None and not derandomize:
            one = hypothesis_seed(seed)(one)
        one()

    def confirm_and_save(self, directory: Path, confirm: bool = True) -> None:
        """Rerun every finding in a fresh interpreter (``confirm``) and copy its inputs and repro.json."""
        directory.mkdir(parents=True, exist_ok=True)
        for n, finding in enumerate(self.report.bad()):
            if confirm:
                env = {"TMPDIR": self.tmp_root(), "HOME": finding.case.cwd + "/home"}
                again = run_isolated(finding.case, env=env)
                finding.confirmed = judge(finding.case, again, extra_roots=(self.tmp_root(),)).judgement
            target = directory / f"{n:03d}-{finding.case.surface}-{finding.verdict.judgement}"
            if Path(finding.case.cwd).exists():
                shutil.copytree(finding.case.cwd, target / "inputs", symlinks=True, copy_function=_copy_small)
            finding.repro_dir = target / "inputs"
            (target / "repro.json").write_text(
                json.dumps(
                    {
                        "surface": finding.case.surface,
                        "judgement": finding.verdict.judgement,
                        "confirmed_in_fresh_process": finding.confirmed,
                        "detail": finding.verdict.detail,
                        "signature": finding.verdict.signature,
                        "mutation": finding.case.mutation,
                        "command": finding.case.command(),
                        "stderr_tail": finding.verdict.result.get("stderr", "")[-3000:],
                        "case": asdict(finding.case),
                    },
                    indent=2,
                    default=str,
                )
            )


def _copy_small(src: str, dst: str) -> None:
    """Copy a repro file, except the huge sparse ones a mutation made (a plain copy would write every
    hole: 1 TiB): those get a note, and the mutation in repro.json recreates them."""
    if not Path(src).is_file():  # a FIFO or device the mutation planted: recreated by the mutation too
        Path(dst + ".SPECIAL").write_text("not a regular file: recreate with the mutation in repro.json\n")
        return
    size = Path(src).stat().st_size
    if size > REPRO_FILE_LIMIT:
        Path(dst + ".TOO-BIG").write_text(f"{size} bytes, mostly holes: recreate with the mutation in repro.json\n")
        return
    shutil.copy2(src, dst)


REPRO_FILE_LIMIT = 64 << 20


def open_run(root: Path, checkpoint: Path | None = None, container: Path | None = None) -> Fuzzer:
    """A fuzz run under ``root``: its worker (TMPDIR and HOME inside ``root/tmp``), the base inputs
    (from ``checkpoint``/``container`` when given, else built) and the canary."""
    from colibri_stream.devtools.fuzz import bases

    scratch = root / "tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    worker = Worker(env={"TMPDIR": str(scratch), "HOME": str(scratch)})
    base = bases.build(root, worker, checkpoint=checkpoint, container=container)
    return Fuzzer(root, base, worker)


def format_report(report: Report) -> str:
    lines = ["cases per surface:"]
    for surface, counts in sorted(report.counts.items()):
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        lines.append(f"  {surface:14s} {sum(counts.values()):5d}  {kinds}")
    findings = report.bad()
    lines.append(f"BAD findings (distinct causes): {len(findings)}")
    lines += [finding.summary() for finding in sorted(findings, key=lambda f: (f.case.surface, f.verdict.signature))]
    return "\n".join(lines)
