"""Handcrafted broken containers: each gives a typed one-line error naming the culprit, from `verify`
and from `run`, never a traceback and never silent wrong output."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from colibri_stream import cli
from colibri_stream.runtime.loader import load_container
from storage.errors import StorageError


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _attrs(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda root: _edit_json(root / "zarr.json", lambda meta: edit(meta["attributes"]["colibri"]))


def _flip_bit(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


EXPERT = "experts/layer_001"
CHUNK = f"{EXPERT}/c/3/0"
EMBED = "dense/embed.weight"


def _layout(edit):
    return _attrs(lambda a: edit(a["experts"]["layout"]))


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "root metadata missing": (lambda r: (r / "zarr.json").unlink(), "zarr.json: missing"),
    "root metadata not json": (lambda r: (r / "zarr.json").write_text("{oops"), "not valid JSON"),
    "not our format": (_attrs(lambda a: a.update(format="something-else")), "is not 'colibri-stream-container'"),
    "unknown format version": (_attrs(lambda a: a.update(format_version=99)), "format version 99"),
    "unfinished conversion": (_attrs(lambda a: a.update(complete=False)), "conversion did not finish"),
    "model config field missing": (
        _attrs(lambda a: a["model_config"].pop("hidden_size")),
        "model_config.hidden_size",
    ),
    "model config top-k missing": (
        _attrs(lambda a: a["model_config"].pop("num_experts_per_tok")),
        "model_config.num_experts_per_tok",
    ),
    "dense entry without checksum": (_attrs(lambda a: a["dense"]["norm.weight"].pop("crc32c")), "norm.weight"),
    "dense array missing": (lambda r: shutil.rmtree(r / EMBED), "embed.weight"),
    "dense shape differs from metadata": (
        lambda r: _edit_json(r / EMBED / "zarr.json", lambda m: m.update(shape=[512, 32])),
        "dense array embed.weight: zarr metadata says",
    ),
    "dense dtype differs from metadata": (
        _attrs(lambda a: a["dense"]["embed.weight"].update(dtype="bfloat16")),
        "dense array embed.weight: zarr metadata says",
    ),
    "dense chunk bit flip": (lambda r: _flip_bit(r / EMBED / "c/0/0"), "dense array embed.weight: checksum mismatch"),
    "dense chunk truncated": (lambda r: _truncate(r / EMBED / "c/0/0", 1000), "dense array embed.weight"),
    "dense chunk missing": (lambda r: (r / EMBED / "c/0/0").unlink(), "dense array embed.weight"),
    "dense chunk gzip-coded": (
        lambda r: _edit_json(r / EMBED / "zarr.json", lambda m: m["codecs"].append({"name": "gzip"})),
        "dense array embed.weight: needs one uncompressed chunk",
    ),
    "dense name climbs out": (
        _attrs(lambda a: a["dense"].update({"../../norm.weight": a["dense"].pop("norm.weight")})),
        "name '../../norm.weight' is not a plain array or file name",
    ),
    "expert array metadata missing": (lambda r: (r / EXPERT / "zarr.json").unlink(), "experts/layer_001"),
    "expert array shape wrong": (
        lambda r: _edit_json(r / EXPERT / "zarr.json", lambda m: m["shape"].__setitem__(0, 15)),
        "expert array experts/layer_001: expected uint8",
    ),
    "expert array compressed": (
        lambda r: _edit_json(r / EXPERT / "zarr.json", lambda m: m["codecs"].append({"name": "zstd"})),
        "one uncompressed chunk per expert",
    ),
    "expert chunk missing": (lambda r: (r / CHUNK).unlink(), "layer 1 expert 3: chunk file"),
    "expert chunk truncated": (lambda r: _truncate(r / CHUNK, 4096), "layer 1 expert 3"),
    "expert chunk bit flip": (lambda r: _flip_bit(r / CHUNK, 5000), "layer 1 expert 3: checksum mismatch"),
    "expert checksums short": (
        _attrs(lambda a: a["experts"]["checksums"]["1"].pop()),
        "experts.checksums[1] must list 16",
    ),
    "misaligned field offset": (
        _layout(lambda lay: lay["fields"][1].update(offset=lay["fields"][1]["offset"] + 8)),
        "not 64-byte aligned",
    ),
    "record size not 4 KiB multiple": (_layout(lambda lay: lay.update(record_bytes=8000)), "not a multiple of 4096"),
    "unknown expert scheme": (_layout(lambda lay: lay.update(scheme="int3")), "unknown expert scheme 'int3'"),
    "layout for another model": (_layout(lambda lay: lay.update(group_size=32)), "does not match a int4 layout"),
    # fuzz (#20): hostile JSON types where the reader assumed hashable or integral values
    "layout field dtype a list": (
        _layout(lambda lay: lay["fields"][0].update(dtype=["uint8"])),
        "expert layout field w1.q: unknown dtype ['uint8']",
    ),
    "layout group_size a string": (
        _layout(lambda lay: lay.update(group_size="64")),
        "group_size '64' is not an integer",
    ),
    "dense name of 1 MiB": (
        _attrs(lambda a: a["dense"].update({"a" * (1 << 20): a["dense"]["embed.weight"]})),
        "name 'aaaaaaaa",
    ),
    "expert checksum infinite": (
        _attrs(lambda a: a["experts"]["checksums"]["1"].__setitem__(0, "inf")),
        "experts.checksums[1] must list",
    ),
}


# Damage only a read can see: the streaming run finds it if (and only if) it reads that record.
CHECKED_ON_FIRST_READ = {"expert chunk bit flip"}


@pytest.fixture(scope="module")
def pristine(make_container) -> Path:
    return make_container("deepseek_v3", experts="int4", dense="f32")


def test_there_are_at_least_fifteen_cases():
    assert len(CASES) >= 15


def test_the_pristine_container_verifies(pristine, capsys):
    assert cli.main(["verify", str(pristine)]) == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_container_gives_one_line_typed_error(pristine, tmp_path, capsys, case):
    damage, culprit = CASES[case]
    broken = tmp_path / "broken"
    shutil.copytree(pristine, broken)
    damage(broken)

    with pytest.raises(StorageError, match=None) as raised:
        load_container(broken)
    assert culprit in str(raised.value)

    assert cli.main(["verify", str(broken)]) == 1
    captured = capsys.readouterr()
    assert culprit in captured.err and "Traceback" not in captured.err

    code = cli.main(["run", str(broken), "--ids", "5,6,7", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    if case in CHECKED_ON_FIRST_READ and code == 0:
        return  # streaming never read the damaged record, so its checksum was never due
    assert code == 1 and len(err.strip().splitlines()) == 1 and culprit in err


def test_missing_copied_file_is_reported_by_verify(pristine, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(pristine, broken)
    (broken / "tokenizer.json").unlink()
    assert cli.main(["verify", str(broken)]) == 1
    assert "tokenizer.json: copied from the source checkpoint but now missing" in capsys.readouterr().err


def test_copied_file_names_stay_inside_the_container(pristine, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(pristine, broken)
    _attrs(lambda a: a["files"].append("../../../etc/passwd"))(broken)
    assert cli.main(["verify", str(broken)]) == 1
    assert "name '../../../etc/passwd' is not a plain array or file name" in capsys.readouterr().err


def test_root_attributes_of_the_wrong_json_type_name_the_file(pristine, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(pristine, broken)
    _edit_json(broken / "zarr.json", lambda meta: meta.update(attributes=["colibri"]))
    with pytest.raises(StorageError, match=r"zarr.json: attributes must be a JSON object, got \['colibri'\]"):
        load_container(broken)


def test_swapped_records_with_swapped_checksums_fail_the_published_digest(pristine, tmp_path, capsys):
    """Each record still matches its own checksum, so only the digest published at convert time can
    tell: verify recomputes it from the stored checksums."""
    broken = tmp_path / "broken"
    shutil.copytree(pristine, broken)
    first, second = broken / f"{EXPERT}/c/0/0", broken / f"{EXPERT}/c/1/0"
    first_bytes, second_bytes = first.read_bytes(), second.read_bytes()
    assert first_bytes != second_bytes  # a swap of equal records would change nothing
    first.write_bytes(second_bytes)
    second.write_bytes(first_bytes)

    def swap_checksums(attrs: dict) -> None:
        crcs = attrs["experts"]["checksums"]["1"]
        crcs[0], crcs[1] = crcs[1], crcs[0]

    _attrs(swap_checksums)(broken)
    assert cli.main(["verify", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "content_sha256" in err and "Traceback" not in err
