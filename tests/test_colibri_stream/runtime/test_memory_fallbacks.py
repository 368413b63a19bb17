"""The measured-memory readers without /proc (runtime/memory.py): each reads /proc/self where it may and
falls back to what every OS offers (getrusage, psutil) where COLIBRI_STREAM_IO_FEATURES=-proc says so or the
OS has no /proc (macOS). Fake /proc files with numbers no process has tell which path answered."""

from __future__ import annotations

import resource

import psutil
import pytest

from colibri_stream.experts.store import ResidentStore
from colibri_stream.runtime import memory, turn
from storage.files.io_features import IO_FEATURES_ENV

FAKE_KB = 7  # a resident set of 7 kB: no Python process is that small


@pytest.fixture
def fake_proc(tmp_path, monkeypatch):
    status = tmp_path / "status"
    status.write_text(f"Name:\tpython\nVmHWM:\t{FAKE_KB} kB\nRssAnon:\t{FAKE_KB} kB\n")
    rollup = tmp_path / "smaps_rollup"
    rollup.write_bytes(f"Rss: 100 kB\nPrivate_Clean: {FAKE_KB} kB\nPrivate_Dirty: 0 kB\n".encode())
    monkeypatch.setattr(memory, "STATUS", status)
    monkeypatch.setattr(memory, "ROLLUP", rollup)
    monkeypatch.delenv(IO_FEATURES_ENV, raising=False)


def test_with_proc_the_files_answer(fake_proc):
    assert memory.peak_rss_bytes() == memory.anon_rss_bytes() == memory.uss_bytes() == FAKE_KB * 1024


def test_without_proc_getrusage_and_psutil_answer(fake_proc, monkeypatch):
    monkeypatch.setenv(IO_FEATURES_ENV, "-proc")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    assert before <= memory.peak_rss_bytes() <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for private in (memory.uss_bytes(), memory.anon_rss_bytes()):  # psutil's USS: megabytes, not 7 kB
        assert private > 1 << 20 and private <= psutil.Process().memory_info().rss * 2


def test_without_proc_disk_bytes_come_from_getrusage(monkeypatch):
    monkeypatch.setenv(IO_FEATURES_ENV, "-proc")
    before = resource.getrusage(resource.RUSAGE_SELF)
    read, written = memory.disk_read_bytes(), memory.disk_write_bytes()
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert before.ru_inblock * 512 <= read <= after.ru_inblock * 512
    assert before.ru_oublock * 512 <= written <= after.ru_oublock * 512


def test_a_turn_reports_no_disk_bytes_where_the_os_does_not_count_them(monkeypatch):
    """macOS: psutil has no per-process I/O counters; decode_phase.disk_read_bytes is null, not a crash."""
    for counted, expected in ((True, int), (False, type(None))):
        monkeypatch.setattr(turn, "disk_reads_counted", lambda counted=counted: counted)
        recorder = turn.PhaseRecorder(ResidentStore({}))
        recorder.wrap(None)(1)  # the first token
        assert isinstance(recorder.report()["decode_phase"]["disk_read_bytes"], expected)
