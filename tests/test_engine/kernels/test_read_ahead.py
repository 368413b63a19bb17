"""Read-ahead into the CPU caches (engine/kernels/read_ahead.py, engine/csrc/read_ahead.c): the kernels'
idle helper thread reads what it is asked, a new request replaces the old one, and decoding with it gives
the same bits."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from torch import nn

import engine.mla.model
from engine.core.sources import ExpertWeights, ResidentExperts
from engine.kernels import read_ahead as ahead

needs_helper = pytest.mark.skipif(ahead._kernels is None, reason="the C kernels are not built")


@contextmanager
def kernel_threads_set(threads: int):
    """Kernel threads outside a forward pass are torch's (engine.kernels.rows.kernel_threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def helper_share_given(share: float):
    """The helper's share of its core given, not measured (split.c split_give_load): whether it reads ahead
    then does not depend on how busy the test machine is. Measured again afterwards."""
    ahead._kernels.split_give_load(share, -1, 0)
    try:
        yield
    finally:
        ahead._kernels.split_give_load(-1, -1, 0)


def _read_after(before: int, at_least: int, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (read := ahead._kernels.bytes_read_ahead() - before) < at_least and time.monotonic() < deadline:
        time.sleep(0.001)
    return read


@needs_helper
def test_the_helper_reads_every_byte_it_is_asked_for():
    # numpy, not torch: odd sizes, no fill on torch's OpenMP team
    arrays = [np.ones(3 * 2**20 + 5, dtype=np.uint8), np.zeros((1000, 77), dtype=np.float32)]
    wanted = sum(a.nbytes for a in arrays)
    with kernel_threads_set(2), helper_share_given(1.0):  # its core to itself, however busy the machine
        before = ahead._kernels.bytes_read_ahead()
        ahead.request_read_ahead(arrays)
        read = _read_after(before, wanted)
        time.sleep(0.05)
        assert ahead._kernels.bytes_read_ahead() - before == read  # nothing more: each byte once
        ahead.stop_read_ahead()
    assert read == wanted


@needs_helper
def test_one_kernel_thread_reads_nothing_ahead():
    before = ahead._kernels.bytes_read_ahead()
    with kernel_threads_set(1):
        assert not ahead.read_ahead_available()
        ahead.request_read_ahead([np.ones(2**20)])
    time.sleep(0.05)
    assert ahead._kernels.bytes_read_ahead() == before


@needs_helper
def test_a_new_request_replaces_the_old_one_and_the_old_memory_may_go():
    big = np.ones(512 * 2**20, dtype=np.uint8)  # far more than is read before the next request
    small = np.ones(2**20, dtype=np.uint8)
    before = ahead._kernels.bytes_read_ahead()
    with kernel_threads_set(2), helper_share_given(1.0):  # the small request read whatever the machine's load
        ahead.request_read_ahead([big])
        ahead.request_read_ahead([small])
        del big  # freed at once: the helper no longer reads it (a read of freed memory would crash)
        read = _read_after(before, small.nbytes)
        time.sleep(0.05)
        assert small.nbytes <= ahead._kernels.bytes_read_ahead() - before < 256 * 2**20
        ahead.stop_read_ahead()
    assert read >= small.nbytes


@needs_helper
def test_a_request_the_helper_cannot_take_still_drops_the_one_before():
    """split.c drops a request when no core is idle (one kernel thread, or the cores found shared): the
    request before it must go too, for read_ahead.py lets that request's arrays go once the call returns.
    Left pending, the helper read freed memory (a segfault seen in test_huge_pages.py on a busy machine)."""
    big = np.ones(512 * 2**20, dtype=np.uint8)  # far more than is read before the next request
    small = np.ones(2**20, dtype=np.uint8)
    with helper_share_given(1.0):  # the first request read whatever the machine's load
        before = ahead._kernels.bytes_read_ahead()
        ahead._kernels.read_ahead([(big.ctypes.data, big.nbytes)], 2)
        started = _read_after(before, 1)
        ahead._kernels.read_ahead([(small.ctypes.data, small.nbytes)], 1)  # one kernel thread: not taken
        stopped = ahead._kernels.bytes_read_ahead()
        time.sleep(0.2)
        grown = ahead._kernels.bytes_read_ahead() - stopped
        ahead.stop_read_ahead()
    assert started > 0
    assert grown <= 2 * 16 * 1024  # at most the step under way when the request came (READ_AHEAD_STEP_BYTES)


def test_module_arrays_are_the_large_cpu_weights_in_registration_order():
    module = nn.Sequential(nn.Linear(64, 128, bias=True), nn.LayerNorm(128), nn.Linear(128, 96, bias=False))
    module.register_buffer("table", torch.zeros(100, 50))
    arrays = ahead.module_arrays(module)
    # the buffer of the container first (its own members come before its children's), then each Linear's
    # weight; biases and norm weights are under MIN_BYTES
    expected = [module.table, module[0].weight, module[2].weight]
    assert [a.data_ptr() for a in arrays] == [a.data_ptr() for a in expected]
    module[1] = _LayerNormReadingOtherForm(module[0].weight)  # names weights its decode does not read
    read = [module.table, module[2].weight]
    assert [a.data_ptr() for a in ahead.module_arrays(module)] == [a.data_ptr() for a in read]


class _LayerNormReadingOtherForm(nn.LayerNorm, ahead.ReadsOtherFormInDecode):
    def __init__(self, unread: torch.Tensor):
        super().__init__(128)
        self.unread = [unread]  # a list: not registered as this module's parameter

    def decode_unread(self) -> list[torch.Tensor]:
        return self.unread


def test_resident_experts_give_their_memory_gate_and_up_before_down():
    gen = torch.Generator().manual_seed(0)
    expert = ExpertWeights(*(torch.randn(s, generator=gen) for s in [(8, 4), (4, 8), (8, 4)]))
    experts = ResidentExperts({3: {0: expert, 1: expert}})
    in_order = [expert.w1, expert.w3, expert.w2]
    assert [t.data_ptr() for t in expert.tensors()] == [t.data_ptr() for t in in_order]
    assert len(experts.memory_of(3, [1, 5])) == 3  # 5 is not there
    assert experts.memory_of(4, [0]) == []


@needs_helper
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8-act"])
def test_decoding_with_read_ahead_gives_the_same_logits(stream_container, int8, monkeypatch):
    from colibri_stream.runtime.loader import load_container
    from storage.container.reader import Container
    from storage.tiers.config import StoreConfig

    def logits(read_ahead: bool, calls: list) -> list[torch.Tensor]:
        monkeypatch.setattr(engine.mla.model, "read_ahead_available", lambda: read_ahead)
        monkeypatch.setattr(
            engine.mla.model,
            "request_read_ahead",
            lambda arrays: calls.append(list(arrays)) or ahead.request_read_ahead(arrays),
        )
        budget = Container(stream_container).expert_bytes // 2
        loaded = load_container(stream_container, store=StoreConfig(ram_bytes=budget), int8_activations=int8)
        try:
            cache = loaded.model.new_cache()
            prompt = torch.tensor([[5, 9, 2, 77, 13]])
            out = [loaded.model(prompt, 0, cache, loaded.experts, last_only=True)[0, -1]]
            for _ in range(4):
                token = torch.tensor([[int(out[-1].argmax())]])
                out.append(loaded.model(token, cache.length, cache, loaded.experts)[0, -1])
            return out
        finally:
            loaded.experts.close()

    with kernel_threads_set(2):
        plain, read = [], []
        expected, got = logits(False, plain), logits(True, read)
    assert not plain
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    n_layers = 8
    assert len(read) == 4 * (n_layers + 1)  # per decode step: layer 0 first, then one per layer (the head last)
    assert any(len(request) > 3 for request in read[1 :: n_layers + 1])  # dense weights and some experts' slots


def _affinities() -> dict[int, set[int]]:
    """Each thread of this process and its CPUs, skipping threads that end while they are listed."""
    found = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(ProcessLookupError):
            found[tid] = os.sched_getaffinity(tid)
    return found


@needs_helper
@pytest.mark.parametrize(("share", "reads_all"), [(1.0, True), (0.8, True), (0.7, False), (0.0, False)])
def test_a_helper_that_runs_too_little_of_its_time_drops_the_request(share, reads_all):
    """split.c watch_share: over each window of its awake time the helper measures how much it ran; under 0.75
    of it (another busy thread has its core) it drops the request and reads no more. The share is given here,
    so that the verdict does not depend on the test machine's load."""
    big = np.ones(256 * 2**20, dtype=np.uint8)
    with kernel_threads_set(2), helper_share_given(share):
        before = ahead._kernels.bytes_read_ahead()
        ahead.request_read_ahead([big])
        read = _read_after(before, big.nbytes, timeout_s=60.0 if reads_all else 0.5)
        time.sleep(0.2)
        later = ahead._kernels.bytes_read_ahead() - before
        ahead.stop_read_ahead()
    if reads_all:
        assert read == later == big.nbytes
    else:  # it read until its first window ended (a few MB at most), then nothing more
        assert 0 < read == later < big.nbytes


def _affinities() -> dict[int, set[int]]:
    """Each thread of this process and its CPUs, skipping threads that end while they are listed."""
    found = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(ProcessLookupError):
            found[tid] = os.sched_getaffinity(tid)
    return found


@needs_helper
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_a_helper_sharing_its_core_with_a_busy_process_skips_the_read_ahead():
    """On a shared core the read-ahead would take time from the caller: the helper measures how much of
    its awake time it runs and drops the request when another busy thread has its core. Measured for real:
    a busy process pinned to the helper's core, which more load on the machine only makes busier."""
    with kernel_threads_set(2):
        ahead._kernels.split_give_load(-1, -1, 0)  # measured, and no solo period left by an earlier test
        ahead.request_read_ahead([np.ones(4096, dtype=np.uint8)])  # the helper exists from here on
        before_all = _affinities()
        cpu = min(os.sched_getaffinity(0))
        for tid in before_all:
            with contextlib.suppress(ProcessLookupError):  # a thread (another test's pool) that ended since
                os.sched_setaffinity(tid, {cpu})
        spin = f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
        busy = subprocess.Popen([sys.executable, "-c", spin])
        try:
            time.sleep(0.3)  # the busy loop is running
            big = np.ones(256 * 2**20, dtype=np.uint8)
            before = ahead._kernels.bytes_read_ahead()
            ahead.request_read_ahead([big])
            time.sleep(0.5)
            shared_read = ahead._kernels.bytes_read_ahead() - before
            time.sleep(0.5)
            later_read = ahead._kernels.bytes_read_ahead() - before
        finally:
            busy.kill()
            busy.wait()
            for tid, cpus in before_all.items():
                with contextlib.suppress(OSError):  # a thread that has ended since
                    os.sched_setaffinity(tid, cpus)
        # A request after the verdict went stale (split.c SHARE_FORGET_NS) is read again until a window says
        # otherwise: its first window's 64 steps of 16 KiB at least, however busy the machine still is (whether
        # it then reads all of it depends on that: the all-or-nothing cases are the test above).
        before = ahead._kernels.bytes_read_ahead()
        ahead.request_read_ahead([big])
        again_read = _read_after(before, 2**20)
        ahead.stop_read_ahead()
    # It stopped once it saw the core shared: the bytes before that depend on the machine's memory speed
    # (8-125 MB of the 256 measured here), so what is asserted is that it read no more after, and not all.
    assert later_read == shared_read < big.nbytes
    assert again_read >= 2**20


@needs_helper
def test_closing_a_runtime_lets_go_of_the_arrays_its_last_request_named(stream_container, tmp_path):
    from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, load_runtime, run_turn

    with kernel_threads_set(2):
        runtime = load_runtime(stream_container, RuntimeOptions(kv_dir=tmp_path, text=False))
        try:
            run_turn(runtime, [5, 9, 2], TurnOptions(max_new_tokens=3))
            head = runtime.loaded.model.head.weight
            assert any(a is head for a in ahead._held)  # a decode step's last request: the output head
        finally:
            runtime.close()
    assert ahead._held == []
