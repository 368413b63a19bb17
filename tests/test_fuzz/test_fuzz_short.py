"""The short, reproducible fuzz run of CI (docs/fuzzing.md): a few derandomized cases per input
surface, all in one memory-limited worker child (and one `serve` child for HTTP). The property: every
case ends with the correct result or one typed error line — never a traceback, a hang, the memory
limit, a dead child, or a path outside the case's inputs. `tools/fuzz.py --minutes N` is the long run."""

from __future__ import annotations

import pytest

from colibri_stream.devtools.fuzz import bases
from colibri_stream.devtools.fuzz.harness import TYPED, Case, Worker, judge
from colibri_stream.devtools.fuzz.http_surface import ServedModel, fuzz_http
from colibri_stream.devtools.fuzz.runner import Report, format_report, open_run
from colibri_stream.devtools.fuzz.surfaces import SURFACES

CASES_PER_SURFACE = 4
HTTP_CASES = 8


@pytest.fixture(scope="module")
def fuzzed(tiny_checkpoints, make_container, tmp_path_factory) -> Report:
    root = tmp_path_factory.mktemp("fuzz")
    fuzzer = open_run(root, tiny_checkpoints[bases.FAMILY], make_container(bases.FAMILY))
    try:
        for name in SURFACES:
            fuzzer.fuzz(name, CASES_PER_SURFACE, derandomize=True)
    finally:
        fuzzer.worker.stop()
    served = ServedModel(fuzzer.base / "ckpt", root / "http")
    try:
        fuzz_http(served, fuzzer.report, HTTP_CASES, derandomize=True)
    finally:
        served.stop()
    print(format_report(fuzzer.report))
    return fuzzer.report


@pytest.mark.parametrize("surface", [*SURFACES, "http"])
def test_no_hostile_input_gets_through(fuzzed, surface):
    assert sum(fuzzed.counts.get(surface, {}).values()) > 0, f"no {surface} case ran"
    bad = [f.summary() for f in fuzzed.bad() if f.case.surface == surface]
    assert not bad, "\n".join(bad)


def test_the_judge_tells_typed_lines_from_tracebacks(tmp_path):
    """The harness itself: a clean run, a typed one-line error and a traceback are told apart, and a
    path outside the case directory is caught (here: the command reads a file beside it)."""
    (tmp_path / "case").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "config.json").write_text("{}")
    worker = Worker()
    try:
        verdicts = [
            judge(case, worker.run(case))
            for case in (
                Case("t", str(tmp_path / "case"), [], ["nothing"], argv=["plan", "../elsewhere/config.json"]),
                Case("t", str(tmp_path / "case"), [], ["nothing"], argv=["plan", "missing/config.json"]),
                Case("t", str(tmp_path / "case"), [], [], kind="call", target="json:loads", args=["{"]),
            )
        ]
    finally:
        worker.stop()
    assert verdicts[0].judgement == "path-outside", verdicts[0]
    assert verdicts[1].judgement in (TYPED, "typed-unnamed") and ": error: " in verdicts[1].detail, verdicts[1]
    assert verdicts[2].judgement == "traceback" and "JSONDecodeError" in verdicts[2].detail, verdicts[2]
