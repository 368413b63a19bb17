"""The parent side of a fuzz case: run it in a child under a wall timeout and an address-space limit,
then judge it. A case passes when it ends with the correct result or one typed line; it is BAD when
it prints a traceback, hangs, runs out of memory, dies, or touches a path outside its inputs.

Two executors: ``Worker`` (one long-lived child runs many cases: the CI mode; a hang or crash costs a
restart) and ``run_isolated`` (a fresh interpreter per case: the long runs confirm every finding with
it, and its repro is the plain command line).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MEMORY_LIMIT_BYTES = 3 << 30  # RLIMIT_AS of a child: torch maps ~1.3 GiB of it on import
CASE_TIMEOUT_S = 60.0
REPO_ROOT = Path(__file__).resolve().parents[3]

# Judgements. Only the BAD ones fail the property.
OK, TYPED, USAGE = "ok", "typed", "usage"
UNNAMED = "typed-unnamed"  # a typed line that names neither the mutated file nor its key (reported, not BAD)
LONG_LINE = "typed-long"  # a typed line longer than LONG_LINE_CHARS: it echoes the hostile value (reported)
LONG_LINE_CHARS = 2000
# Commands whose exit 1 lists several problems, one per line, by design.
PROBLEM_LISTS = ("verify", "doctor")
CHATTY = ("chat",)  # commands that print a banner and footers on stderr
BAD_TRACEBACK, BAD_HANG, BAD_MEMORY, BAD_CRASH, BAD_PATH, BAD_LINES, BAD_HTTP = (
    "traceback",
    "hang",
    "memory",
    "crash",
    "path-outside",
    "not-one-line",
    "http",
)
# What a multi-step case (scenarios.py) finds wrong in the state it leaves: a resumed turn whose tokens
# differ from the same turns run with the same flags in a fresh session, an acknowledged turn missing
# from the transcript or the KV log, a write outside the KV directory (canary changed).
BAD_RESUME, BAD_LOST = "wrong-resume", "lost-turn"
# What the Hub-responses surface (hub_surface.py) finds: a download directory that held more than the
# Hub's listing allows, or a pull that the same command against an honest Hub cannot finish afterwards.
BAD_LISTING, BAD_STUCK = "over-listing", "no-recovery"
# A KV pack import that let through values the model does not produce (pack_scenario.py): NaN, infinite,
# huge or random values imported, or tokens changed by a pack that was honest or verified whole.
BAD_POISON = "poisoned"
SCENARIO_BAD_EXIT = 4  # a scenario's exit status when it prints "BAD <kind>: <detail>"
SCENARIO_SKIP_EXIT, SKIPPED = 5, "skipped"  # a scenario this machine cannot run (no root for a mount)
BAD = frozenset(
    {
        BAD_TRACEBACK, BAD_HANG, BAD_MEMORY, BAD_CRASH, BAD_PATH, BAD_LINES, BAD_HTTP, BAD_RESUME, BAD_LOST,
        BAD_LISTING, BAD_STUCK, BAD_POISON,
    }
)  # fmt: skip


@dataclass
class Case:
    """One input to try. ``argv`` is a colibri-stream command (kind "cli") or ``target`` a library
    function "module:function" called with ``args`` (kind "call"). Paths are inside ``cwd``."""

    surface: str
    cwd: str
    mutation: list[Any]  # what was done to the base input, as JSON (the repro)
    mutated: list[str]  # the files the mutation changed, relative to cwd
    kind: str = "cli"
    argv: list[str] = field(default_factory=list)
    target: str = ""
    args: list[Any] = field(default_factory=list)
    stdin: str = ""
    timeout_s: float | None = None  # the worker's CASE_TIMEOUT_S unless the case needs longer (scenarios)

    def command(self) -> str:
        if self.kind == "http":
            return " ".join(_quote(a) for a in self.argv)
        if self.kind == "cli":
            return "python -m colibri_stream " + " ".join(_quote(a) for a in self.argv)
        return f"python -c 'import {self.target.split(':')[0]} as m; m.{self.target.split(':')[1]}(*{self.args!r})'"


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


@dataclass
class Verdict:
    judgement: str
    detail: str  # the one line, the exception's last line, or why it is BAD
    signature: str  # groups findings of one cause: judgement + where it was raised
    result: dict[str, Any]

    @property
    def bad(self) -> bool:
        return self.judgement in BAD


def allowed_roots(case: Case, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Where a case may touch files: its own directory, the interpreter, the source, the OS."""
    roots = {case.cwd, sys.prefix, sys.base_prefix, sys.exec_prefix, str(REPO_ROOT), *extra}
    roots |= {p for p in sys.path if p and os.path.isabs(p) and not p.startswith(tempfile.gettempdir())}
    roots |= {"/proc", "/sys", "/dev", "/etc", "/usr", "/lib", "/lib64", "/opt"}
    return tuple(os.path.realpath(r) for r in roots)


