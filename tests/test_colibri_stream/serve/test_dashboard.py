"""The live dashboard: /api/stats against the store it reports on, and the page in headless Chromium.

A real uvicorn server on loopback serves the tiny deepseek_v3 fixture converted to an int4 container,
streamed under a RAM budget of 40% of its experts (12 of 32 records: completions miss). Every wait is
bounded; no assertion is about time."""

from __future__ import annotations

import fnmatch
import http.client
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import uvicorn

from colibri_stream.checkpoint.fingerprint import container_fingerprint
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.turn import Runtime, RuntimeOptions, TurnOptions, load_runtime, run_turn
from colibri_stream.serve.app import Server, create_app
from colibri_stream.serve.auth import ApiKeys
from colibri_stream.serve.dashboard import STATIC, Dashboard
from colibri_stream.serve.live_stats import RateWindow
from storage.container.reader import Container
from storage.tiers.history import UsageHistory
from storage.tiers.stats import StoreStats

FAMILY = "deepseek_v3"
MODEL = "tiny"
RAM = "40%"
WAIT_S = 120  # upper bound on any wait: the test machine may be busy
CHROMIUM = "/usr/bin/chromium"
APT_INSTALL = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
REPO = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------------------------------ a server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(server: Server) -> Iterator[int]:
    """``server`` on a loopback port (yielded) until the block ends."""
    port = free_port()
    http_server = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=http_server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not http_server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        http_server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"


