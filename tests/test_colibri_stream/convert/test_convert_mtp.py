"""`convert`, `pull` and `plan` with a checkpoint's multi-token-prediction layer (DeepSeek-V3/R1, GLM-5):
the container holds the MTP module's dense arrays and the expert records of layer N (N = num_hidden_layers)
and loads it; `--no-mtp` holds none of them. Either container generates the HF directory's greedy tokens,
a killed conversion resumes to the same bytes, and an unfinished one refuses the other --no-mtp."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from huggingface_hub import constants as hf_constants

from colibri_stream import cli
from colibri_stream.convert.converter import CRASH_ENV, JOURNAL, Converter, ConvertOptions
from colibri_stream.devtools import fixtures
from colibri_stream.devtools.fake_hub import FakeHub, FakeRepo
from colibri_stream.devtools.mtp_fixture import add_mtp_layer
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load, load_checkpoint
from engine.config.args import ModelArgs
from storage.container.reader import Container
from storage.errors import IncompatibleStateError

GIB = 2**30
LOSSLESS = ["--experts", "f32", "--dense", "f32"]
BANDWIDTH = ["--memory-bandwidth", "40GB", "--disk-bandwidth", "2GB"]
REPO = "org/tiny-mtp"


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 checkpoint (4 layers) with an MTP layer: model.layers.4.*."""
    root = tmp_path_factory.mktemp("mtp")
    return add_mtp_layer(fixtures.build_tiny_checkpoint("deepseek_v3", root / "hf"))


@pytest.fixture(scope="module")
def containers(mtp_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """`convert` (lossless) with and without --no-mtp."""
    root = tmp_path_factory.mktemp("mtp-containers")
    built = {}
    for name, flags in (("mtp", []), ("no-mtp", ["--no-mtp"])):
        built[name] = root / f"{name}.cstream"
        argv = ["convert", str(mtp_checkpoint), str(built[name]), "--no-progress", *LOSSLESS, *flags]
        assert cli.main(argv) == 0
    return built


@pytest.fixture
def memory(monkeypatch):
    """A machine of 64 GiB with 60 available, whatever this one has."""

    class Memory:
        total = 64 * GIB
        available = 60 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)


def _n_layers(checkpoint: Path) -> int:
    return json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]


def test_the_container_holds_the_mtp_layer_and_no_mtp_holds_none(mtp_checkpoint, containers):
    n = _n_layers(mtp_checkpoint)
    held, left_out = Container(containers["mtp"]), Container(containers["no-mtp"])
    mtp_arrays = {name for name in held.dense if name.startswith("mtp.")}
    assert {"mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.eh_proj.weight", "mtp.0.norm.weight"} <= mtp_arrays
    assert "mtp.0.block.attn.wq_a.weight" in mtp_arrays and "mtp.0.block.ffn.gate.weight" in mtp_arrays
    assert not any(".embed" in name or "shared_head" in name for name in mtp_arrays)  # the copies are not stored
    dim = held.model_config["hidden_size"]
    assert tuple(held.dense["mtp.0.eh_proj.weight"].shape) == (dim, 2 * dim)
    assert held.moe_layers[-1] == n and n not in left_out.moe_layers
    assert held.moe_layers[:-1] == left_out.moe_layers
    assert not any(name.startswith("mtp.") for name in left_out.dense)
    assert set(held.dense) - mtp_arrays == set(left_out.dense)
    assert [c.attrs["conversion"]["options"]["mtp"] for c in (held, left_out)] == [True, False]  # pinned


def test_both_containers_load_and_generate_the_hf_directorys_tokens(mtp_checkpoint, containers):
    prompt = fixtures.make_prompt(512, 20)
    hf = load_checkpoint(mtp_checkpoint)
    assert len(hf.model.mtp) == 1
    expected = generate(hf.model, prompt, 16, hf.experts).ids
    for name, modules in (("mtp", 1), ("no-mtp", 0)):
        loaded = load(containers[name])
        assert len(loaded.model.mtp) == modules and loaded.args.n_mtp_layers == modules
        assert generate(loaded.model, prompt, 16, loaded.experts).ids == expected, name


