"""Reopening an unfinished container removes what writers killed mid-write left, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from storage.container.layout import ExpertRecordLayout
from storage.container.write import ContainerWriter


def test_a_reopened_container_loses_dead_writers_temp_files_and_keeps_the_rest(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        chunks = tmp_path / "dense" / "w" / "c"
        chunks.mkdir(parents=True)
        torn = [
            tmp_path / f"zarr.{uuid.uuid4().hex}.partial",  # zarr's temp of zarr.json
            chunks / f"0.{uuid.uuid4().hex}.partial",  # zarr's temp of chunk 0
            tmp_path / f".convert-journal.json.tmp-{dead.pid}",  # storage.files.atomic's, its process gone
        ]
        kept = [
            chunks / "0",
            tmp_path / f".convert-journal.json.tmp-{alive.pid}",  # its writer may still rename it
            tmp_path / f".convert-journal.json.tmp-{os.getpid()}",  # ours
            tmp_path / "notes.partial",  # not zarr's name
            tmp_path / f"zarr.{uuid.uuid4().hex[:31]}.partial",
            tmp_path / f"journal.tmp-{dead.pid}",  # not a hidden temp of storage.files.atomic
        ]
        for path in torn + kept:
            path.write_bytes(b"x")
        ContainerWriter(tmp_path, ExpertRecordLayout.build("int4", 120, 41, 64), 4)
        assert [p.name for p in torn if p.exists()] == []
        assert [p.name for p in kept if not p.exists()] == []
    finally:
        alive.kill()
        alive.wait()


def test_a_new_container_directory_is_created_without_error(tmp_path):
    ContainerWriter(tmp_path / "new", ExpertRecordLayout.build("int4", 120, 41, 64), 4)
    assert (tmp_path / "new" / "zarr.json").is_file()
