"""Which way past the page cache the store reads (storage/files/page_cache.py), what the knob turns off
(storage/files/io_features.py), and that each way reads the same bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr

from storage.container.probe import open_for_reads, probe_file
from storage.container.reader import Container, ExpertReader, expert_array_name, read_record_file
from storage.errors import CorruptDataError, SettingError
from storage.files.buffers import aligned_empty
from storage.files.io_features import IO_FEATURES_ENV, Feature, enabled, feature_states, switched_off
from storage.files.page_cache import Bypass, bypass_refusal, drop_cached, file_bypass, platform_bypass


def test_the_knob_names_features_to_turn_off_and_refuses_anything_else():
    assert switched_off({}) == frozenset()
    assert switched_off({IO_FEATURES_ENV: " -o_direct, -proc ,"}) == {Feature.O_DIRECT, Feature.PROC}
    for bad in ("o_direct", "-odirect", "+fadvise", "-o_direct;-proc"):
        with pytest.raises(SettingError, match=IO_FEATURES_ENV):
            switched_off({IO_FEATURES_ENV: bad})


def test_a_feature_is_enabled_where_the_os_has_it_and_the_knob_leaves_it_on(monkeypatch):
    everything_off = {IO_FEATURES_ENV: ",".join(f"-{f}" for f in Feature)}
    assert not any(enabled(f, everything_off) for f in Feature)
    states = feature_states(everything_off)
    assert all(state in ("absent", f"off ({IO_FEATURES_ENV})") for state in states.values())
    monkeypatch.delattr(os, "O_DIRECT", raising=False)  # as on macOS: the knob cannot turn it on
    assert not enabled(Feature.O_DIRECT, {}) and feature_states({})[Feature.O_DIRECT] == "absent"


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="a host with O_DIRECT (Linux)")
def test_o_direct_is_linuxs_way_and_the_knob_leaves_none(monkeypatch):
    monkeypatch.delenv(IO_FEATURES_ENV, raising=False)
    assert platform_bypass() is Bypass.O_DIRECT
    monkeypatch.setenv(IO_FEATURES_ENV, "-o_direct")
    assert platform_bypass() is Bypass.NONE  # Linux has no F_NOCACHE to fall back on


@pytest.mark.parametrize("io_features", ["f_nocache"], indirect=True)
def test_without_o_direct_f_nocache_is_chosen_and_reads_the_same_bytes(make_container, io_features):
    """O_DIRECT absent (macOS): F_NOCACHE is chosen, set once per opened record on a plain descriptor, and
    every record reads exactly zarr's bytes."""
    assert io_features.bypass is platform_bypass() is Bypass.F_NOCACHE
    container = Container(make_container("deepseek_v3"))
    first = container.expert_path(container.moe_layers[0], 0)
    assert bypass_refusal(first) is None and file_bypass(first) is Bypass.F_NOCACHE
    io_features.nocache_fds.clear()
    reader = ExpertReader(container, Bypass.F_NOCACHE)
    buffer = aligned_empty(container.layout.record_bytes)
    reads = 0
    for layer in container.moe_layers:
        array = zarr.open_array(container.path / "experts" / expert_array_name(layer), mode="r")
        for expert in range(container.n_experts):
            assert reader.read_into(layer, expert, buffer) == container.layout.record_bytes
            assert np.array_equal(buffer, array[expert])
            reads += 1
    assert len(io_features.nocache_fds) == reads


@pytest.mark.parametrize("io_features", ["f_nocache"], indirect=True)
def test_a_planted_fifo_is_refused_with_f_nocache_too(make_container, io_features, tmp_path):
    container = Container(make_container("deepseek_v3"))
    fifo = tmp_path / "chunk"
    os.mkfifo(fifo)
    size = container.layout.record_bytes
    with pytest.raises(CorruptDataError, match="not a regular file"):
        read_record_file(fifo, 1, 0, aligned_empty(size), size, Bypass.F_NOCACHE)


def test_each_way_reads_the_same_record(make_container, io_features):
    """Whatever this mode chooses reads what a plain buffered read reads."""
    container = Container(make_container("deepseek_v32"))
    size = container.layout.record_bytes
    path = container.expert_path(1, 3)
    chosen, buffered = aligned_empty(size), aligned_empty(size)
    bypass = file_bypass(path)
    assert bypass is (Bypass.NONE if io_features.fallback else io_features.bypass)
    ExpertReader(container, bypass).read_into(1, 3, chosen)
    ExpertReader(container).read_into(1, 3, buffered)
    assert np.array_equal(chosen, buffered)


@pytest.mark.parametrize("io_features", ["platform", "forced-off", "f_nocache"], indirect=True)
def test_the_probe_says_how_it_read(io_features, tmp_path):
    with probe_file(tmp_path, 0.0, at_least=1 << 20) as (path, _):
        fd, method = open_for_reads(path)
        os.close(fd)
        bypass = file_bypass(path)
    if io_features.name == "platform":
        assert method == (bypass.flag if bypass is not Bypass.NONE else "buffered")
    elif io_features.name == "forced-off":
        assert bypass is Bypass.NONE and method == "buffered, cached"  # nothing could drop the fresh pages
    else:  # written and read with F_NOCACHE: the write, open_for_reads' check read and its descriptor, file_bypass
        assert method == "F_NOCACHE" and len(io_features.nocache_fds) == 4


def test_dropping_cached_pages_says_whether_it_could(io_features, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert drop_cached(fd) is (not io_features.fallback and hasattr(os, "posix_fadvise"))
    finally:
        os.close(fd)