def _plan_json(capsys, *argv: str) -> dict:
    assert cli.main(["plan", *argv, "--ram", "50%", "--dtype", "float32", *BANDWIDTH, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_of_the_checkpoint_equals_plan_of_its_container(mtp_checkpoint, containers, memory, capsys):
    """With and without --no-mtp: the checkpoint directory (the MTP layer its shards hold) sized as convert
    writes it; the container as it holds it."""
    ignore = {"model", "verdict", "fits"}
    for name, flags in (("mtp", []), ("no-mtp", ["--no-mtp"])):
        hf = _plan_json(capsys, str(mtp_checkpoint), *LOSSLESS, *flags)
        converted = _plan_json(capsys, str(containers[name]))
        assert {k: v for k, v in hf.items() if k not in ignore} == {
            k: v for k, v in converted.items() if k not in ignore
        }, name
    held = _plan_json(capsys, str(containers["mtp"]))
    left_out = _plan_json(capsys, str(containers["no-mtp"]))
    assert (held["mtp_layers"], held["mtp_left_out"], left_out["mtp_layers"], left_out["mtp_left_out"]) == (1, 0, 0, 1)
    assert held["moe_layers"] == left_out["moe_layers"] + 1
    assert held["expert_bytes"] - left_out["expert_bytes"] == held["mtp_expert_bytes"] > 0
    assert held["mtp_expert_bytes"] == held["experts_per_layer"] * held["expert_record_bytes"]
    assert held["dense_bytes"] - left_out["dense_bytes"] == held["mtp_dense_bytes"] > 0
    # a plain decode step does not run the MTP module: the bytes read per token are the same
    assert held["dense_bytes_per_token"] == left_out["dense_bytes_per_token"]
    assert held["bytes_per_token_at_zero_hits"] == left_out["bytes_per_token_at_zero_hits"]


def test_plan_prints_the_mtp_line_for_the_containers(containers, memory, capsys):
    for name, line in (
        ("mtp", "multi-token prediction       1 layer for speculative decoding: "),
        ("no-mtp", "multi-token prediction       none: the model ships 1 layer, left out (--no-mtp, or not in"),
    ):
        assert cli.main(["plan", str(containers[name]), "--ram", "50%", *BANDWIDTH]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert sum(text.startswith("multi-token prediction") for text in lines) == 1
        assert any(text.startswith(line) for text in lines), (name, lines)


def test_a_checkpoint_whose_config_ships_mtp_but_shards_lack_it_plans_none(tmp_path, memory, capsys):
    """convert keeps the MTP layers the shards hold, so plan of a checkpoint directory counts those (the
    config's is not held: the line says so, as for a container converted from it)."""
    hf = fixtures.build_tiny_checkpoint("deepseek_v3", tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    p = _plan_json(capsys, str(hf))
    moe_layers = len(ModelArgs.from_hf_config(config).moe_layers)
    assert (p["mtp_layers"], p["mtp_left_out"], p["moe_layers"]) == (0, 1, moe_layers)
    assert _plan_json(capsys, str(hf / "config.json"))["mtp_layers"] == 1  # before the download: the config's word


def _convert_cli(src: Path, dst: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri_stream", "convert", str(src), str(dst), "--no-progress", *LOSSLESS, *flags],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_killed_in_the_mtp_layer_resumes_to_the_same_bytes_and_refuses_the_other_flag(
    mtp_checkpoint, containers, tmp_path
):
    dst = tmp_path / "resumed"
    units = Converter(mtp_checkpoint, tmp_path / "unused", ConvertOptions(), progress=False).plan.units
    in_mtp = [u.key for u in units].index(f"layer.{_n_layers(mtp_checkpoint):03d}.dense")
    killed = _convert_cli(mtp_checkpoint, dst, env={CRASH_ENV: str(in_mtp)})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert json.loads((dst / JOURNAL).read_text())["options"]["mtp"] is True
    other = ConvertOptions(experts="f32", dense="f32", mtp=False)
    with pytest.raises(IncompatibleStateError, match="another source or with other options"):
        Converter(mtp_checkpoint, dst, other, progress=False).run()
    resumed = _convert_cli(mtp_checkpoint, dst)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["resumed_units"] == in_mtp
    assert _tree(dst) == _tree(containers["mtp"])


def test_pull_no_mtp_writes_what_convert_no_mtp_writes(mtp_checkpoint, tmp_path, monkeypatch, memory, capsys):
    """`pull --no-mtp` plans without the MTP layer (config.json only: the layer it ships) and pulls none."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    plans = {}
    with FakeHub({REPO: FakeRepo.from_dir(mtp_checkpoint)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        for name, flags in (("mtp", []), ("no-mtp", ["--no-mtp"])):
            out = tmp_path / f"{name}.cstream"
            argv = ["pull", REPO, "--out", str(out), "--json", "--ram", "50%", *LOSSLESS, *flags]
            assert cli.main(argv) == 0
            events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
            plans[name] = next(e for e in events if e["event"] == "plan")
    n = _n_layers(mtp_checkpoint)
    held, left_out = Container(tmp_path / "mtp.cstream"), Container(tmp_path / "no-mtp.cstream")
    assert "mtp.0.eh_proj.weight" in held.dense and held.moe_layers[-1] == n
    assert not any(name.startswith("mtp.") for name in left_out.dense) and n not in left_out.moe_layers
    assert plans["mtp"]["container_bytes"] > plans["no-mtp"]["container_bytes"]
