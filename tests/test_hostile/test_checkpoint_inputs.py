"""Hostile model inputs: HF checkpoint directories (config.json, safetensors, the shard index) and
containers. Each is refused with a typed one-line error naming the file and the key, before anything is
sized from it; only regular files inside the input directory are opened.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from colibri_stream import cli
from colibri_stream.checkpoint.files import TensorInfo, add_shard
from colibri_stream.convert.hf_source import HFSource
from colibri_stream.errors import USER_ERRORS, CheckpointError
from colibri_stream.runtime.loader import load_checkpoint, load_container
from engine.config.args import ConfigError

REPO = Path(__file__).resolve().parents[2]
SHARD = "model.safetensors"


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def source(tiny_checkpoints) -> Path:
    return tiny_checkpoints["deepseek_v3"]


@pytest.fixture
def copy(source, tmp_path) -> Callable[..., Path]:
    """A copy of the tiny deepseek_v3 checkpoint with config.json edited by ``config``."""

    def make(config: Callable[[dict], None] | None = None) -> Path:
        dst = tmp_path / "ckpt"
        shutil.copytree(source, dst)
        if config:
            _edit_json(dst / "config.json", config)
        return dst

    return make


def _one_line_error(argv: list[str], capsys) -> str:
    """The CLI's error for ``argv``: exit status 1 and exactly one line on stderr, no traceback."""
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@contextmanager
def fifo_watchdog(fifo: Path, seconds: float = 30.0) -> Iterator[list[bool]]:
    """Should the code under test block opening ``fifo`` for reading, open it for writing after
    ``seconds`` so it wakes up (and the test fails on the flag) instead of hanging the suite."""
    fired, stop = [False], threading.Event()

    def unblock() -> None:
        if not stop.wait(seconds):
            fired[0] = True
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    try:
        yield fired
    finally:
        stop.set()
        thread.join()


# ------------------------------------------------------------------------------------ config.json

