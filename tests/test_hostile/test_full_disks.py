"""Full disks, for real: a small tmpfs mounted for the test (root only; skipped otherwise, saying why).

Every write we make (KV log, history, trace, convert, serve) meets ENOSPC here and must answer with a
typed one-line error (or, for what is only an optimisation, a warning), keep everything acknowledged,
and leave nothing half-written behind."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from colibri_stream import cli
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.app import Server
from storage.errors import DiskFullError
from storage.kv.log import HEADER_BYTES, KVGeometry, KVLog, read_header
from storage.tiers.history import UsageHistory
from storage.tiers.trace import TraceWriter
from tests.test_hostile.test_server_abuse import FAMILY, MODEL, call, completion, scenario

GEOMETRY = KVGeometry(
    n_layers=2, kv_lora_rank=512, qk_rope_head_dim=64, index_layers=(), index_head_dim=0, dtype="float32"
)
Mount = Callable[[str], Path]


def fill(directory: Path, leave: int = 0) -> Path:
    """Fill ``directory``'s filesystem with one file, leaving about ``leave`` bytes free; the file is
    returned (delete it to free the space)."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
                if free <= leave:
                    break
                f.write(b"\xff" * min(4096, free - leave))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def _batch(log: KVLog, n: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.arange(log.length, log.length + n, dtype=np.uint32)
    payloads = np.full((n, GEOMETRY.payload_bytes), log.length % 251, dtype=np.uint8)
    return tokens, payloads


# ----------------------------------------------------------------------------------------- KV log


def test_a_full_disk_during_an_append_keeps_every_acknowledged_record(tmpfs):
    disk = tmpfs("256k")
    path = disk / "s.kvlog"
    acknowledged = 0
    with KVLog(path, "fp", GEOMETRY) as log, pytest.raises(DiskFullError) as full:
        while True:  # 3 records a batch: the last one is refused partway (tmpfs takes a short write first)
            log.append(*_batch(log, 3))
            acknowledged = log.length
    message = str(full.value)
    assert str(path) in message and "bytes free" in message and "\n" not in message
    assert path.stat().st_size == HEADER_BYTES + acknowledged * GEOMETRY.record_bytes  # cut back, no torn tail
    with KVLog(path, "fp", GEOMETRY) as reopened:
        assert reopened.length == acknowledged > 0
        tokens, _ = reopened.read()
        assert tokens.tolist() == list(range(acknowledged))
        reopened.append(*_batch(reopened, 1))  # what the failed batch freed is usable again
        assert reopened.length == acknowledged + 1


def test_a_log_whose_header_cannot_be_written_is_removed(tmpfs):
    disk = tmpfs("256k")
    fill(disk)
    with pytest.raises(DiskFullError, match="KV log header"):
        KVLog(disk / "new.kvlog", "fp", GEOMETRY)
    assert not (disk / "new.kvlog").exists()  # no 0-byte log for `kv ls` to call corrupt


# ---------------------------------------------------------------------------------- history, trace


def test_a_full_disk_keeps_the_last_history_and_only_warns(tmpfs, caplog):
    disk = tmpfs("256k")
    path = disk / "history.json"
    history = UsageHistory(n_experts=4)
    history.record(0, [1, 2])
    history.save(path)
    before = path.read_bytes()
    history.record(0, [3])
    filler = fill(disk)
    with pytest.raises(DiskFullError, match=str(path)):
        history.save(path)
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "history.json"]  # no temp file left
    with caplog.at_level(logging.WARNING, logger="storage.tiers.history"):
        assert history.save_or_warn(path) is False
        assert history.save_or_warn(path) is False
    assert len(caplog.records) == 1 and "usage history not updated" in caplog.text  # warned once
    assert path.read_bytes() == before
    filler.unlink()
    assert history.save_or_warn(path) is True
    assert UsageHistory.load(path, 4).counts == {0: [0.0, 1.0, 1.0, 1.0]}