def paths_outside(case: Case, paths: list[str], extra: tuple[str, ...] = ()) -> list[str]:
    roots = allowed_roots(case, extra)
    return [
        p
        for p in paths
        if not any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)
        and not Path(p).name.startswith("torchinductor_")  # torch probes its compile cache in the temp dir
    ]


def judge(case: Case, result: dict[str, Any], extra_roots: tuple[str, ...] = ()) -> Verdict:
    """Classify one finished (or killed) case."""
    if result.get("timeout"):
        return Verdict(BAD_HANG, f"no answer in {result['timeout']} s", f"{case.surface}:{BAD_HANG}", result)
    if result.get("died"):
        return Verdict(BAD_CRASH, result["died"], f"{case.surface}:{BAD_CRASH}:{result['died']}", result)
    stderr = result.get("stderr", "")
    outside = paths_outside(case, result.get("paths", []), extra_roots)
    if outside:
        return Verdict(BAD_PATH, f"touched {outside[0]}", f"{case.surface}:{BAD_PATH}", result)
    if "MemoryError" in stderr:
        return Verdict(BAD_MEMORY, _last_line(stderr), f"{case.surface}:{BAD_MEMORY}:{_raise_site(stderr)}", result)
    code = result["exit"]
    if code == SCENARIO_SKIP_EXIT:
        return Verdict(SKIPPED, _last_line(stderr), f"{case.surface}:{SKIPPED}", result)
    if code == SCENARIO_BAD_EXIT and (found := _scenario_bad(stderr)) is not None:
        kind, detail = found
        return Verdict(kind, detail, f"{case.surface}:{kind}:{detail[:60]}", result)
    if code == 3 or "Traceback (most recent call last)" in stderr:
        where = _raise_site(stderr)
        return Verdict(BAD_TRACEBACK, _exception_line(stderr), f"{case.surface}:{BAD_TRACEBACK}:{where}", result)
    if code == 0:
        return Verdict(OK, "", f"{case.surface}:{OK}", result)
    if code == 2:
        return Verdict(USAGE, _last_line(stderr), f"{case.surface}:{USAGE}", result)
    head, n_lines = result.get("stderr_head", stderr), result.get("stderr_lines", len(stderr.splitlines()))
    command = case.argv[0] if case.kind == "cli" and case.argv else ""
    listed = command in PROBLEM_LISTS
    if command in CHATTY:  # its banner and footers share stderr: judge the error lines only
        n_lines = sum(": error: " in line for line in stderr.splitlines())
        head = next((line for line in stderr.splitlines() if ": error: " in line), head)
    if code != 1 or (n_lines != 1 and not listed) or (": error: " not in head and not listed):
        detail = f"exit {code}, {n_lines} stderr lines: {head.strip()[:300]}"
        return Verdict(BAD_LINES, detail, f"{case.surface}:{BAD_LINES}:{case.argv[:1]}", result)
    line = head.strip().splitlines()[0] if head.strip() else ""
    if result.get("stderr_chars", len(stderr)) > LONG_LINE_CHARS:
        return Verdict(LONG_LINE, line[:300], f"{case.surface}:{LONG_LINE}", result)
    if not _names_the_input(case, stderr):
        return Verdict(UNNAMED, line, f"{case.surface}:{UNNAMED}", result)
    return Verdict(TYPED, line, f"{case.surface}:{TYPED}", result)


def _scenario_bad(stderr: str) -> tuple[str, str] | None:
    """(kind, detail) of a scenario's "BAD <kind>: <detail>" line, if it printed one of a known kind."""
    for line in stderr.splitlines():
        if line.startswith("BAD "):
            kind, _, detail = line[4:].partition(": ")
            if kind in BAD:
                return kind, detail[:300]
    return None