def request(port: int, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    data = None if body is None else json.dumps(body)
    conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
    reply = conn.getresponse()
    return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()


def stats(port: int, headers: dict | None = None) -> dict:
    status, _, body = request(port, "GET", "/api/stats", headers=headers)
    assert status == 200, body
    return json.loads(body)


def complete(port: int, prompt: str, max_tokens: int = 8) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    status, _, reply = request(port, "POST", "/v1/completions", body)
    assert status == 200, reply
    return json.loads(reply)


def streamed_runtime(container: Path, kv_dir: Path, ram: str = RAM, **store: object) -> Runtime:
    options = RuntimeOptions(kv_dir=kv_dir, model_id=MODEL, store=StoreOptions(ram=ram, **store))
    return load_runtime(container, options)


@dataclass
class Served:
    port: int
    server: Server

    @property
    def store(self):
        return self.server.runtime.loaded.experts


@pytest.fixture(scope="module")
def container(make_container) -> Path:
    return make_container(FAMILY)


@pytest.fixture(scope="module")
def served(container, tmp_path_factory) -> Iterator[Served]:
    runtime = streamed_runtime(container, tmp_path_factory.mktemp("dashboard-kv"))
    server = Server(runtime, slots=2, max_queue=2)
    try:
        with serving(server) as port:
            yield Served(port, server)
    finally:
        runtime.close()


# ------------------------------------------------------------------------------------ /api/stats
def test_heat_counts_every_routed_request_and_residency_matches_the_store(served, tiny_checkpoints):
    config = json.loads((tiny_checkpoints[FAMILY] / "config.json").read_text())
    before = stats(served.port)
    complete(served.port, "The quick brown fox")
    after = stats(served.port)
    store = served.store

    assert after["heat_layers"] == list(store.container.moe_layers) and len(after["heat_layers"]) == 2
    assert [len(row) for row in after["heat"]] == [config["n_routed_experts"]] * 2
    routed = sum(map(sum, after["heat"])) - sum(map(sum, before["heat"]))
    requested = after["experts"]["requests"] - before["experts"]["requests"]
    assert routed == requested > 0 and after["experts"]["requests"] == store.snapshot().requests
    # an independent count of the same routings: the usage history (no --history: it starts empty too)
    assert after["heat"] == [[int(c) for c in store.history.counts[layer]] for layer in after["heat_layers"]]
    assert after["experts"]["misses"] > 0 and after["counters"]["served"] == before["counters"]["served"] + 1

    ram = after["tiers"][0]
    assert [t["name"] for t in after["tiers"]] == ["ram"]  # no VRAM budget
    assert ram["slots"] == store.ram.n_slots == 12 and ram["budget_bytes"] == store.config.ram_bytes
    assert ram["used_slots"] == sum(map(len, after["resident"]["ram"])) <= ram["slots"]
    assert ram["used_bytes"] == ram["used_slots"] * store.record_bytes
    rows = zip(after["heat_layers"], after["resident"]["ram"], strict=True)
    resident = {(layer, e) for layer, row in rows for e in row}
    assert resident == set(store.ram.entries)  # the model is idle: nothing moved since the answer
    assert after["resident"]["vram"] == after["resident"]["pinned"] == [[], []]  # LRU, no VRAM


def test_io_rates_are_measured_over_the_recent_window(served):
    first = stats(served.port)
    complete(served.port, "Experts stream from disk", max_tokens=4)
    second = stats(served.port)
    io = second["io"]
    assert io["window_s"] > 0 and set(io) == {
        "window_s",
        "bytes_read_per_s",
        "reads_per_s",
        "io_wait_fraction",
        "io_service_per_s",
        "hit_rate",
    }
    read = second["experts"]["bytes_read"] - first["experts"]["bytes_read"]
    assert read > 0 and io["bytes_read_per_s"] > 0  # this prompt's experts were not all cached
    assert 0 <= io["io_wait_fraction"] and 0 <= io["hit_rate"] <= 1


def test_rate_window_divides_counter_deltas_by_the_time_between_samples():
    now = [100.0]
    window = RateWindow(window_s=5.0, clock=lambda: now[0])
    first = window.rates(StoreStats())
    assert first["window_s"] == 0.0 and first["bytes_read_per_s"] is None  # one sample: nothing measured
    now[0] = 102.0
    rates = window.rates(StoreStats(requests=10, hits_ram=6, reads=4, expert_bytes_read=4096, io_wait_s=0.5))
    assert rates == {
        "window_s": 2.0,
        "bytes_read_per_s": 2048.0,
        "reads_per_s": 2.0,
        "io_wait_fraction": 0.25,
        "io_service_per_s": 0.0,
        "hit_rate": 0.6,
    }
    now[0] = 110.0  # the first two samples are older than the window: the base moves to the newest old one
    later = window.rates(StoreStats(requests=10, hits_ram=6, reads=8, expert_bytes_read=8192, io_wait_s=0.5))
    assert later["window_s"] == 8.0 and later["bytes_read_per_s"] == 512.0 and later["hit_rate"] is None


def test_active_requests_show_while_they_generate(served):
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=WAIT_S)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 400, "temperature": 0, "stream": True}
    headers = {"content-type": "application/json", "X-Colibri-Session": "watched"}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    try:
        reply = conn.getresponse()
        reply.readline(), reply.readline(), reply.readline()  # the role chunk, then the first token's
        active = stats(served.port)["active"]
        assert [a["session"] for a in active] == ["watched"]
        assert active[0]["max_tokens"] == 400 and active[0]["generated_tokens"] >= 1
    finally:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    deadline = time.monotonic() + WAIT_S
    while stats(served.port)["active"]:
        assert time.monotonic() < deadline, "the cancelled request stayed active"
        time.sleep(0.05)


def test_pinned_experts_are_the_hot_store(container, tmp_path):
    """--policy pinned over a usage history: /api/stats lists the store's hot set, per layer."""
    history = tmp_path / "usage.json"
    counts = {1: [float(i) for i in range(16)], 2: [i + 0.5 for i in range(16)]}  # expert 15 hottest in both
    UsageHistory(16, container_fingerprint(Container(container)), counts).save(history)
    # 75%: 24 slots, one layer's 16 left unpinned, so the 8 most-routed experts are pinned
    runtime = streamed_runtime(container, tmp_path / "kv", ram="75%", policy="pinned", history=history)
    try:
        answer = Dashboard(Server(runtime)).stats()
        assert answer["resident"]["pinned"] == [[12, 13, 14, 15], [12, 13, 14, 15]]
        assert set(runtime.loaded.experts.ram.hot) == {(layer, e) for layer in (1, 2) for e in (12, 13, 14, 15)}
        assert answer["heat"] == [[0] * 16, [0] * 16]  # a new store: counts start at zero, not the history
    finally:
        runtime.close()


