"""The KV directory is a jail (issue 39 item 3): a session name cannot name a file outside it, a
symbolic link in it is never followed, and a file that is not a KV log of ours is never written, cut
or deleted, whatever `run --reset` or `kv rm` is asked."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from colibri_stream import cli
from colibri_stream.errors import SessionError
from colibri_stream.runtime.kv.transcript import load_transcript
from storage.errors import FormatError
from storage.files.atomic import atomic_write_json
from storage.files.safe_read import NotRegularFileError
from storage.kv.log import MAGIC, KVGeometry, KVLog, NotALogError, read_header_state, remove_log

GEOMETRY = KVGeometry(2, 4, 2, (0,), 3, "float32")
SECRET = b"someone else's file: not a KV log\n" * 200


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def model(tiny_checkpoints):
    return str(tiny_checkpoints["deepseek_v3"])


@pytest.fixture
def kv_dir(tmp_path):
    path = tmp_path / "kv"
    path.mkdir()
    return path


def cli_error(capsys, argv) -> tuple[int, str]:
    capsys.readouterr()
    status = cli.main(argv)
    return status, capsys.readouterr().err


def run_argv(model, kv_dir, session, *extra) -> list[str]:
    return [
        "run",
        model,
        "--ids",
        "5,6,7",
        "--max-new-tokens",
        "2",
        "--session",
        session,
        "--kv-dir",
        str(kv_dir),
        *extra,
    ]


# ------------------------------------------------------------------------------------ symlinks


@pytest.mark.parametrize("extra", [(), ("--reset",)])
def test_a_symlinked_log_is_refused_and_its_target_untouched(model, kv_dir, tmp_path, capsys, extra):
    target = tmp_path / "elsewhere.kvlog"
    target.write_bytes(SECRET)
    (kv_dir / "s.kvlog").symlink_to(target)
    status, err = cli_error(capsys, run_argv(model, kv_dir, "s", *extra))
    assert status == 1 and len(err.strip().splitlines()) == 1
    assert "symbolic link" in err and "s.kvlog" in err
    assert target.read_bytes() == SECRET  # was: overwritten with a fresh log by --reset


def test_a_symlink_to_a_real_log_is_not_followed_either(model, kv_dir, tmp_path, capsys):
    """Even a link to a log of ours: its records would be written outside the directory."""
    outside = tmp_path / "outside"
    assert cli.main(run_argv(model, outside, "s")) == 0
    before = (outside / "s.kvlog").read_bytes()
    (kv_dir / "s.kvlog").symlink_to(outside / "s.kvlog")
    status, err = cli_error(capsys, run_argv(model, kv_dir, "s", "--reset"))
    assert status == 1 and "symbolic link" in err
    assert (outside / "s.kvlog").read_bytes() == before


def test_kv_ls_reports_a_symlinked_log_without_reading_its_target(model, kv_dir, tmp_path, capsys):
    target = tmp_path / "elsewhere"
    target.write_bytes(MAGIC)  # would read as a torn header if followed
    (kv_dir / "s.kvlog").symlink_to(target)
    capsys.readouterr()
    assert cli.main(["kv", "ls", model, "--kv-dir", str(kv_dir), "--json"]) == 0
    (info,) = json.loads(capsys.readouterr().out)
    assert info["session"] == "s" and "symbolic link" in info["header"]


def test_kv_rm_of_a_symlinked_log_keeps_the_link_and_its_target(model, kv_dir, tmp_path, capsys):
    target = tmp_path / "elsewhere.kvlog"
    target.write_bytes(SECRET)
    (kv_dir / "s.kvlog").symlink_to(target)
    for action in ("rm", "info"):
        status, err = cli_error(capsys, ["kv", action, model, "s", "--kv-dir", str(kv_dir)])
        assert status == 1 and "not a regular file" in err and len(err.strip().splitlines()) == 1
    assert (kv_dir / "s.kvlog").is_symlink() and target.read_bytes() == SECRET


# ----------------------------------------------------------------------------- not our format


def test_kv_rm_leaves_a_file_that_is_not_a_log(model, kv_dir, capsys):
    (kv_dir / "s.kvlog").write_bytes(SECRET)
    status, err = cli_error(capsys, ["kv", "rm", model, "s", "--kv-dir", str(kv_dir)])
    assert status == 1 and "not a colibri-stream KV log" in err and len(err.strip().splitlines()) == 1
    assert (kv_dir / "s.kvlog").read_bytes() == SECRET  # was: deleted


def test_reset_leaves_a_file_that_is_not_a_log(model, kv_dir, capsys):
    (kv_dir / "s.kvlog").write_bytes(SECRET)
    status, err = cli_error(capsys, run_argv(model, kv_dir, "s", "--reset"))
    assert status == 1 and "not a colibri-stream KV log" in err and "--reset" in err
    assert len(err.strip().splitlines()) == 1
    assert (kv_dir / "s.kvlog").read_bytes() == SECRET  # was: truncated and overwritten


@pytest.mark.parametrize("torn", [b"", MAGIC[:3], MAGIC + b"\xff" * 40])
def test_a_torn_or_corrupt_log_of_ours_is_still_reset_and_removed(tmp_path, torn):
    """Ours is what starts with our magic (or is a prefix of it: a header torn at creation)."""
    path = tmp_path / "s.kvlog"
    path.write_bytes(torn)
    with KVLog(path, "fp", GEOMETRY, fresh=True) as log:
        log.append(np.arange(2, dtype=np.uint32), np.zeros((2, GEOMETRY.payload_bytes), dtype=np.uint8))
    path.write_bytes(torn)
    remove_log(path)
    assert not os.path.lexists(path)


def test_storage_refuses_links_and_foreign_files_before_any_write(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(SECRET)
    link = tmp_path / "link.kvlog"
    link.symlink_to(target)
    for attempt in (
        lambda: KVLog(link, "fp", GEOMETRY, fresh=True),
        lambda: remove_log(link),
        lambda: read_header_state(link),
    ):
        with pytest.raises(NotRegularFileError, match="symbolic link"):
            attempt()
    foreign = tmp_path / "foreign.kvlog"
    foreign.write_bytes(SECRET)
    for attempt in (lambda: KVLog(foreign, "fp", GEOMETRY, fresh=True), lambda: remove_log(foreign)):
        with pytest.raises(NotALogError, match="not a colibri-stream KV log"):
            attempt()
    assert target.read_bytes() == SECRET and foreign.read_bytes() == SECRET and link.is_symlink()
    assert issubclass(NotALogError, FormatError)  # a one-line user error at the CLI


# -------------------------------------------------------------------------------------- names


HOSTILE_NAMES = ["../x", "a/b", "..", ".x", "a\0b", "x" * 129, "x" * 100_000, "s\n"]


def short_id(name: str) -> str:
    return repr(name) if len(name) < 20 else f"{len(name)}-chars"


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=short_id)
@pytest.mark.parametrize("action", ["rm", "info"])
def test_kv_refuses_a_name_that_leaves_the_directory(model, kv_dir, tmp_path, capsys, name, action):
    (tmp_path / "x.kvlog").write_bytes(SECRET)  # what "../x" named from kv_dir
    status, err = cli_error(capsys, ["kv", action, model, name, "--kv-dir", str(kv_dir)])
    assert status == 1 and "session name" in err
    assert len(err.strip().splitlines()) == 1 and len(err) < 400  # a huge name is not echoed whole
    assert (tmp_path / "x.kvlog").read_bytes() == SECRET


@pytest.mark.parametrize("name", ["../x", "a\0b", "x" * 100_000], ids=short_id)
def test_run_refuses_a_name_that_leaves_the_directory(model, kv_dir, tmp_path, capsys, name):
    status, err = cli_error(capsys, run_argv(model, kv_dir, name))
    assert status == 1 and "session name" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.kvlog").exists() and list(kv_dir.iterdir()) == []


# --------------------------------------------------------------------------------- transcripts


def test_a_symlinked_transcript_is_not_read_through(tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"messages": [{"role": "user", "content": "not this session's"}]}))
    (tmp_path / "s.chat.json").symlink_to(outside)
    with pytest.raises(SessionError, match="symbolic link"):
        load_transcript(tmp_path / "s.chat.json", "s")  # was: the other file's messages


def test_kv_rm_removes_a_symlinked_transcript_but_not_its_target(model, kv_dir, tmp_path, capsys):
    assert cli.main(run_argv(model, kv_dir, "s")) == 0
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes(SECRET)
    (kv_dir / "s.chat.json").symlink_to(outside)
    assert cli.main(["kv", "rm", model, "s", "--kv-dir", str(kv_dir)]) == 0
    assert not os.path.lexists(kv_dir / "s.kvlog") and not os.path.lexists(kv_dir / "s.chat.json")
    assert outside.read_bytes() == SECRET


def test_a_transcript_write_does_not_follow_a_link_planted_at_its_temp_name(tmp_path):
    """The temp file's name is predictable (the pid): a link planted there must not be written through."""
    outside = tmp_path / "elsewhere"
    outside.write_bytes(SECRET)
    transcript = tmp_path / "kv" / "s.chat.json"
    transcript.parent.mkdir()
    (transcript.parent / f".s.chat.json.tmp-{os.getpid()}").symlink_to(outside)
    atomic_write_json(transcript, {"messages": []})
    assert outside.read_bytes() == SECRET  # was: the transcript written into it
    assert json.loads(transcript.read_text()) == {"messages": []}
