"""`colibri-stream doctor`: the checks it prints, its verdict and its exit status."""

from __future__ import annotations

import json
import shutil

from colibri_stream import cli


def doctor(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["doctor", *argv])
    return code, capsys.readouterr().out


def test_machine_checks_without_a_model(capsys):
    code, out = doctor(capsys)
    for name in ("python", "torch", "kernels", "cuda", "ram", "io", "disk"):
        assert any(line.split()[1:2] == [name] for line in out.splitlines()), (name, out)
    assert out.splitlines()[-1].startswith("verdict: ")
    assert code == (1 if "NOT READY" in out else 0)


def test_a_sound_container_within_budget_is_ready(make_container, capsys):
    code, out = doctor(capsys, str(make_container("deepseek_v3")), "--full", "--ram", "50%")
    lines = {line.split()[1]: line for line in out.splitlines() if not line.startswith("verdict")}
    assert "0 problems, every checksum valid" in lines["container"]
    assert lines["budget"].startswith("ok") and "expert slots" in lines["budget"]
    assert "chat template" in out and "kv" in lines
    assert "page cache bypassed with O_DIRECT" in lines["io"] and "o_direct on" in lines["io"]
    assert "bypassed: experts are read with O_DIRECT" in out  # the model's filesystem takes it
    assert code == 0 and "NOT READY" not in out


def test_a_corrupt_expert_fails_the_verdict(make_container, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(make_container("deepseek_v3"), broken)
    chunk = broken / "experts/layer_001/c/3/0"
    data = bytearray(chunk.read_bytes())
    data[5000] ^= 0x10
    chunk.write_bytes(bytes(data))
    code, out = doctor(capsys, str(broken), "--full", "--json")
    report = json.loads(out)
    assert code == 1 and report["verdict"].startswith("verdict: NOT READY: container")
    assert "layer 1 expert 3: checksum mismatch" in report["verdict"]


def test_a_budget_below_one_layer_fails(make_container, capsys):
    code, out = doctor(capsys, str(make_container("deepseek_v3")), "--ram", "1%")
    assert code == 1 and "NOT READY: budget: does not fit: RAM budget" in out


def test_a_checkpoint_directory_and_a_missing_path(tiny_checkpoints, tmp_path, capsys):
    code, out = doctor(capsys, str(tiny_checkpoints["glm_moe_dsa"]))
    assert code == 0 and "4 layers" in out and "stop ids [1]" in out
    code, out = doctor(capsys, str(tmp_path / "nowhere"))
    assert code == 1 and "not a directory" in out.splitlines()[-1]


def test_the_io_lines_name_what_the_knob_turned_off(make_container, capsys, monkeypatch):
    from storage.files.io_features import IO_FEATURES_ENV

    monkeypatch.setenv(IO_FEATURES_ENV, "-o_direct,-fadvise,-cgroups,-proc")
    code, out = doctor(capsys, str(make_container("deepseek_v3")), "--ram", "50%")
    io = next(line for line in out.splitlines() if line.split()[1:2] == ["io"])
    assert io.startswith("warn") and "no page-cache bypass" in io
    for feature in ("o_direct", "fadvise", "cgroups", "proc"):
        assert f"{feature} off ({IO_FEATURES_ENV})" in io, feature
    assert "f_nocache absent" in io  # Linux has none; the knob cannot turn a feature on
    assert "warn  page cache     no page-cache bypass here" in out and code == 0

    monkeypatch.setenv(IO_FEATURES_ENV, "-odirect")
    code = cli.main(["doctor"])
    printed = capsys.readouterr()
    assert code == 1 and printed.out == ""  # one line on stderr naming the knob (the CLI's user error)
    assert printed.err.startswith(f"colibri-stream doctor: error: {IO_FEATURES_ENV}: '-odirect'")