def _names_the_input(case: Case, line: str) -> bool:
    """The error names the file the mutation changed (its name or a parent's), or the key it changed."""
    names = set()
    for rel in case.mutated:
        names |= {part for part in Path(rel).parts if part not in (".", "")}
    keys = {str(step) for op in case.mutation if isinstance(op, dict) for step in op.get("path", [])}
    return any(name in line for name in names | keys)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _exception_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith(("colibri-stream", " "))]
    return lines[-1][:300] if lines else _last_line(stderr)[:300]


def _raise_site(stderr: str) -> str:
    """The innermost frame of the traceback in this repository (file:line function) plus the type."""
    site = "?"
    for line in stderr.splitlines():
        stripped = line.strip()
        if stripped.startswith('File "') and str(REPO_ROOT) in stripped:
            path, _, rest = stripped[6:].partition('", line ')
            site = f"{Path(path).relative_to(REPO_ROOT)}:{rest.replace(', in ', ' ')}"
    kind = _exception_line(stderr).split(":")[0]
    return f"{site} {kind}"


class Worker:
    """One child that runs cases until it hangs or dies (then the next case starts a new one)."""

    def __init__(self, memory_bytes: int = MEMORY_LIMIT_BYTES, timeout_s: float = CASE_TIMEOUT_S, env=None):
        self.memory_bytes, self.timeout_s, self.env = memory_bytes, timeout_s, env
        self.process: subprocess.Popen | None = None
        self.cases_run = 0

    def scratch_roots(self) -> tuple[str, ...]:
        """The worker's own TMPDIR and HOME: where a case may write beside its directory."""
        return tuple(v for k, v in (self.env or {}).items() if k in ("TMPDIR", "HOME"))

    def _start(self) -> None:
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        argv = [sys.executable, "-m", "colibri_stream.devtools.fuzz.child", "--memory-bytes", str(self.memory_bytes)]
        self.process = subprocess.Popen(
            [*argv, "--worker", str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=child_env(self.env),
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""

    def run(self, case: Case) -> dict[str, Any]:
        if self.process is None or self.process.poll() is not None:
            self._start()
        os.write(self._to_child, (json.dumps(asdict(case)) + "\n").encode())
        timeout = case.timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout + (60.0 if self.cases_run == 0 else 0.0)  # first: imports
        self.cases_run += 1
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_child], [], [], max(left, 0))
            if not ready:
                self.stop()
                return {"timeout": timeout}
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                return {"died": self._death()}
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _death(self) -> str:
        assert self.process is not None
        code = self.process.wait(timeout=30)
        tail = self.process.stderr.read().decode(errors="replace")[-300:] if self.process.stderr else ""
        self._close()
        reason = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        return f"child died ({reason}) {tail.strip().splitlines()[-1] if tail.strip() else ''}".strip()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self._close()

    def _close(self) -> None:
        if self.process is not None:
            for fd in (self._to_child, self._from_child):
                try:
                    os.close(fd)
                except OSError:
                    pass
            if self.process.stderr:
                self.process.stderr.close()
        self.process = None


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XDG_CACHE_HOME", None)  # a case's user cache follows the HOME it is given (its scratch)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["MALLOC_ARENA_MAX"] = "2"  # every thread's 64 MiB arena would count against RLIMIT_AS
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TQDM_DISABLE"] = "1"
    env.update(extra or {})
    return env


def run_isolated(
    case: Case, memory_bytes: int = MEMORY_LIMIT_BYTES, timeout_s: float = CASE_TIMEOUT_S, env=None
) -> dict[str, Any]:
    """The case in a fresh interpreter (the repro's own command, with the audit hook)."""
    with tempfile.TemporaryDirectory(prefix="fuzz-case-") as tmp:
        case_file, out = Path(tmp) / "case.json", Path(tmp) / "result.json"
        case_file.write_text(json.dumps(asdict(case)))
        argv = [sys.executable, "-m", "colibri_stream.devtools.fuzz.child", "--memory-bytes", str(memory_bytes)]
        process = subprocess.Popen(
            [*argv, "--case", str(case_file), "--out", str(out)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=child_env(env),
        )
        timeout_s = case.timeout_s or timeout_s
        try:
            _, err = process.communicate(timeout=timeout_s + 30.0)  # +30: the interpreter's imports
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            return {"timeout": timeout_s}
        if not out.exists():
            code = process.returncode
            reason = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            return {"died": f"child died ({reason}) {err.decode(errors='replace').strip()[-200:]}"}
        return json.loads(out.read_text())
