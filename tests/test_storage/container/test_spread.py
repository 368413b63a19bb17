"""A container spread over several directories, or with mirrored hot records, generates the same tokens,
keeps its fingerprint, verifies every part, and fails in one line naming the device when a part is bad."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_stream.checkpoint.fingerprint import container_fingerprint, model_fingerprint
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_container
from storage.container.mirror import copy_problems, mirror_layout, plan_mirror
from storage.container.parts import PART_MARKER, PARTS_FILE, PartError
from storage.container.reader import Container, ExpertReader, expert_chunk_relpath
from storage.container.spread import JOURNAL, apply_layout, current_parts, gather_layout, spread_layout
from storage.container.verify import verify_container
from storage.errors import CorruptDataError
from storage.files.buffers import aligned_empty
from storage.tiers.config import StoreConfig
from storage.tiers.history import UsageHistory

PROMPT = [5, 9, 17, 33, 65, 129, 257, 300, 11, 23]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def reference_ids(stream_container) -> list[int]:
    resident = load_container(stream_container)
    return generate(resident.model, PROMPT, NEW_TOKENS, resident.experts).ids


@pytest.fixture(scope="module")
def records(stream_container) -> dict[tuple[int, int], bytes]:
    return _records(Container(stream_container))


def _records(container: Container) -> dict[tuple[int, int], bytes]:
    reader = ExpertReader(container)
    buffer = aligned_empty(container.layout.record_bytes)
    out = {}
    for layer in container.moe_layers:
        for expert in range(container.n_experts):
            reader.read_into(layer, expert, buffer)
            out[(layer, expert)] = buffer.tobytes()
    return out


@pytest.fixture
def copy(stream_container, tmp_path) -> Path:
    dst = tmp_path / "model.cstream"
    shutil.copytree(stream_container, dst)
    return dst


def _spread(path: Path, dirs: list[Path], weights: list[float], home: float = 1.0, **kw: object) -> Container:
    container = Container(path)
    apply_layout(container, spread_layout(container, list(zip(dirs, weights, strict=True)), home), **kw)  # type: ignore[arg-type]
    return Container(path)


def _generate(path: Path, fraction: float, **overrides: object) -> tuple[list[int], dict[str, object]]:
    container = Container(path)
    ram = max(int(container.expert_bytes * fraction), container.experts_per_token * container.layout.record_bytes)
    config = StoreConfig(ram_bytes=ram, preload=False, **overrides)  # type: ignore[arg-type]
    loaded = load_container(path, store=config)
    try:
        ids = generate(loaded.model, PROMPT, NEW_TOKENS, loaded.experts).ids
        return ids, loaded.experts.report()
    finally:
        loaded.experts.close()


def test_spread_keeps_bytes_fingerprint_and_tokens(copy, tmp_path, reference_ids, records, io_features):
    before = (model_fingerprint(copy), container_fingerprint(Container(copy)))
    container = _spread(copy, [tmp_path / "ssd2", tmp_path / "ssd3"], [2.0, 1.0], home=1.0)
    parts = container.parts
    assert parts is not None and (copy / PARTS_FILE).is_file()
    counts = parts.primary_counts()
    total = sum(counts)
    assert counts[1] == pytest.approx(total / 2, abs=1) and counts[2] == pytest.approx(total / 4, abs=1)
    assert not (copy / expert_chunk_relpath(*next(k for k, w in parts.records() if w == (1,)))).exists()
    assert (model_fingerprint(copy), container_fingerprint(container)) == before
    assert _records(container) == records
    assert verify_container(copy) == []
    for fraction in (0.2, 1.0):  # a tiny budget (evicting, re-reading) and a full one
        ids, report = _generate(copy, fraction, threads=2)
        assert ids == reference_ids
        devices = report["devices"]
        assert isinstance(devices, list) and len(devices) == 3
        assert all(d["reads"] > 0 and d["bytes_read"] > 0 for d in devices)
        assert sum(d["reads"] for d in devices) == report["reads"]
        assert report["page_cache_bypass"] == io_features.bypass  # every device reads the one way (or none)


def test_gather_brings_every_record_home(copy, tmp_path, records):
    _spread(copy, [tmp_path / "ssd2"], [1.0])
    container = Container(copy)
    apply_layout(container, gather_layout(container))
    container = Container(copy)
    assert container.parts is None and not (copy / PARTS_FILE).exists() and not (copy / JOURNAL).exists()
    assert _records(container) == records
    assert not (tmp_path / "ssd2" / PART_MARKER).exists() and not (tmp_path / "ssd2" / "experts").exists()


def _history(path: Path) -> UsageHistory:
    container = Container(path)
    loaded = load_container(path, store=StoreConfig(ram_bytes=container.expert_bytes, preload=False))
    history: UsageHistory = loaded.experts.history
    try:
        generate(loaded.model, PROMPT[::-1], NEW_TOKENS, loaded.experts)
    finally:
        loaded.experts.close()
    return history


@pytest.mark.usefixtures("io_features")  # also with O_DIRECT and fadvise forced off
def test_mirrored_hot_set_balances_devices_and_keeps_tokens(copy, tmp_path, reference_ids, records):
    history = _history(copy)
    container = Container(copy)
    parts = current_parts(container)
    hot = tmp_path / "fast"
    wider = type(parts)(parts.home, (*parts.dirs, hot), (1.0, 1.0), parts.copies)
    plan = plan_mirror(container, history.counts, parts=wider)
    assert plan.copies and plan.gain > 1.5  # equal devices, everything on one: about 2x
    hottest = history.hottest(1)[0]
    assert plan.copies[0][0] == hottest
    assert sum(plan.load_after) == pytest.approx(sum(plan.load_before))
    apply_layout(container, mirror_layout(wider, plan))
    container = Container(copy)
    assert container.parts is not None and container.parts.mirrored == len(plan.copies)
    assert list(copy_problems(container)) == [] and verify_container(copy) == []
    assert _records(container) == records
    for fraction in (0.2, 1.0):
        ids, report = _generate(copy, fraction)
        assert ids == reference_ids
        assert report["devices"][1]["reads"] > 0  # the mirror serves reads


@pytest.mark.usefixtures("io_features")  # also with O_DIRECT and fadvise forced off
def test_a_corrupted_mirror_copy_falls_back_and_is_counted(copy, tmp_path, reference_ids):
    container = Container(copy)
    parts = current_parts(container)
    wider = type(parts)(parts.home, (*parts.dirs, tmp_path / "m"), (1.0, 1e12), parts.copies)  # mirror favoured
    plan = plan_mirror(container, _history(copy).counts, parts=wider)
    apply_layout(container, mirror_layout(wider, plan))
    for key, _ in plan.copies:
        path = tmp_path / "m" / expert_chunk_relpath(*key)
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF
        path.write_bytes(bytes(data))
    problems = list(copy_problems(Container(copy)))
    assert len(problems) == len(plan.copies) and all(str(tmp_path / "m") in p for p in problems)
    ids, report = _generate(copy, 1.0)
    assert ids == reference_ids
    assert report["devices"][1]["fallbacks"] > 0


def test_missing_or_foreign_part_directory_is_one_line_naming_it(copy, tmp_path):
    part = tmp_path / "ssd2"
    _spread(copy, [part], [1.0])
    shutil.move(part, tmp_path / "elsewhere")
    with pytest.raises(PartError, match=f"part directory {part} is missing"):
        Container(copy)
    problems = verify_container(copy)
    assert len(problems) == 1 and str(part) in problems[0] and "\n" not in problems[0]
    part.write_text("not a directory")
    with pytest.raises(PartError, match="is not a directory"):
        Container(copy)
    part.unlink()
    shutil.move(tmp_path / "elsewhere", part)
    (part / PART_MARKER).write_text('{"content_sha256": "another"}')
    with pytest.raises(PartError, match="belongs to another container"):
        Container(copy)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a directory whatever its mode")
def test_unreadable_part_directory_is_one_line(copy, tmp_path):
    part = tmp_path / "ssd2"
    _spread(copy, [part], [1.0])
    part.chmod(0)
    try:
        with pytest.raises(PartError, match=f"part directory {part} is unreadable"):
            Container(copy)
    finally:
        part.chmod(0o755)


@pytest.mark.usefixtures("io_features")  # also with O_DIRECT and fadvise forced off
def test_a_changed_record_on_one_device_names_device_and_record(copy, tmp_path):
    part = tmp_path / "ssd2"
    container = _spread(copy, [part], [1.0])
    assert container.parts is not None
    key = next(k for k, where in container.parts.records() if where == (1,))
    path = part / expert_chunk_relpath(*key)
    data = bytearray(path.read_bytes())
    data[7] ^= 0x01
    path.write_bytes(bytes(data))
    problems = verify_container(copy)
    assert len(problems) == 1
    assert f"layer {key[0]} expert {key[1]}" in problems[0] and str(part) in problems[0]
    config = StoreConfig(ram_bytes=container.expert_bytes, preload=True)
    with pytest.raises(CorruptDataError, match=f"layer {key[0]} expert {key[1]}.*{part}"):
        loaded = load_container(copy, store=config)
        loaded.experts.preload()


KILLER = """
import os, signal, sys
from pathlib import Path
from storage.container.reader import Container
from storage.container.spread import apply_layout, spread_layout
path, part, after = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
done = [0]
def progress(n):
    done[0] += n
    if done[0] >= after:
        os.kill(os.getpid(), signal.SIGKILL)
