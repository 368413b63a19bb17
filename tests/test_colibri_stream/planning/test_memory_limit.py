"""The memory a run plans for under a memory cgroup (planning/machine_memory.py): cgroup v1 and v2 trees
read from files laid out as the kernel does, every level up to the mount root, and one real group where
the machine lets the tests make one (root, cgroup v1 memory controller)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colibri_stream.bench.system import MemoryLimit, cgroup_available, cli_argv
from colibri_stream.planning import machine_memory
from colibri_stream.planning.machine_memory import cgroup_cap, memory_here

GIB = 1 << 30
MIB = 1 << 20
V1_UNLIMITED = "9223372036854771712"


def _group(directory: Path, files: dict[str, str | int]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (directory / name).write_text(f"{value}\n")


def _proc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cgroup"
    path.write_text(text)
    return path


def test_v1_the_tightest_level_wins_and_inactive_file_pages_count_as_available(tmp_path):
    root = tmp_path / "fs"
    v1 = "11:cpu,cpuacct:/x\n4:memory:/slice/job\n0::/\n"
    _group(root / "memory", {"memory.limit_in_bytes": V1_UNLIMITED, "memory.usage_in_bytes": 9 * GIB})
    _group(root / "memory/slice", {"memory.limit_in_bytes": 8 * GIB, "memory.usage_in_bytes": 5 * GIB})
    job = root / "memory/slice/job"
    _group(job, {"memory.limit_in_bytes": 3 * GIB, "memory.usage_in_bytes": 2 * GIB})
    (job / "memory.stat").write_text(f"cache 999\ntotal_inactive_file {512 * MIB}\ntotal_rss 1\n")
    cap = cgroup_cap(_proc(tmp_path, v1), root)
    assert cap is not None
    assert (cap.limit_bytes, cap.available_bytes) == (3 * GIB, GIB + 512 * MIB)
    assert cap.source == str(job / "memory.limit_in_bytes")
    # the parent's headroom is the smaller one now: it decides
    _group(root / "memory/slice", {"memory.usage_in_bytes": 7 * GIB})
    cap = cgroup_cap(_proc(tmp_path, v1), root)
    assert cap is not None and (cap.limit_bytes, cap.available_bytes) == (8 * GIB, GIB)


def test_v2_reads_memory_max_and_a_container_group_shown_at_the_mount_root(tmp_path):
    root = tmp_path / "fs"
    _group(root, {"memory.max": 2 * GIB, "memory.current": GIB})  # a container's own group, at the root
    (root / "memory.stat").write_text(f"anon 5\ninactive_file {256 * MIB}\n")
    _group(root / "user.slice", {"memory.max": "max", "memory.current": 10})
    cap = cgroup_cap(_proc(tmp_path, "0::/user.slice\n"), root)
    assert cap is not None and (cap.limit_bytes, cap.available_bytes) == (2 * GIB, GIB + 256 * MIB)
    # /proc names a path the container cannot see: its own group is the mount root
    cap = cgroup_cap(_proc(tmp_path, "0::/docker/4f2a\n"), root)
    assert cap is not None and cap.source == str(root / "memory.max")


@pytest.mark.parametrize(
    "proc, files",
    [
        ("4:memory:/\n", {"memory/memory.limit_in_bytes": V1_UNLIMITED, "memory/memory.usage_in_bytes": GIB}),
        ("0::/a\n", {"a/memory.max": "max", "a/memory.current": GIB}),
        ("0::/a\n", {}),  # no cgroup files at all
    ],
)
def test_no_limit_means_no_cap(tmp_path, proc, files):
    root = tmp_path / "fs"
    for name, value in files.items():
        _group((root / name).parent, {Path(name).name: value})
    assert cgroup_cap(_proc(tmp_path, proc), root) is None
    assert cgroup_cap(tmp_path / "missing", root) is None


def test_memory_here_takes_the_lower_of_the_machine_and_the_cgroup(monkeypatch):
    import psutil

    class Memory:
        total, available = 16 * GIB, 10 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    monkeypatch.setattr(machine_memory, "cgroup_cap", lambda: None)
    assert (memory_here().total_bytes, memory_here().available_bytes, memory_here().cap) == (16 * GIB, 10 * GIB, None)
    cap = machine_memory.MemoryCap(4 * GIB, 3 * GIB, "memory.max")
    monkeypatch.setattr(machine_memory, "cgroup_cap", lambda: cap)
    assert (memory_here().total_bytes, memory_here().available_bytes) == (4 * GIB, 3 * GIB)
    roomy = machine_memory.MemoryCap(64 * GIB, 40 * GIB, "memory.max")
    monkeypatch.setattr(machine_memory, "cgroup_cap", lambda: roomy)
    assert (memory_here().total_bytes, memory_here().available_bytes) == (16 * GIB, 10 * GIB)


@pytest.mark.skipif(not cgroup_available(), reason="needs root and the cgroup v1 memory controller")
def test_plan_in_a_real_memory_group_sizes_auto_from_its_limit_and_refuses_a_budget_beyond_it(stream_container):
    """Before, `--ram auto` (the default) read the host's MemAvailable inside a limited group, and `plan`
    said "fits" for budgets the kernel would kill the run for."""
    limit = MemoryLimit(GIB + 512 * MIB, name="colibri-test-plan")
    done = limit.run(cli_argv("plan", str(stream_container), "--ram", "auto", "--json"), 120)
    assert done.returncode == 0, done.stderr
    placement = json.loads(done.stdout)
    assert placement["machine_ram_bytes"] == GIB + 512 * MIB
    assert placement["memory_limited_by"].endswith("memory.limit_in_bytes")
    assert placement["available_ram_bytes"] < GIB + 512 * MIB
    assert placement["ram_budget_bytes"] + placement["dense_bytes"] < placement["available_ram_bytes"]
    done = limit.run(cli_argv("plan", str(stream_container), "--ram", "8GiB"), 120)
    assert done.returncode != 0
    assert "exceed the memory limit of 1.50 GiB" in done.stderr and "memory.limit_in_bytes" in done.stderr
    assert "of 1.5 GiB (memory cgroup limit" in _doctor_ram(limit)


def _doctor_ram(limit: MemoryLimit) -> str:
    done = limit.run(cli_argv("doctor"), 120)
    return next(line for line in done.stdout.splitlines() if " ram " in f" {line} ")


@pytest.mark.parametrize("off", ["-cgroups", "-proc"])
def test_without_cgroups_or_proc_the_machine_alone_counts(monkeypatch, off):
    """As on macOS: no cgroup is read (its group is found through /proc/self/cgroup), psutil's numbers stand."""
    import psutil

    from storage.files.io_features import IO_FEATURES_ENV

    class Memory:
        total, available = 16 * GIB, 10 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    monkeypatch.setattr(machine_memory, "cgroup_cap", lambda: machine_memory.MemoryCap(4 * GIB, 3 * GIB, "memory.max"))
    assert memory_here().cap is not None  # the knob, not a missing cgroup, is what the next line tests
    monkeypatch.setenv(IO_FEATURES_ENV, off)
    assert (memory_here().total_bytes, memory_here().available_bytes, memory_here().cap) == (16 * GIB, 10 * GIB, None)