def test_vram_residents_and_hits_are_the_stores(container, tmp_path):
    """A VRAM tier (the CPU standing in for the GPU): its slots, residents and hits as the store has them."""
    runtime = streamed_runtime(container, tmp_path / "kv", vram="25%", vram_device="cpu")
    try:
        run_turn(runtime, runtime.encode("The quick brown fox"), TurnOptions(max_new_tokens=6))
        store = runtime.loaded.experts
        answer = Dashboard(Server(runtime)).stats()
    finally:
        runtime.close()
    ram, vram = answer["tiers"]
    assert (ram["name"], vram["name"]) == ("ram", "vram") and vram["slots"] == store.vram.n_slots == 8
    assert vram["hits"] == store.stats.hits_vram > 0 and ram["hits"] == store.stats.hits_ram
    rows = zip(answer["heat_layers"], answer["resident"]["vram"], strict=True)
    assert {(layer, e) for layer, row in rows for e in row} == set(store.vram.entries)
    assert vram["used_slots"] == len(store.vram.entries) <= 8


def test_a_resident_model_reports_one_full_ram_tier(tiny_checkpoints, tmp_path):
    """An HF directory loads every expert resident: one RAM tier, all of them in it, every request a hit."""
    runtime = load_runtime(tiny_checkpoints[FAMILY], RuntimeOptions(kv_dir=tmp_path / "kv", model_id=MODEL))
    try:
        run_turn(runtime, runtime.encode("Hello"), TurnOptions(max_new_tokens=3))
        answer = Dashboard(Server(runtime)).stats()
    finally:
        runtime.close()
    (ram,) = answer["tiers"]
    assert ram["slots"] == ram["used_slots"] == 32 and ram["hit_rate"] == 1.0
    assert answer["resident"]["ram"] == [list(range(16))] * 2
    assert sum(map(sum, answer["heat"])) == answer["experts"]["requests"] > 0


def test_stats_need_a_key_when_keys_are_set_and_the_page_does_not(served):
    server = Server(served.server.runtime, api_keys=ApiKeys(["key-a"]))
    with serving(server) as port:
        for headers in ({}, {"authorization": "Bearer wrong"}):
            status, _, body = request(port, "GET", "/api/stats", headers=headers)
            assert status == 401 and b"heat" not in body and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert stats(port, {"authorization": "Bearer key-a"})["heat_layers"] == [1, 2]
        status, _, page = request(port, "GET", "/")
        assert status == 200 and b"<canvas" in page


def test_stats_name_only_the_callers_own_sessions(served):
    """A keyed session's name starts with its X-Colibri-Session text: key A's caller must not read key B's."""
    server = Server(served.server.runtime, api_keys=ApiKeys(["key-a", "key-b"]))
    with serving(server) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        body = {
            "model": MODEL,
            "prompt": "Hi",
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
        }
        headers = {
            "content-type": "application/json",
            "authorization": "Bearer key-b",
            "X-Colibri-Session": "bob-secret",
        }
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
        try:
            reply = conn.getresponse()
            reply.readline(), reply.readline(), reply.readline()  # the role chunk, then the first token's
            status, _, raw = request(port, "GET", "/api/stats", headers={"authorization": "Bearer key-a"})
            assert status == 200 and b"bob-secret" not in raw
            assert [a["session"] for a in json.loads(raw)["active"]] == [None]  # its numbers, not its name
            (own,) = stats(port, {"authorization": "Bearer key-b"})["active"]
            assert own["session"].startswith("bob-secret-")
        finally:
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
        deadline = time.monotonic() + WAIT_S
        while stats(port, {"authorization": "Bearer key-b"})["active"]:
            assert time.monotonic() < deadline, "the cancelled request stayed active"
            time.sleep(0.05)


