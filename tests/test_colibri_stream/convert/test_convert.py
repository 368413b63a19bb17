"""Conversion: exact lossless containers, a faithful int4 runtime, kill/resume, FP8 sources."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from colibri_stream.convert.converter import CRASH_ENV, JOURNAL, Converter, ConvertOptions
from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint, load_container
from storage.errors import IncompatibleStateError

NEW_TOKENS = 32


def _prompt() -> list[int]:
    return fixtures.make_prompt(512, 20)


def test_lossless_container_generates_the_hf_directorys_tokens(make_container, tiny_checkpoints, family):
    container = load_container(make_container(family, experts="f32", dense="f32"))
    hf = load_checkpoint(tiny_checkpoints[family])
    expected = generate(hf.model, _prompt(), NEW_TOKENS, hf.experts).ids
    assert generate(container.model, _prompt(), NEW_TOKENS, container.experts).ids == expected
    assert expected == fixtures.oracle_greedy(fixtures.load_reference(tiny_checkpoints[family]), _prompt(), NEW_TOKENS)


def test_int4_runtime_is_faithful_to_the_int4_model(make_container, tiny_checkpoints, family, tmp_path):
    """transformers on the container's dequantised experts == our int4 run: tokens and logits."""
    loaded = load_container(make_container(family, experts="int4", dense="f32"))
    reference = fixtures.load_reference(
        fixtures.dequantised_experts_checkpoint(loaded, tiny_checkpoints[family], tmp_path / "deq")
    )
    expected = fixtures.oracle_greedy(reference, _prompt(), NEW_TOKENS)
    assert generate(loaded.model, _prompt(), NEW_TOKENS, loaded.experts).ids == expected
    forced = fixtures.oracle_teacher_forced(reference, _prompt() + expected)
    logits = loaded.model(torch.tensor([_prompt() + expected]), 0, loaded.model.new_cache(), loaded.experts)[0]
    assert (logits - forced.logits).abs().max().item() <= 1e-4


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _convert_cli(src: Path, dst: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri_stream", "convert", str(src), str(dst), "--no-progress"],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _plant_torn_writes(container: Path) -> None:
    """What a SIGKILL between a write and its rename leaves: zarr's temp files (`<name>.<uuid hex>.partial`,
    a chunk's and a metadata file's) and our journal's temp file of a process now dead."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    chunk = next(p for p in sorted(container.rglob("*")) if p.is_file() and "c" in p.relative_to(container).parts)
    for path in (chunk, container / "zarr.json"):
        path.with_suffix(f".{uuid.uuid4().hex}.partial").write_bytes(b"torn")
    (container / f".{JOURNAL}.tmp-{dead.pid}").write_bytes(b"{")


@pytest.mark.parametrize("crash_after", [0, 3])
def test_kill_9_then_rerun_is_byte_identical_to_an_uninterrupted_conversion(tiny_checkpoints, tmp_path, crash_after):
    src = tiny_checkpoints["glm_moe_dsa"]
    killed = _convert_cli(src, tmp_path / "resumed", {CRASH_ENV: str(crash_after)})
    assert killed.returncode == -signal.SIGKILL
    journal = json.loads((tmp_path / "resumed" / JOURNAL).read_text())
    assert len(journal["done"]) == crash_after
    _plant_torn_writes(tmp_path / "resumed")
    resumed = _convert_cli(src, tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert report["resumed_units"] == crash_after
    assert _convert_cli(src, tmp_path / "straight").returncode == 0
    assert _tree(tmp_path / "resumed") == _tree(tmp_path / "straight")
    assert JOURNAL not in _tree(tmp_path / "resumed")


def test_a_finished_conversion_is_not_redone_and_other_sources_are_refused(tiny_checkpoints, tmp_path):
    dst = tmp_path / "c"
    Converter(tiny_checkpoints["deepseek_v3"], dst, ConvertOptions(), progress=False).run()
    assert Converter(tiny_checkpoints["deepseek_v3"], dst, ConvertOptions(), progress=False).run()["status"] == (
        "already converted"
    )
    with pytest.raises(IncompatibleStateError, match="not an unfinished conversion of this source"):
        Converter(tiny_checkpoints["kimi_k2"], dst, ConvertOptions(), progress=False).run()


def test_an_unfinished_conversion_refuses_another_source_or_options(tiny_checkpoints, tmp_path):
    dst = tmp_path / "half"
    assert _convert_cli(tiny_checkpoints["deepseek_v3"], dst, {CRASH_ENV: "2"}).returncode == -signal.SIGKILL
    with pytest.raises(IncompatibleStateError, match="another source or with other options"):
        Converter(tiny_checkpoints["deepseek_v32"], dst, ConvertOptions(), progress=False).run()
    with pytest.raises(IncompatibleStateError, match="another source or with other options"):
        Converter(tiny_checkpoints["deepseek_v3"], dst, ConvertOptions(experts="int8"), progress=False).run()


def _reference_fp8_dequant(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Tile by tile, the plain way, to check the vectorised dequantisation against."""
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            out[tile] = q[tile].float() * scale[i, j].float()  # torch's own e8m0 -> float32
    return out


@pytest.mark.parametrize("block, scale_fmt", [(128, "float"), (32, "float"), (32, "ue8m0")])
def test_fp8_source_converts_to_its_dequantised_weights(tiny_checkpoints, tmp_path, block, scale_fmt):
    fp8 = fixtures.build_fp8_checkpoint(tiny_checkpoints["deepseek_v32"], tmp_path / "fp8", block, scale_fmt)
    tensors = load_file(fp8 / "model.safetensors")
    assert tensors["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.float8_e4m3fn
    scales = tensors["model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"]
    assert scales.dtype == (torch.float8_e8m0fnu if scale_fmt == "ue8m0" else torch.float32)
    plain = {
        n: _reference_fp8_dequant(t, tensors[n + "_scale_inv"], block) if t.dtype == torch.float8_e4m3fn else t
        for n, t in tensors.items()
        if not n.endswith("_scale_inv")
    }
    shutil.copytree(fp8, tmp_path / "plain")
    save_file(plain, tmp_path / "plain" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    options = ConvertOptions(experts="f32", dense="f32")
    Converter(fp8, tmp_path / "from-fp8", options, progress=False).run()
    Converter(tmp_path / "plain", tmp_path / "from-plain", options, progress=False).run()
    a, b = _tree(tmp_path / "from-fp8"), _tree(tmp_path / "from-plain")
    data = [k for k in a if "/c/" in k]
    assert data and all(a[k] == b[k] for k in data)
    model = load_container(tmp_path / "from-fp8")
    assert "quantization_config" not in model.config
    assert len(generate(model.model, _prompt(), 4, model.experts).ids) == 4


def test_convert_cli_reports_and_verify_passes(tiny_checkpoints, tmp_path, capsys):
    from colibri_stream import cli

    dst = tmp_path / "c"
    assert cli.main(["convert", str(tiny_checkpoints["kimi_k2"]), str(dst), "--experts", "int8", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["status"] == "converted"
    assert cli.main(["verify", str(dst)]) == 0
    assert capsys.readouterr().out.strip().endswith(": ok")
    code = cli.main(["convert", str(tiny_checkpoints["kimi_k2"]), str(tmp_path / "d"), "--group-size", "7"])
    assert code == 1 and "--group-size must be a positive even number, got 7" in capsys.readouterr().err


def test_int8_and_int4_records_dequantise_close_to_the_source(make_container, tiny_checkpoints):
    source = load_file(tiny_checkpoints["deepseek_v3"] / "model.safetensors")
    w = source["model.layers.2.mlp.experts.5.down_proj.weight"]
    errors = {}
    for scheme in ("int4", "int8"):
        expert = load_container(make_container("deepseek_v3", experts=scheme)).experts._experts[2][5]
        approx = expert.w2.dequantize(torch.float32)
        errors[scheme] = ((approx - w).norm() / w.norm()).item()
    assert errors["int8"] < 0.01 < errors["int4"] < 0.15
    assert np.isfinite(list(errors.values())).all()


def test_int8_dense_weights_load_close_to_float_and_are_verified(make_container, tiny_checkpoints, tmp_path, capsys):
    from colibri_stream import cli
    from storage.container.reader import Container

    f32 = load_container(make_container("deepseek_v32", experts="f32", dense="f32"))
    dst = tmp_path / "int8-dense"
    Converter(tiny_checkpoints["deepseek_v32"], dst, ConvertOptions(experts="f32", dense="int8"), progress=False).run()
    container = Container(dst)
    assert container.dense["layers.1.attn.wq_a.weight"].dtype == "int8"
    assert container.dense["layers.1.attn.wq_a.weight"].scales is not None
    assert container.dense["norm.weight"].dtype == "bfloat16"  # 1-D: not quantised
    assert container.dense["layers.1.ffn.gate.bias"].dtype == "float32"  # kept float32 always
    int8 = load_container(dst)
    ids = torch.tensor([_prompt()])
    a = f32.model(ids, 0, f32.model.new_cache(), f32.experts)[0]
    b = int8.model(ids, 0, int8.model.new_cache(), int8.experts)[0]
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    # Single positions drift where a routing or DSA choice flips (a random tiny model has near-ties: at
    # group 8, more precise, one position still falls to 0.80), so the median is the measure.
    assert cosine.median().item() > 0.998
    scale_chunk = dst / "dense" / "layers.1.attn.wq_a.weight.scale" / "c" / "0" / "0"
    data = bytearray(scale_chunk.read_bytes())
    data[3] ^= 0x01
    scale_chunk.write_bytes(bytes(data))
    assert cli.main(["verify", str(dst)]) == 1
    assert "layers.1.attn.wq_a.weight.scale: checksum mismatch" in capsys.readouterr().err
