"""`colibri-stream container spread|gather|parts|mirror` and `plan` on a spread container, through main()."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colibri_stream.cli import main
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_container
from storage.container.parts import PARTS_FILE
from storage.container.reader import Container
from storage.tiers.config import StoreConfig


@pytest.fixture
def model(stream_container, tmp_path) -> Path:
    dst = tmp_path / "model.cstream"
    shutil.copytree(stream_container, dst)
    return dst


def _history(path: Path, out: Path) -> Path:
    container = Container(path)
    loaded = load_container(path, store=StoreConfig(ram_bytes=container.expert_bytes, history_path=out))
    try:
        generate(loaded.model, [3, 5, 7, 11, 13, 17], 8, loaded.experts)
        loaded.experts.end_turn()
    finally:
        loaded.experts.close()
    return out


def test_spread_parts_plan_and_gather(model, tmp_path, capsys):
    part = tmp_path / "ssd2"
    assert main(["container", "spread", str(model), "--to", f"{part}:3", "--home-weight", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["parts"] == 2 and result["records_copied"] > 0
    assert main(["container", "parts", str(model), "--json"]) == 0
    parts = json.loads(capsys.readouterr().out)
    total = parts[0]["records"] + parts[1]["records"]
    assert parts[1]["dir"] == str(part) and parts[1]["records"] == pytest.approx(total * 3 / 4, abs=1)
    assert main(["verify", str(model)]) == 0
    capsys.readouterr()
    args = ["plan", str(model), "--ram", "25%", "--memory-bandwidth", "10GB", "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    devices = plan["devices"]
    assert [d["directory"] for d in devices] == [str(model), str(part)]
    per_token = sum(d["bytes_per_token_at_zero_hits"] for d in devices)
    assert per_token == pytest.approx(plan["bytes_per_token_at_zero_hits"])
    assert plan["speed"]["disk_method"] == "2 devices"
    assert main(["container", "gather", str(model)]) == 0
    assert not (model / PARTS_FILE).exists()


def test_mirror_plan_stage_verify(model, tmp_path, capsys):
    history = _history(model, tmp_path / "history.json")
    hot = tmp_path / "hot"
    base = ["--history", str(history), "--to", f"{hot}:1", "--home-weight", "1", "--json"]
    assert main(["container", "mirror", "plan", str(model), *base]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["copies"] > 0 and plan["expected_gain"] > 1.5
    assert not (model / PARTS_FILE).exists()  # a plan moves nothing
    assert main(["container", "mirror", "stage", str(model), *base]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1])["records_copied"] == plan["copies"]
    assert main(["container", "mirror", "verify", str(model)]) == 0
    assert f"{plan['copies']} mirrored records, ok" in capsys.readouterr().out


def test_missing_part_directory_is_one_line_and_exit_1(model, tmp_path, capsys):
    part = tmp_path / "ssd2"
    assert main(["container", "spread", str(model), "--to", f"{part}:1", "--home-weight", "1"]) == 0
    capsys.readouterr()
    shutil.rmtree(part)
    assert main(["run", str(model), "--ids", "1,2,3", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"part directory {part} is missing" in err
    assert main(["verify", str(model)]) == 1
    assert str(part) in capsys.readouterr().err


def test_bad_flags_are_one_line(model, capsys):
    assert main(["container", "spread", str(model), "--to", "/x:fast"]) == 1
    assert "weight 'fast'" in capsys.readouterr().err
    assert main(["container", "spread", str(model), "--to", "/x:1", "--share", "140%"]) == 1
    assert "--share" in capsys.readouterr().err
    assert main(["container", "mirror", "plan", str(model)]) == 1
    assert "needs --history" in capsys.readouterr().err


def test_dashboard_shows_each_devices_reads(make_container, tmp_path, capsys):
    """/api/stats of a server over a spread container lists every device with the reads it served (the
    tiny deepseek_v3 fixture: a server needs its tokenizer)."""
    from colibri_stream.planning.budget import StoreOptions
    from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, load_runtime, run_turn
    from colibri_stream.serve.app import Server
    from colibri_stream.serve.dashboard import Dashboard

    model, part = tmp_path / "tiny.cstream", tmp_path / "ssd2"
    shutil.copytree(make_container("deepseek_v3"), model)
    assert main(["container", "spread", str(model), "--to", f"{part}:1", "--home-weight", "1"]) == 0
    capsys.readouterr()
    options = RuntimeOptions(kv_dir=tmp_path / "kv", model_id="m", store=StoreOptions(ram="40%", preload=False))
    runtime = load_runtime(model, options)
    try:
        result = run_turn(runtime, [5, 9, 17, 33], TurnOptions(max_new_tokens=4))
        answer = Dashboard(Server(runtime)).stats()
    finally:
        runtime.close()
    devices = answer["devices"]
    assert [d["device"] for d in devices] == [str(model), str(part)]
    assert all(d["reads"] > 0 and d["bytes_read"] == d["reads"] * Container(model).layout.record_bytes for d in devices)
    assert sum(d["reads"] for d in devices) == result.stats["reads"]


def test_convert_spread_converts_then_spreads(tiny_checkpoints, tmp_path, capsys):
    dst, part = tmp_path / "out.cstream", tmp_path / "ssd2"
    argv = ["convert", str(tiny_checkpoints["deepseek_v3"]), str(dst), "--no-progress", "--spread", f"{part}:1"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    container = Container(dst)
    assert container.parts is not None and report["spread"]["parts"] == 2
    home, other = container.parts.primary_counts()  # DIR:1: as many as the measured home directory keeps
    assert abs(home - other) <= 1 and other > 0
    assert main(["verify", str(dst)]) == 0


# ------------------------------------------------------------------------------------ weights, lock
def _parts(model: Path, capsys) -> list[dict]:
    capsys.readouterr()
    assert main(["container", "parts", str(model), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_plain_weight_is_a_multiple_of_the_measured_home_weight(model, tmp_path, capsys):
    """DIR:1 against the container directory's measured speed (bytes/s): about half the records move
    (they were unitless against ~1e9 before, so none did)."""
    part = tmp_path / "ssd2"
    assert main(["container", "spread", str(model), "--to", f"{part}:1", "--probe-seconds", "0.05"]) == 0
    home, other = _parts(model, capsys)
    assert home["weight"] > 1e3 and other["weight"] == home["weight"]  # one unit: bytes/s, both
    assert other["primary_records"] > 0 and abs(home["primary_records"] - other["primary_records"]) <= 1


def test_weights_of_two_kinds_are_refused_in_one_line(model, tmp_path, capsys):
    part = tmp_path / "ssd2"
    for to in (f"{part}", f"{part}:2GB"):  # measured, or a speed, against a plain --home-weight
        assert main(["container", "spread", str(model), "--to", to, "--home-weight", "1"]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(part) in err and "plain ratio" in err
    assert not part.exists() and not (model / PARTS_FILE).exists()


def test_a_part_that_would_get_no_record_is_an_error(model, tmp_path, capsys):
    part = tmp_path / "ssd2"
    argv = ["container", "spread", str(model), "--to", f"{part}:2KB", "--home-weight", "2GB"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(part) in err and "too little for one of the" in err
    assert not part.exists() and not (model / PARTS_FILE).exists()  # nothing was copied or listed


HOLDER = """
import sys, time
from pathlib import Path
from storage.container.reader import Container
from storage.container.spread import apply_layout, spread_layout
path, part, ready, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
def progress(n):  # after its first record: say so, then wait (bounded) for the test's word
    if not ready.exists():
        ready.touch()
        for _ in range(1200):
            if go.exists():
                return
            time.sleep(0.05)
