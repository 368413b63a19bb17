"""Session-wide fixtures: the tiny reference checkpoints every correctness test compares against; and the
API tests' live server (a real uvicorn server on loopback, one per module)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from colibri_stream.devtools import fixtures
from colibri_stream.devtools.fuzz.disks import DiskUnavailable, LoopDisk, Tmpfs

if TYPE_CHECKING:
    import uvicorn

    from colibri_stream.runtime.turn import Runtime
    from colibri_stream.serve.app import Server

START_WAIT_S = 120  # the test machine may be busy


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def private_user_cache(tmp_path_factory):
    """The user cache (sessions, the prefix cache, weight digests) in a directory of this test run, for
    the CLI subprocesses too: what an earlier run or the developer's own use left there (a cached prompt
    prefix) must not change what a test computes."""
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("user-cache"))
    yield
    if saved is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = saved


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family -> directory of a tiny random float32 HF checkpoint (built once per session)."""
    return fixtures.build_all(tmp_path_factory.mktemp("tiny-checkpoints"))


@pytest.fixture(scope="session")
def tiny_v4_checkpoint(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V4 checkpoint (every layer type, hash routing; float32, built once per session)."""
    return fixtures.build_tiny_checkpoint("deepseek_v4", tmp_path_factory.mktemp("tiny-v4") / "deepseek_v4")


@pytest.fixture(scope="session", params=fixtures.FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoints, family) -> Path:
    return tiny_checkpoints[family]


@pytest.fixture(scope="session")
def reference(checkpoint):
    """The transformers model of ``checkpoint`` (float32, eval)."""
    return fixtures.load_reference(checkpoint)


@pytest.fixture(scope="session")
def loaded(checkpoint):
    """Our engine on ``checkpoint`` (float32, resident experts)."""
    from colibri_stream.runtime.loader import load_checkpoint

    return load_checkpoint(checkpoint)


@pytest.fixture(scope="session")
def make_container(tiny_checkpoints, tmp_path_factory):
    """(family, experts scheme, dense scheme) -> a converted container directory, built once each."""
    from colibri_stream.convert.converter import Converter, ConvertOptions

    built: dict[tuple[str, str, str], Path] = {}
    root = tmp_path_factory.mktemp("containers")

    def make(family: str, experts: str = "int4", dense: str = "f32") -> Path:
        key = (family, experts, dense)
        if key not in built:
            dst = root / f"{family}-{experts}-{dense}"
            Converter(tiny_checkpoints[family], dst, ConvertOptions(experts=experts, dense=dense), progress=False).run()
            built[key] = dst
        return built[key]

    return make


@pytest.fixture(scope="session")
def stream_container(tmp_path_factory) -> Path:
    """A generated 8-layer model (7 MoE layers x 16 experts) as an int4 container: one layer's experts
    are 1/7 of all, so budgets from 20% up are legal and force eviction."""
    import dataclasses

    from colibri_stream.bench.stress_model import QUICK, write_stress_checkpoint
    from colibri_stream.convert.converter import Converter, ConvertOptions

    root = tmp_path_factory.mktemp("stream")
    shape = dataclasses.replace(QUICK, num_hidden_layers=8, hidden_size=128, moe_intermediate_size=64, vocab_size=512)
    source = write_stress_checkpoint(root / "hf", shape, progress=False)
    dst = root / "container"
    Converter(source, dst, ConvertOptions(experts="int4", dense="f32"), progress=False).run()
    return dst


@pytest.fixture
def failing_disk(tmp_path) -> Iterator[LoopDisk]:
    """A mounted ext4 loop device that can be made to fail every write (``fail()``) and healed; the
    test is skipped where this machine cannot make one (not root, no loop devices)."""
    try:
        made = LoopDisk(parent=tmp_path)
    except DiskUnavailable as exc:
        pytest.skip(f"no failing device on this machine: {exc}")
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[[str], Path]]:
    """``tmpfs("256k")`` mounts a fresh tmpfs of that size (a disk that fills up) and returns its
    directory; all are unmounted at teardown. Skipped where this machine cannot mount one (not root)."""
    mounted: list[Tmpfs] = []

    def mount(size: str) -> Path:
        try:
            disk = Tmpfs(size, parent=tmp_path)
        except DiskUnavailable as exc:
            pytest.skip(f"cannot mount a tmpfs: {exc}")
        mounted.append(disk)
        return disk.path

    try:
        yield mount
    finally:
        for disk in reversed(mounted):
            disk.close()


class LiveServer:
    def __init__(self, server: Server, port: int, http_server: uvicorn.Server, thread: threading.Thread):
        self.server, self.port = server, port
        self.base = f"http://127.0.0.1:{port}"
        self.http_server, self.thread = http_server, thread

    def stop(self) -> None:
        """Shut down as Ctrl-C does (the worker ends, its sessions are closed)."""
        self.http_server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def live_server() -> Iterator[Callable[..., LiveServer]]:
    """The API tests' server: (runtime, **Server options) -> a LiveServer, a real uvicorn server on
    loopback around a Server, started in a thread; all stop at the module's end (every wait bounded)."""
    import uvicorn

    from colibri_stream.serve.app import Server, create_app

    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(runtime: Runtime, **options) -> LiveServer:
        server = Server(runtime, **options)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config = uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="error")
        http_server = uvicorn.Server(config)
        thread = threading.Thread(target=http_server.run, daemon=True)
        thread.start()
        running.append((http_server, thread))
        deadline = time.monotonic() + START_WAIT_S
        while not http_server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return LiveServer(server, port, http_server, thread)

    yield start
    for http_server, _ in running:
        http_server.should_exit = True
    for _, thread in running:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a server did not stop"