container = Container(path)
apply_layout(container, spread_layout(container, [(part, 1.0)], 1.0), progress=progress, batch_records=5)
"""


@pytest.mark.parametrize("after", [3, 12])
def test_a_killed_spread_resumes_to_verified_identical_records(copy, tmp_path, records, after):
    part = tmp_path / "ssd2"
    run = subprocess.run([sys.executable, "-c", KILLER, str(copy), str(part), str(after)], cwd=Path.cwd())
    assert run.returncode == -9
    assert (copy / JOURNAL).exists()
    assert verify_container(copy) == []  # mid-way: every record listed where a good copy is
    container = _spread(copy, [part], [1.0])
    assert not (copy / JOURNAL).exists()
    assert verify_container(copy) == [] and _records(container) == records
    assert container.parts is not None
    leftovers = [p for p in part.rglob(".*tmp")]
    assert leftovers == []
    for key, where in container.parts.records():  # every record in exactly its listed places
        for index, root in enumerate(container.parts.dirs):
            assert (root / expert_chunk_relpath(*key)).exists() == (index in where)


def test_an_unreadable_part_is_one_line_naming_it(copy, tmp_path, monkeypatch):
    """The same check as above where the test runs as root (which reads any mode): access() says no."""
    import storage.container.parts

    part = tmp_path / "ssd2"
    _spread(copy, [part], [1.0])
    real = os.access
    monkeypatch.setattr(storage.container.parts.os, "access", lambda p, mode: Path(p) != part and real(p, mode))
    problems = verify_container(copy)
    assert problems == [f"part directory {part} is unreadable (permission denied)"]


def test_spreading_again_moves_records_off_a_dropped_part(copy, tmp_path, records):
    first, second = tmp_path / "a", tmp_path / "b"
    _spread(copy, [first], [1.0])
    container = _spread(copy, [second], [1.0])
    assert container.parts is not None
    assert container.parts.dirs == (copy, second)
    assert not (first / PART_MARKER).exists() and not any(first.rglob("0"))
    assert verify_container(copy) == [] and _records(container) == records