def test_a_full_trace_disk_stops_tracing_with_one_warning(tmpfs, caplog):
    disk = tmpfs("256k")
    trace = TraceWriter(disk / "trace.jsonl", buffer_lines=16)
    fill(disk)
    with caplog.at_level(logging.WARNING, logger="storage.tiers.trace"):
        for _ in range(10_000):  # far more than the disk holds
            trace.write(3, [1, 2, 3, 4, 5, 6, 7, 8])
        trace.flush()
        trace.close()
    assert trace.stopped is not None and str(disk / "trace.jsonl") in trace.stopped
    assert len(caplog.records) == 1 and "tracing stopped" in caplog.text


# ------------------------------------------------------------------------------------ the commands

PROMPT = "5,6,7,8,9,10,11,12"


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _ids(out: str) -> list[int]:
    return json.loads(out.strip().splitlines()[-1])["ids"]


def test_run_on_a_full_kv_disk_is_one_line_and_keeps_the_session(make_container, tmpfs, capsys):
    container = str(make_container("deepseek_v3"))
    kv = tmpfs("1m")
    code, out, _ = _cli(
        capsys,
        "run",
        container,
        "--ids",
        PROMPT,
        "--max-new-tokens",
        "4",
        "--json",
        "--session",
        "s",
        "--kv-dir",
        str(kv),
    )
    assert code == 0
    first = _ids(out)
    stored = (kv / "s.kvlog").read_bytes()
    filler = fill(kv)
    longer = PROMPT + "," + ",".join(map(str, first)) + ",13,14"
    follow_up = (
        "run",
        container,
        "--ids",
        longer,
        "--max-new-tokens",
        "4",
        "--json",
        "--session",
        "s",
        "--kv-dir",
        str(kv),
    )
    code, _, err = _cli(capsys, *follow_up)
    assert code == cli.EXIT_USER_ERROR and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert "no space left" in line and str(kv / "s.kvlog") in line and "bytes free" in line
    assert (kv / "s.kvlog").read_bytes() == stored  # the acknowledged turn, nothing torn after it
    code, _, err = _cli(capsys, "run", container, "--ids", PROMPT, "--json", "--session", "new", "--kv-dir", str(kv))
    assert code == cli.EXIT_USER_ERROR and "KV log header" in err and not (kv / "new.kvlog").exists()
    filler.unlink()
    code, out, _ = _cli(capsys, *follow_up)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["stats"]["reused_tokens"] > 0
    (kv / "killed.kvlog").touch()  # a process killed between creating a log and writing its header
    code, out, _ = _cli(capsys, "kv", "ls", container, "--kv-dir", str(kv))
    assert code == 0 and "corrupt" not in out and "empty (no header yet)" in out


def test_a_full_trace_or_history_disk_warns_and_the_tokens_stay(make_container, tmpfs, capsys):
    """As a user sees it: a separate process, whose warnings reach stderr without any logging setup."""
    container = str(make_container("deepseek_v3"))
    _, out, _ = _cli(capsys, "run", container, "--ids", PROMPT, "--max-new-tokens", "6", "--json")
    disk = tmpfs("256k")
    fill(disk)
    traced = subprocess.run(
        [sys.executable, "-m", "colibri_stream", "run", container, "--ids", PROMPT, "--max-new-tokens", "6"]
        + ["--json", "--trace", str(disk / "trace.jsonl"), "--history", str(disk / "history.json")],
        capture_output=True,
        text=True,
    )
    assert traced.returncode == 0 and _ids(traced.stdout) == _ids(out)
    warnings = traced.stderr.strip().splitlines()
    assert len(warnings) == 2 and "Traceback" not in traced.stderr
    assert "tracing stopped" in warnings[0] and str(disk / "trace.jsonl") in warnings[0]
    assert "usage history not updated" in warnings[1] and "bytes free" in warnings[1]


