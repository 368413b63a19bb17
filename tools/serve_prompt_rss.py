"""The server's peak RSS while it refuses maximal prompts, against the plan: `serve` runs in a child
process, ``--clients`` requests of a chat message as large as a body may be arrive at once, and the
child's RSS is sampled (psutil) until every answer is in. Reports JSON, asserts nothing.

    python -m colibri_stream convert colibri_stream/demo_model /tmp/demo.cstream   # once
    python tools/serve_prompt_rss.py /tmp/demo.cstream [--ram 25%] [--clients 4]

The process measured is whichever `colibri_stream` the child imports (PYTHONPATH picks another tree)."""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from colibri_stream.planning.budget import StoreOptions, store_config
from colibri_stream.planning.geometry import model_geometry
from colibri_stream.planning.placement import plan

MODEL = "rss-probe"
SAMPLE_S = 0.01
MAX_BODY_BYTES = 4 * 2**20  # serve/intake.py's limit (an application: not imported from here)
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def maximal_chat_body() -> bytes:
    """A chat request just under the body limit: one user message of plain words."""
    shell = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}], "max_tokens": 4})
    words = "word " * ((MAX_BODY_BYTES - len(shell) - 64) // 5)
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 4}).encode()


def post(port: int, body: bytes) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=START_TIMEOUT_S)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    reply = conn.getresponse()
    text = reply.read().decode(errors="replace")
    conn.close()
    return reply.status, text[:200]


def wait_ready(port: int, child: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise SystemExit(f"serve exited with {child.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("serve did not start")


class PeakSampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.process, self.peak, self.stop = psutil.Process(pid), 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(SAMPLE_S)


def measure(container: Path, ram: str, clients: int) -> dict[str, object]:
    geometry = model_geometry(container)
    planned = plan(geometry, store_config(StoreOptions(ram=ram), geometry, "float32"), sequences=2 * clients)
    port = free_port()
    with tempfile.TemporaryDirectory() as kv:
        command = [sys.executable, "-m", "colibri_stream", "serve", str(container), "--port", str(port)]
        command += ["--ram", ram, "--slots", str(clients), "--model-name", MODEL, "--kv-dir", kv]
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(port, child)
            idle = psutil.Process(child.pid).memory_info().rss
            sampler = PeakSampler(child.pid)
            sampler.start()
            body = maximal_chat_body()
            with ThreadPoolExecutor(clients) as pool:
                answers = list(pool.map(lambda _: post(port, body), range(clients)))
            sampler.stop.set()
            sampler.join()
        finally:
            child.terminate()
            child.wait(timeout=60)
    expected = planned.expected_peak_rss_bytes
    return {
        "container": str(container),
        "clients": clients,
        "body_bytes": len(body),
        "statuses": [status for status, _ in answers],
        "first_answer": answers[0][1],
        "idle_rss_mib": round(idle / 2**20, 1),
        "peak_rss_mib": round(sampler.peak / 2**20, 1),
        "planned_peak_rss_mib": round(expected / 2**20, 1),
        "peak_over_plan": round(sampler.peak / expected, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("container", type=Path)
    parser.add_argument("--ram", default="25%")
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    print(json.dumps(measure(args.container, args.ram, args.clients), indent=2))


if __name__ == "__main__":
    main()