CONFIG_CASES = {
    "eps NaN": ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    "eps negative": ({"rms_norm_eps": -1}, "rms_norm_eps"),
    "rope factor 0": (lambda c: c["rope_parameters"].update(factor=0), "rope factor"),
    "top-k above experts": ({"num_experts_per_tok": 64}, "num_experts_per_tok=64"),
    "top-k 0": ({"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
    "topk_group above n_group": ({"topk_group": 5}, "topk_group=5"),
    "n_group 0": ({"n_group": 0}, "n_group=0"),
    "no heads": ({"num_attention_heads": 0, "num_key_value_heads": 0}, "num_attention_heads=0"),
    "llama": ({"model_type": "llama"}, "model_type 'llama'"),
    "1025 layers": ({"num_hidden_layers": 1025}, "num_hidden_layers=1025"),  # 10^7: the memory-limited child
    "layers as a string": ({"num_hidden_layers": "3"}, "num_hidden_layers='3'"),
    "quantization_config a string": ({"quantization_config": "fp8"}, "quantization_config='fp8'"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_value_is_refused_naming_the_key(copy, case):
    change, culprit = CONFIG_CASES[case]
    path = copy(change if callable(change) else lambda c: c.update(change))
    with pytest.raises(ConfigError) as raised:
        load_checkpoint(path)
    assert str(raised.value).startswith("config.json: ") and culprit in str(raised.value)


def test_more_layers_than_the_tensors_hold_is_refused_before_loading(copy):
    path = copy(lambda c: c.update(num_hidden_layers=4, mlp_layer_types=None))
    with pytest.raises(CheckpointError, match=r"config.json: num_hidden_layers=4, but the tensors hold 3 layer"):
        load_checkpoint(path)


def test_convert_refuses_a_model_that_cannot_run(copy, tmp_path, capsys):
    path = copy(lambda c: c.update(num_attention_heads=0, num_key_value_heads=0))
    err = _one_line_error(["convert", str(path), str(tmp_path / "out"), "--no-progress"], capsys)
    assert "config.json: num_attention_heads=0" in err and not (tmp_path / "out").exists()


def test_string_quantization_config_is_one_line_in_convert_and_plan(copy, tmp_path, capsys):
    path = copy(lambda c: c.update(quantization_config="fp8"))
    assert "quantization_config='fp8'" in _one_line_error(["convert", str(path), str(tmp_path / "o")], capsys)
    assert "quantization_config='fp8'" in _one_line_error(["plan", str(path)], capsys)


# ------------------------------------------------------------------------------------ safetensors


def _relabel(shard: Path, name: str, old: str, new: str) -> None:
    """Rewrite one tensor's dtype in the header, same length so every offset stays valid."""
    data = bytearray(shard.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    assert header[name]["dtype"] == old and len(old) == len(new)
    header[name]["dtype"] = new
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    shard.write_bytes(bytes(data[:8]) + raw + bytes(data[8 + length :]))


def test_weight_relabelled_int32_is_refused_naming_the_tensor(copy):
    path = copy()
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    _relabel(path / SHARD, name, "F32", "I32")
    for load in (load_checkpoint, HFSource):
        with pytest.raises(CheckpointError, match=rf"{SHARD}: tensor {name} is I32, expected one of"):
            load(path)


@pytest.mark.parametrize(
    "damage, culprit",
    [
        (lambda f: f.write_bytes(b""), "too short for a safetensors header"),
        (lambda f: f.write_bytes(f.read_bytes()[:1000]), "exceeds the file"),
        (lambda f: f.write_bytes(f.read_bytes()[:-100]), "outside the"),
        (lambda f: f.write_bytes((10).to_bytes(8, "little") + b"{not json!"), "header is not valid JSON"),
    ],
    ids=["empty", "truncated in the header", "truncated in the data", "header not JSON"],
)
def test_broken_shard_is_one_line_naming_the_file(copy, capsys, damage, culprit):
    path = copy()
    damage(path / SHARD)
    with pytest.raises(CheckpointError, match=culprit) as raised:
        HFSource(path)
    assert str(path / SHARD) in str(raised.value)
    assert culprit in _one_line_error(["run", str(path), "--ids", "1,2"], capsys)


def test_shape_that_disagrees_with_config_is_refused(copy):
    path = copy(lambda c: c.update(intermediate_size=256))
    expected = r"model.layers.0.mlp.down_proj.weight has shape \[64, 128\], config.json implies \[64, 256\]"
    for load in (load_checkpoint, HFSource):
        with pytest.raises(CheckpointError, match=expected):
            load(path)


# ------------------------------------------------------------------------ only files in the directory


@pytest.mark.parametrize("shard", ["/etc/passwd", "../outside.safetensors", "sub/../../x.safetensors"])
def test_shard_index_cannot_point_outside_the_directory(copy, shard):
    path = copy()
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": SHARD, "model.norm.weight": shard}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"shard name {shard!r} points outside"):
        load_checkpoint(path)


def test_missing_shard_says_which_list_it_came_from(copy):
    path = copy()
    (path / SHARD).unlink()
    (path / SHARD).symlink_to(path / "gone.safetensors")  # no index: a dangling link found by *.safetensors
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path)
    assert "missing" in str(raised.value) and "index" not in str(raised.value)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-2.safetensors"}}))
    with pytest.raises(CheckpointError, match="listed in model.safetensors.index.json is missing"):
        load_checkpoint(path)


def test_fifo_shard_is_refused_without_opening_it(copy):
    path = copy()
    (path / SHARD).unlink()
    os.mkfifo(path / SHARD)
    with fifo_watchdog(path / SHARD) as fired, pytest.raises(CheckpointError, match="not a regular file"):
        load_checkpoint(path)
    assert not fired[0]


# ------------------------------------------------------------------------------------- containers


@pytest.fixture(scope="module")
def container(make_container) -> Path:
    return make_container("deepseek_v3", experts="int4", dense="f32")


def _model_config(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda root: _edit_json(root / "zarr.json", lambda m: edit(m["attributes"]["colibri"]["model_config"]))


CONTAINER_CASES = {
    "no heads": (_model_config(lambda c: c.update(num_attention_heads=0, num_key_value_heads=0)), "heads=0"),
    "llama": (_model_config(lambda c: c.update(model_type="llama")), "model_type 'llama'"),
    "4 layers, 3 stored": (
        _model_config(lambda c: c.update(num_hidden_layers=4)),
        "num_hidden_layers=4, the dense table holds 3",
    ),
    "empty dense table": (
        lambda root: _edit_json(root / "zarr.json", lambda m: m["attributes"]["colibri"].update(dense={})),
        "the dense table holds 0 layer(s)",
    ),
}


@pytest.mark.parametrize("case", sorted(CONTAINER_CASES))
def test_verify_refuses_a_container_that_cannot_run(container, tmp_path, capsys, case):
    damage, culprit = CONTAINER_CASES[case]
    broken = tmp_path / "broken"
    shutil.copytree(container, broken)
    damage(broken)
    assert cli.main(["verify", str(broken)]) == 1
    assert culprit in capsys.readouterr().err
    with pytest.raises(USER_ERRORS, match=None) as raised:
        load_container(broken)
    assert culprit in str(raised.value)


@pytest.mark.parametrize(
    "chunk, culprit",
    [
        ("experts/layer_001/c/3/0", "layer 1 expert 3: chunk {} is not a regular file"),
        ("dense/embed.weight/c/0/0", "{}: not a regular file (chunk of dense array embed.weight)"),
    ],
    ids=["expert", "dense"],
)
def test_verify_and_run_do_not_hang_on_a_fifo_chunk(container, tmp_path, capsys, chunk, culprit):
    broken = tmp_path / "broken"
    shutil.copytree(container, broken)
    (broken / chunk).unlink()
    os.mkfifo(broken / chunk)
    with fifo_watchdog(broken / chunk) as fired:
        assert cli.main(["verify", str(broken)]) == 1
        assert culprit.format(broken / chunk) in capsys.readouterr().err
        with pytest.raises(USER_ERRORS, match="not a regular file"):
            load_container(broken)
    assert not fired[0]


# ------------------------------------------------------ memory bombs, in a child with a memory limit

_CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a regression fails here, not the machine
from colibri_stream import cli
from colibri_stream.checkpoint.files import TensorInfo, add_shard
results = []
for argv in json.loads(sys.argv[1]):
    code = cli.main(argv)
    results.append(code)
print(json.dumps(results))
"""


def _gzip_bomb(chunk: Path, raw_bytes: int) -> None:
    """A gzip stream of ``raw_bytes`` zeros, built from one repeated member (gzip allows concatenation)."""
    block = 1 << 24
    member = gzip.compress(bytes(block), compresslevel=9)
    chunk.write_bytes(member * (raw_bytes // block))


def test_huge_layer_counts_and_gzip_bombs_fail_fast(copy, container, tmp_path):
    """D7: 10^7 layers in `plan`, `run` and `convert` of a checkpoint and `verify` of a container; D8: a
    gzip-coded dense chunk inflating to 1.6 GB in `verify` and `run`. Each must end in a one-line error,
    inside a 3 GiB address space (before the fix they grew ~32 MB/s, or to 6.4 GB, until killed)."""
    layers = copy(lambda c: c.update(num_hidden_layers=10**7))
    stored = tmp_path / "layers-container"
    shutil.copytree(container, stored)
    _model_config(lambda c: c.update(num_hidden_layers=10**7))(stored)
    bomb = tmp_path / "bomb"
    shutil.copytree(container, bomb)
    shape = [20000, 20000]  # float32: 1.6 GB declared
    _edit_json(bomb / "zarr.json", lambda m: m["attributes"]["colibri"]["dense"]["embed.weight"].update(shape=shape))
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "gzip", "configuration": {"level": 1}}]
    grid = {"name": "regular", "configuration": {"chunk_shape": shape}}
    _edit_json(bomb / "dense/embed.weight/zarr.json", lambda m: m.update(shape=shape, codecs=codecs, chunk_grid=grid))
    _gzip_bomb(bomb / "dense/embed.weight/c/0/0", math.prod(shape) * 4)
    argvs = [
        ["plan", str(layers)],
        ["run", str(layers), "--ids", "1,2"],
        ["convert", str(layers), str(tmp_path / "out"), "--no-progress"],
        ["verify", str(stored)],
        ["run", str(stored), "--ids", "1,2"],
        ["verify", str(bomb)],
        ["run", str(bomb), "--ids", "1,2"],
    ]
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert json.loads(child.stdout.strip().splitlines()[-1]) == [1] * len(argvs)
    assert "Traceback" not in child.stderr
    assert child.stderr.count("num_hidden_layers=10000000") == 5
    assert "dense array embed.weight: needs one uncompressed chunk" in child.stderr


# ------------------------------------------------- fuzz findings (#20 fix3): depth, types, sizes, length

DEEP = "[" * 100_000 + "]" * 100_000  # json's C decoder recurses per level: RecursionError, not JSONDecodeError


def _deep_json(path: Path, key: str) -> None:
    """``path``'s JSON object with ``key`` set to a list nested 100k deep."""
    data = json.loads(path.read_text())
    data[key] = "DEEP"
    path.write_text(json.dumps(data).replace('"DEEP"', DEEP))


@pytest.mark.parametrize(
    "damage, culprit",
    [
        (lambda ckpt: _deep_json(ckpt / "config.json", "index_head_dim"), "config.json: JSON nested too deeply"),
        (
            lambda ckpt: (ckpt / SHARD).write_bytes(len(DEEP).to_bytes(8, "little") + DEEP.encode()),
            f"{SHARD}: safetensors header JSON is nested too deeply",
        ),
        (
            lambda ckpt: (ckpt / "model.safetensors.index.json").write_text('{"weight_map": {"x": ' + DEEP + "}}"),
            "model.safetensors.index.json: JSON nested too deeply",
        ),
    ],
    ids=["config", "safetensors header", "shard index"],
)
def test_deeply_nested_json_is_a_typed_error_naming_the_file(copy, capsys, damage, culprit):
    path = copy()
    damage(path)
    with pytest.raises(CheckpointError, match=culprit):
        load_checkpoint(path)
    assert culprit in _one_line_error(["run", str(path), "--ids", "1,2"], capsys)


DENSE_META = "dense/layers.1.attn.wkv_a.weight/zarr.json"
EXPERT_META = "experts/layer_001/zarr.json"


@pytest.mark.parametrize(
    "meta, edit, culprit",
    [
        (DENSE_META, None, "JSON nested too deeply"),
        (DENSE_META, lambda m: m["chunk_grid"].update(configuration=[]), "chunk_grid: configuration must be"),
        (DENSE_META, lambda m: m["codecs"][0].update(configuration=["little"]), "codecs[0]: configuration must be"),
        (DENSE_META, lambda m: m.update(chunk_key_encoding=["/"]), "chunk_key_encoding must be a JSON object"),
        (EXPERT_META, lambda m: m["chunk_grid"].update(configuration=[1]), "chunk_grid: configuration must be"),
        (
            EXPERT_META,
            lambda m: m["chunk_key_encoding"].update(configuration=["/"]),
            "chunk_key_encoding: configuration must be",
        ),
    ],
    ids=["deep", "dense chunk_grid", "dense codec", "dense key encoding", "expert chunk_grid", "expert key encoding"],
)
def test_zarr_json_of_the_wrong_shape_names_file_and_key(container, tmp_path, capsys, meta, edit, culprit):
    broken = tmp_path / "broken"
    shutil.copytree(container, broken)
    if edit is None:
        (broken / meta).write_text('{"node_type": "array", "codecs": ' + DEEP + "}")
    else:
        _edit_json(broken / meta, edit)
    assert cli.main(["verify", str(broken)]) == 1
    err = capsys.readouterr().err
    assert f"{broken / meta}: {culprit}" in err and "Traceback" not in err, err
    with pytest.raises(USER_ERRORS, match=None) as raised:
        load_container(broken)
    assert f"{broken / meta}: {culprit}" in str(raised.value)


@pytest.mark.parametrize(
    "damage, culprit",
    [
        (lambda f: os.truncate(f, 1 << 40), "1099511627776 bytes, but its header's tensors end at byte"),
        (lambda f: f.write_bytes(f.read_bytes() + b"\0\0"), "bytes, but its header's tensors end at byte"),
    ],
    ids=["sparse 1 TiB", "2 trailing bytes"],
)
def test_shard_longer_than_its_tensors_is_refused_before_it_is_mapped(copy, tmp_path, capsys, damage, culprit):
    """Trailing bytes: safetensors maps the whole file (4 GiB broke the 3 GiB address-space limit) and
    convert hashed all of it (1 TiB: a hang); its own refusal came after convert's progress bar had
    started, so stderr held the bar before the error. Now the header check refuses it, bar or not."""
    path = copy()
    damage(path / SHARD)
    try:
        for load in (load_checkpoint, HFSource):
            with pytest.raises(CheckpointError, match=culprit):
                load(path)
        err = _one_line_error(["convert", str(path), str(tmp_path / "out")], capsys)  # progress bar enabled
        assert str(path / SHARD) in err and culprit in err and not (tmp_path / "out").exists()
    finally:
        (path / SHARD).unlink()  # never leave a 1 TiB sparse file for a later copy to fill the disk with


def _rewrite_header(shard: Path, edit: Callable[[dict], None]) -> None:
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    shard.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + length :])


def test_tensors_that_overlap_in_a_shard_are_refused_from_the_header(copy):
    path = copy()

    def overlap(header: dict) -> None:  # the last tensor moved onto the first, the data section unchanged
        spans = sorted((e["data_offsets"], n) for n, e in header.items() if n != "__metadata__")
        (begin, end), last = spans[-1]
        header[last]["data_offsets"] = [0, end - begin]

    _rewrite_header(path / SHARD, overlap)
    with pytest.raises(CheckpointError, match=r"starts at data offset \d+, the previous tensor ends at"):
        HFSource(path)


def test_a_tensor_in_two_shards_is_refused_naming_both():
    entry = TensorInfo("F32", (2,), 8, 0)
    table: dict = {}
    add_shard(table, Path("a.safetensors"), {"w": entry}, {"": ("F32",)})
    long_name = "x" * (1 << 20)
    add_shard(table, Path("a.safetensors"), {long_name: entry}, {"": ("F32",)})
    with pytest.raises(CheckpointError, match=r"^b.safetensors: tensor w is also in a.safetensors$"):
        add_shard(table, Path("b.safetensors"), {"w": entry}, {"": ("F32",)})
    with pytest.raises(CheckpointError) as refused:  # a hostile name is cut in the line
        add_shard(table, Path("b.safetensors"), {long_name: entry}, {"": ("F32",)})
    assert len(str(refused.value)) < 200
    assert table == {"w": (Path("a.safetensors"), entry), long_name: (Path("a.safetensors"), entry)}


@pytest.mark.parametrize(
    "change, culprit",
    [
        ({"topk_group": "x" * (1 << 20)}, "topk_group='xxx"),
        ({"model_type": "y" * (1 << 20)}, "model_type 'yyy"),
        ({"rope_parameters": {"rope_type": "z" * (1 << 20)}}, "rope type 'zzz"),
    ],
    ids=["topk_group", "model_type", "rope type"],
)
def test_a_1_mib_config_value_is_abbreviated_in_the_error(copy, capsys, change, culprit):
    path = copy(lambda c: c.update(change))
    err = _one_line_error(["run", str(path), "--ids", "1,2"], capsys)
    assert culprit in err and "..." in err
    assert len(err) < 300, len(err)


def test_a_1_mib_zarr_value_is_abbreviated_in_the_error(container, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(container, broken)
    _edit_json(broken / DENSE_META, lambda m: m.update(data_type="q" * (1 << 20)))
    assert cli.main(["verify", str(broken)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert any("zarr metadata says 'qqq" in line for line in lines) and max(map(len, lines)) < 400


@pytest.mark.parametrize(
    "change, culprit",
    [
        (
            {"vocab_size": 10**7},
            r"lm_head.weight has shape \[512, 64\], config.json implies \[10000000, 64\] \(from vocab_size=10000000\)",
        ),
        (
            {"index_n_heads": 172},
            r"weights_proj.weight has shape \[16, 64\], config.json implies \[172, 64\] \(from index_n_heads=172\)",
        ),
    ],
    ids=["vocab_size", "index_n_heads"],
)
def test_config_size_the_tensors_disagree_with_names_tensor_key_and_shapes(tiny_checkpoints, tmp_path, change, culprit):
    """Before the fix, 'size mismatch for head.weight' came from load_state_dict (a traceback)."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["deepseek_v32"], path)
    _edit_json(path / "config.json", lambda c: c.update(change))
    for load in (load_checkpoint, HFSource):
        with pytest.raises(CheckpointError, match=culprit):
            load(path)


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoints, tmp_path_factory) -> Path:
    from colibri_stream.devtools import fixtures

    return fixtures.build_fp8_checkpoint(tiny_checkpoints["deepseek_v3"], tmp_path_factory.mktemp("fp8") / "c", 32)


@pytest.mark.parametrize("damage", ["missing", "misshapen"])
def test_fp8_scales_are_checked_before_the_conversion_starts(fp8_checkpoint, tmp_path, capsys, damage):
    path = tmp_path / "fp8"
    shutil.copytree(fp8_checkpoint, path)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"

    def edit(header: dict) -> None:
        if damage == "missing":  # renamed: the weight has no scale, the bytes stay covered
            header[name.replace("weight_scale_inv", "other_scale_inv")] = header.pop(name)
        else:
            header[name]["shape"] = list(reversed(header[name]["shape"])) + [1]

    _rewrite_header(path / SHARD, edit)
    culprit = "has no" if damage == "missing" else "blocks needs"
    err = _one_line_error(["convert", str(path), str(tmp_path / "out")], capsys)  # progress bar enabled
    assert culprit in err and "kv_a_proj_with_mqa" in err and not (tmp_path / "out").exists()


def test_tensors_the_config_has_no_parameter_for_are_refused(copy):
    """Fuzz: n_shared_experts deleted made the shared-expert tensors extra, and the shape check looked them
    up in the model's parameters (KeyError, a traceback)."""
    path = copy(lambda c: c.pop("n_shared_experts"))
    for load in (load_checkpoint, HFSource):
        with pytest.raises(CheckpointError, match=r"6 tensor\(s\) have no parameter in the model config.json"):
            load(path)


def test_a_header_dtype_of_the_wrong_json_type_is_refused(copy):
    """Fuzz: a list as a dtype was looked up in the dtype table (TypeError: unhashable type: 'list')."""
    path = copy()
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    _rewrite_header(path / SHARD, lambda header: header[name].update(dtype=["F32"]))
    with pytest.raises(CheckpointError, match=rf"tensor {name}: dtype \['F32'\] is not a safetensors dtype"):
        load_checkpoint(path)