def test_convert_into_a_full_disk_is_one_line_and_resumes_once_there_is_space(
    tiny_checkpoints, tmpfs, tmp_path, capsys
):
    src = tiny_checkpoints["glm_moe_dsa"]
    straight = tmp_path / "straight"
    assert _convert(capsys, src, straight)[0] == 0
    disk = tmpfs("1m")  # about half the container: some units are done when the disk fills
    dst = disk / "container"
    # past the free-space check (which refuses this disk up front): the disk fills midway, as when another
    # writer takes the space
    status, _, err = _cli(capsys, "convert", str(src), str(dst), "--no-progress", "--no-space-check")
    assert status == cli.EXIT_USER_ERROR, err
    (line,) = err.strip().splitlines()
    assert "no space left" in line and str(dst) in line and "bytes free" in line
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # space freed
    status, out, err = _convert(capsys, src, dst)
    assert status == 0, err
    assert json.loads(out.strip().splitlines()[-1])["resumed_units"] > 0
    assert _tree(dst) == _tree(straight)
    status, _, err = _cli(capsys, "verify", str(dst))
    assert status == 0, err


def _convert(capsys, src: Path, dst: Path) -> tuple[int, str, str]:
    """`colibri-stream convert` through cli.main (this process: no torch import per call)."""
    return _cli(capsys, "convert", str(src), str(dst), "--no-progress")


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------ serve


def test_serve_answers_507_on_a_full_kv_disk_and_keeps_serving(tiny_checkpoints, tmpfs):
    kv = tmpfs("1m")
    runtime = load_runtime(tiny_checkpoints[FAMILY], RuntimeOptions(kv_dir=kv, model_id=MODEL))
    results: dict[str, Any] = {}

    async def test(app) -> None:
        session = {"X-Colibri-Session": "s"}
        results["first"] = await call(app, "POST", "/v1/completions", completion(), session)
        stored = (kv / "s.kvlog").read_bytes()
        filler = fill(kv)
        longer = completion(prompt="Hello there, a longer turn")
        results["full"] = await call(app, "POST", "/v1/completions", longer, session)
        other = {"X-Colibri-Session": "other"}
        results["new_session"] = await call(app, "POST", "/v1/completions", completion(), other)
        results["sessionless"] = await call(app, "POST", "/v1/completions", completion())
        now = (kv / "s.kvlog").read_bytes()  # the turn cut the log back to the common prefix, then failed
        record_bytes = read_header(kv / "s.kvlog")[1].record_bytes
        results["kept"] = stored.startswith(now) and (len(now) - HEADER_BYTES) // record_bytes > 0
        results["whole_records"] = (len(now) - HEADER_BYTES) % record_bytes == 0
        filler.unlink()
        results["after"] = await call(app, "POST", "/v1/completions", longer, session)

    try:
        scenario(Server(runtime, slots=1, max_queue=1), test)
    finally:
        runtime.close()
    assert results["first"].status == 200
    for name in ("full", "new_session"):
        reply = results[name]
        assert reply.status == 507, reply.body
        error = reply.json()["error"]
        assert error["code"] == "insufficient_storage" and "no space left" in error["message"]
    assert results["sessionless"].status == 200  # other requests are still served
    assert results["kept"] and results["whole_records"]  # acknowledged records only, nothing torn after them
    assert results["after"].status == 200 and results["after"].json()["colibri"]["reused_tokens"] > 0
    assert not (kv / "other.kvlog").exists()


# ------------------------------------------------------------------------------------------ bench


def test_bench_refuses_a_work_disk_without_room_before_writing(tmpfs, tmp_path, capsys):
    work = tmpfs("1m")
    status, _, err = _cli(capsys, "bench", "--quick", "--work", str(work), "--out", str(tmp_path / "o"))
    assert status == cli.EXIT_USER_ERROR, err
    (line,) = [line for line in err.strip().splitlines() if not line.startswith("[bench]")]
    assert f"--work {work}:" in line and "bytes free" in line and "needs about" in line
    assert list(work.iterdir()) == []  # refused before anything was written
