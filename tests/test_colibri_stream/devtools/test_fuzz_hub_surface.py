"""The Hub-responses fuzz surface (colibri_stream/devtools/fuzz/hub_surface.py) finds what it is for: hostile
Hub answers end in one line and a rerun against the honest Hub finishes; a build with a planted bug (a
download that writes past the listed size) is judged BAD over-listing. (tests/test_fuzz/test_fuzz_short.py
runs the surface on derandomized cases with the others.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from colibri_stream.convert import pull_http, pull_hub
from colibri_stream.devtools.fuzz import hub_surface
from colibri_stream.devtools.fuzz.harness import BAD_LISTING, SCENARIO_BAD_EXIT


def _params(*faults: dict, ignore_range: bool = False) -> dict:
    return {"faults": list(faults), "ignore_range": ignore_range, "stall_s": 0.3, "min_rate": "2M"}


def _run(tmp_path: Path, params: dict, capsys) -> tuple[int, str]:
    """The scenario in this process; a fault's file given by name here is the index the surface draws."""
    names = sorted(hub_surface._repo().files)
    params = {**params, "faults": [{**f, "file": names.index(f["file"])} for f in params["faults"]]}
    case = tmp_path / "case"
    case.mkdir()
    status = hub_surface.hub_responses(str(case), json.dumps(params), str(tmp_path / "canary"))
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    "params",
    [
        _params({"fault": "oversize", "file": "model-00005-of-00015.safetensors", "extra": None}, ignore_range=True),
        _params(
            {"fault": "oversize", "file": "config.json", "extra": None},
            {"fault": "listed", "file": "config.json", "value": None},
        ),
        _params({"fault": "drip", "file": "model-00002-of-00015.safetensors", "seconds": 0.3}),
        _params({"fault": "redirect", "file": "tokenizer.json", "to": "garbage"}),
        _params({"fault": "listed", "file": "model-00003-of-00015.safetensors", "value": "plus-one"}),
    ],
    ids=["endless-shard-no-range", "endless-unlisted-config", "drip", "garbage-redirect", "listed-plus-one"],
)
def test_hostile_answers_are_refused_in_one_line_and_the_rerun_finishes(params, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, err = _run(tmp_path, params, capsys)
    errors = [line for line in err.splitlines() if ": error: " in line]  # (the fixture's build prints progress)
    assert status == 1 and "BAD " not in err and "Traceback" not in err and len(errors) == 1, err


def test_a_download_past_its_listed_size_is_judged_over_listing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    real = pull_http.copy_body

    def unbounded(response, out, skip, room, clock, on_bytes):  # the planted bug: the listing's bound ignored
        copied = real(response, out, skip, 1 << 40, clock, on_bytes)
        # the oversized file held a moment before pull's own size check deletes it: the judge samples the
        # directory every 5 ms, and on a busy machine its thread could miss a file that lived for less
        time.sleep(0.5)
        return copied

    monkeypatch.setattr(pull_http, "copy_body", unbounded)
    params = _params({"fault": "oversize", "file": "model-00005-of-00015.safetensors", "extra": 1 << 20})
    status, err = _run(tmp_path, params, capsys)
    assert status == SCENARIO_BAD_EXIT and f"BAD {BAD_LISTING}: the download directory held" in err, err


def test_the_surface_bounds_are_pulls_own():
    assert (hub_surface.SIDE_FILE_CAP, hub_surface.MAX_FILE_BYTES) == (pull_hub.SIDE_FILE_CAP, pull_hub.MAX_FILE_BYTES)