def test_the_page_and_its_assets_are_self_contained_and_shipped(served):
    static = REPO / "colibri_stream" / "serve" / "static"
    for path, (name, media_type) in STATIC.items():
        status, headers, body = request(served.port, "GET", path)
        assert status == 200 and headers["content-type"] == media_type
        assert "default-src 'self'" in headers["content-security-policy"]
        assert body == (static / name).read_bytes()
        assert b"http://" not in body and b"https://" not in body  # no CDN, no external fonts
    assert request(served.port, "GET", "/static/../app.py")[0] == 404
    # a non-editable install ships every asset: pyproject's package data covers each file
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for asset in static.iterdir():
        assert any(fnmatch.fnmatch(f"static/{asset.name}", p) for p in patterns["colibri_stream.serve"]), asset


# ------------------------------------------------------------------------------------ the page in Chromium
@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium: found, else installed (root with apt-get: the CI machine), else skipped."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"no {CHROMIUM}, and installing it needs root and apt-get: run `{' '.join(APT_INSTALL)}`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (APT_INSTALL, ["apt-get", "update"], APT_INSTALL):  # a fresh machine may lack package lists
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode == 0 and os.access(CHROMIUM, os.X_OK):
            return CHROMIUM
    pytest.skip(f"`{' '.join(APT_INSTALL)}` failed: {done.stderr.strip()[-300:]}")


def screenshot(chromium: str, url: str, png: Path) -> np.ndarray:
    """The page after ~3 s of virtual time (three polls of /api/stats), as an RGB array."""
    from PIL import Image  # matplotlib's dependency (dev extra)

    command = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={png.parent / (png.stem + '-profile')}",
        "--window-size=1280,800",
        "--virtual-time-budget=3000",
        f"--screenshot={png}",
        url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S)
    assert png.is_file(), f"chromium wrote no screenshot (exit {done.returncode}): {done.stderr[-500:]}"
    return np.asarray(Image.open(png).convert("RGB")).astype(int)


def warm_pixels(rgb: np.ndarray) -> int:
    """Pixels in the heat map's red-to-yellow ramp (dashboard.js WARM_FROM..WARM_TO); the page draws no
    other warm colour but the legend's swatch."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    return int(np.count_nonzero((r >= 150) & (b <= 80) & (r - b >= 100) & (g <= r)))


def cold_pixels(rgb: np.ndarray) -> int:
    """Pixels of never-routed cells (dashboard.js COLD, #374151)."""
    return int(np.count_nonzero(np.all(rgb == (0x37, 0x41, 0x51), axis=-1)))


def test_headless_chromium_draws_the_heat_map(chromium, container, tmp_path):
    runtime = streamed_runtime(container, tmp_path / "kv")  # its own: the counts start at zero
    try:
        with serving(Server(runtime)) as port:
            url = f"http://127.0.0.1:{port}/"
            assert sum(map(sum, stats(port)["heat"])) == 0
            before = screenshot(chromium, url, tmp_path / "before.png")
            complete(port, "The quick brown fox")
            heat = stats(port)["heat"]
            after = screenshot(chromium, url, tmp_path / "after.png")
    finally:
        runtime.close()
    routed_cells = sum(count > 0 for row in heat for count in row)
    assert routed_cells > 0
    # before: 32 cold cells (and the legend's warm swatch); after: the routed cells turned warm
    assert cold_pixels(before) >= 32 * 4 and cold_pixels(after) < cold_pixels(before)
    assert warm_pixels(after) - warm_pixels(before) >= routed_cells * 4, (warm_pixels(before), warm_pixels(after))
