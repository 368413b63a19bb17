"""The fuzz surfaces of state between runs (colibri_stream/devtools/fuzz/scenarios.py) find what they are
for: each scenario is run here in this process on a build with a planted bug (a cut-back that loses the
acknowledged records, a resume from the wrong values) and must judge it BAD; on the real build the same
cases pass. The judge's new verdicts and its link-aware containment check are tested directly.
(tests/test_fuzz/test_fuzz_short.py runs every surface, these included, on derandomized cases.)"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from colibri_stream.devtools.fuzz import bases, scenarios
from colibri_stream.devtools.fuzz.child import _where
from colibri_stream.devtools.fuzz.disks import DiskUnavailable, Tmpfs
from colibri_stream.devtools.fuzz.harness import BAD_LOST, BAD_RESUME, SCENARIO_BAD_EXIT, Case, judge


@pytest.fixture
def case_dir(tiny_checkpoints, make_container, tmp_path, monkeypatch) -> Path:
    """A scenario's case directory (the fuzz base's ckpt and container); the cwd comes back after."""
    shutil.copytree(tiny_checkpoints[bases.FAMILY], tmp_path / "ckpt")
    shutil.copytree(make_container(bases.FAMILY), tmp_path / "container")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _scenario(function, case: Path, params: dict, capsys) -> tuple[int, str]:
    status = function(str(case), json.dumps(params), str(case / "canary"))
    return status, capsys.readouterr().err


STATE = {
    "first": {"--ram": "50%"},
    "second": {"--ram": "100%"},
    "extend": True,
    "extra": [11, 12, 13, 14, 15, 16, 17, 18],
}


def test_state_change_passes_a_value_neutral_change_and_catches_a_wrong_resume(case_dir, capsys, monkeypatch):
    status, err = _scenario(scenarios.state_change, case_dir, STATE, capsys)
    assert status == 0, err  # a budget changes where experts are read from, never a token
    from colibri_stream.runtime.kv import logs as session_logs

    real = session_logs.cache_from_payloads
    monkeypatch.setattr(  # the planted bug: a resume that restores other values than were logged
        session_logs, "cache_from_payloads", lambda payloads, *a: real(np.zeros_like(payloads), *a)
    )
    shutil.rmtree(case_dir / "kv-a")
    shutil.rmtree(case_dir / "kv-r")
    status, err = _scenario(scenarios.state_change, case_dir, STATE, capsys)
    assert status == SCENARIO_BAD_EXIT and f"BAD {BAD_RESUME}: turn 2 under" in err, err


def test_state_change_compares_a_reset_turn_with_a_fresh_one(case_dir, capsys):
    """A turn 2 under --reset is computed whole, so the reference is that turn alone in a fresh session,
    even in bfloat16 (the fuzz run found the reference resuming a bfloat16 turn 1 instead: a false BAD)."""
    from colibri_stream import cli

    shutil.rmtree(case_dir / "container")  # the fuzz base's container: converted with convert's defaults
    assert cli.main(["convert", "ckpt", "container", "--no-progress"]) == 0
    capsys.readouterr()
    flags = {"--kv-dtype": "bfloat16", "--activations": "int8"}
    reset = {"first": flags, "second": {**flags, "--reset": "yes"}, "extend": True, "extra": [47, 17, 52, 1]}
    status, err = _scenario(scenarios.state_change, case_dir, reset, capsys)
    assert status == 0, err


def test_state_change_catches_a_prefix_block_restored_under_other_flags(case_dir, capsys, monkeypatch):
    """A long turn 1 leaves a prefix-cache block; a reset turn 2 under other activations must compute it
    anew. The planted bug: blocks namespaced without the state (compute dtype, activation path)."""
    from colibri_stream.runtime.kv import prefix_cache

    change = {
        "first": {"--dtype": "bfloat16"},
        "second": {"--dtype": None, "--reset": "yes"},
        "extend": True,
        "long": True,
        "extra": [47, 17, 52, 1],
    }
    status, err = _scenario(scenarios.state_change, case_dir, change, capsys)
    assert status == 0, err
    real = prefix_cache.Namespace.of
    monkeypatch.setattr(
        prefix_cache.Namespace, "of", lambda fingerprint, geometry, state: real(fingerprint, geometry, {})
    )
    shutil.rmtree(case_dir / "kv-a")
    shutil.rmtree(case_dir / "kv-r")
    status, err = _scenario(scenarios.state_change, case_dir, change, capsys)
    assert status == SCENARIO_BAD_EXIT and f"BAD {BAD_RESUME}: turn 2 under" in err, err


FULL = {"size_kib": 2048, "leave": 0, "what": "kv", "sync_every": 0, "extra": [1, 2, 3, 4, 5, 6, 7, 8, 9]}


def test_full_disk_refuses_cleanly_and_catches_a_lost_turn(case_dir, capsys, monkeypatch):
    try:
        Tmpfs("64k").close()
    except DiskUnavailable as exc:
        pytest.skip(f"no tmpfs to fill: {exc}")
    status, err = _scenario(scenarios.full_disk, case_dir, FULL, capsys)
    assert status == 1 and "no space left" in err and len(err.strip().splitlines()) == 1, err  # turn 2, typed
    import storage.kv.log

    monkeypatch.setattr(storage.kv.log, "_cut_back", lambda fd, size: os.ftruncate(fd, 4096))  # drops every record
    status, err = _scenario(scenarios.full_disk, case_dir, FULL, capsys)
    assert status == SCENARIO_BAD_EXIT and f"BAD {BAD_LOST}: the acknowledged turn's prompt resumed with" in err, err
    assert not [line for line in os.popen("mount").read().splitlines() if str(case_dir) in line]  # unmounted


def test_the_judge_reads_a_scenarios_verdicts(tmp_path):
    case = Case("state-change", str(tmp_path), [{}], ["--dtype"], kind="call", target="m:f")
    for kind in (BAD_RESUME, BAD_LOST):
        verdict = judge(case, {"exit": SCENARIO_BAD_EXIT, "stderr": f"BAD {kind}: what differed\n", "paths": []})
        assert verdict.bad and verdict.judgement == kind and verdict.detail == "what differed"
    refused = judge(case, {"exit": 1, "stderr": "colibri-stream run: error: made with --dtype x\n", "paths": []})
    assert not refused.bad and refused.judgement == "typed"
    skipped = judge(case, {"exit": 5, "stderr": "skipped: no tmpfs (needs root)\n", "paths": []})
    assert not skipped.bad and skipped.judgement == "skipped"


def test_containment_follows_a_link_only_where_the_event_does(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "case").mkdir()
    (tmp_path / "case" / "link").symlink_to(tmp_path / "outside" / "secret")
    cwd = str(tmp_path / "case")
    assert _where(cwd, "link", follows=True) == str(tmp_path / "outside" / "secret")  # an open that follows
    assert _where(cwd, "link", follows=False) == str(tmp_path / "case" / "link")  # O_NOFOLLOW, unlink


def test_concurrent_catches_a_turn_missing_from_the_transcript(tmp_path, monkeypatch):
    """The concurrent scenario's check: a turn a process acknowledged that the transcript lacks (the
    other process wrote its transcript over it) is BAD lost-turn, before the KV log is even read."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kv").mkdir()
    talk = [("hello", "hi"), ("b0", "ok")]  # process a answered a0, then b replaced the transcript
    messages = [{"role": r, "content": c} for user, answer in talk for r, c in (("user", user), ("assistant", answer))]
    (tmp_path / "kv" / "talk.chat.json").write_text(json.dumps({"messages": messages}))
    with pytest.raises(scenarios.Verdict) as found:
        scenarios._check_transcript_and_log({"a": ["a0"], "b": ["b0"]})
    assert found.value.status == SCENARIO_BAD_EXIT and found.value.text.startswith(f"BAD {BAD_LOST}: transcript has")