container = Container(path)
apply_layout(container, spread_layout(container, [(part, 1.0)], 1.0), progress=progress, batch_records=4)
"""


def test_a_second_spread_is_refused_while_one_runs(model, tmp_path, capsys):
    """Two spreads of one container: while the first holds the lock (paused after its first record),
    the second is refused in one line naming the lock and its holder, copies nothing, and the first
    finishes to a verified container; afterwards the second runs."""
    first, second, ready, go = (tmp_path / n for n in ("ssd2", "ssd3", "ready", "go"))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(model), str(first), str(ready), str(go)])
    try:
        for _ in range(1200):  # bounded: the holder's first record (every wait here ends on an event)
            if ready.exists() or holder.poll() is not None:
                break
            time.sleep(0.05)
        assert ready.exists(), "the first spread never copied a record"
        assert main(["container", "spread", str(model), "--to", f"{second}:1", "--home-weight", "1"]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert f"{model / 'spread.lock'}: held by pid {holder.pid}" in err
        assert main(["container", "gather", str(model)]) == 1  # any layout change waits its turn
        assert "spread.lock" in capsys.readouterr().err
    finally:
        go.touch()
        assert holder.wait(timeout=120) == 0
    assert not second.exists()  # the refused spread copied nothing
    assert main(["verify", str(model)]) == 0
    assert [p["dir"] for p in _parts(model, capsys)] == [str(model), str(first)]
    assert main(["container", "spread", str(model), "--to", f"{second}:1", "--home-weight", "1"]) == 0
    assert main(["verify", str(model)]) == 0
