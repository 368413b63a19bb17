"""Do the model's answers to real agent requests end? Each request the clients really sent
(tests/fixtures/agents/*_recorded.json) is posted to `colibri-stream serve` on MODEL, unstreamed, with
the answer capped at --max-tokens, and the table says how each answer ended (the API's own stop reason),
its length in tokens, the prompt's, and the start of its text. A client that sees its answer cut (Codex:
Responses status `incomplete`) fails the turn, so every row should end by itself (stop / end_turn /
completed) well inside the cap.

    python tools/agent_answer_ends.py [MODEL] [--max-tokens 512] [--port 8177] [--clients codex,...]

MODEL: a checkpoint directory or container (default: the shipped demo model).
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from colibri_stream.checkpoint.demo_model import demo_model_dir

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "agents"
CLIENTS = ("claude_code", "codex", "opencode", "aider")
KEY = "answer-ends"


def capped(path: str, body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The recorded body, unstreamed, its answer limited with the route's own field."""
    body = dict(body, stream=False)
    body.pop("stream_options", None)
    field = "max_output_tokens" if path.startswith("/v1/responses") else "max_tokens"
    body[field] = max_tokens
    return body


def ending(path: str, answer: dict[str, Any]) -> tuple[str, int, int, str]:
    """(stop reason, answer tokens, prompt tokens, text) in each API's own fields."""
    usage = answer.get("usage") or {}
    if path.startswith("/v1/responses"):
        text = "".join(part.get("text", "") for item in answer.get("output", []) for part in item.get("content") or [])
        return answer.get("status", "?"), usage.get("output_tokens", 0), usage.get("input_tokens", 0), text
    if path.startswith("/v1/messages"):
        text = "".join(block.get("text", "") for block in answer.get("content", []))
        prompt = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
        return answer.get("stop_reason", "?"), usage.get("output_tokens", 0), prompt, text
    choice = answer["choices"][0]
    text = choice["message"].get("content") or ""
    return choice.get("finish_reason", "?"), usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0), text


def post(port: int, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    connection.request("POST", path, json.dumps(body), {"content-type": "application/json", **headers})
    response = connection.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def wait_ready(port: int, server: subprocess.Popen, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"serve exited with {server.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/v1/models", headers={"authorization": f"Bearer {KEY}"})
            if connection.getresponse().status == 200:
                return
        except OSError:
            time.sleep(1)
    sys.exit(f"serve did not answer on port {port} within {limit_s:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", type=Path, help="default: the shipped demo model")
    parser.add_argument("--max-tokens", type=int, default=512, help="answer cap (default 512)")
    parser.add_argument("--port", type=int, default=8177)
    parser.add_argument("--clients", default=",".join(CLIENTS), help=f"comma-separated, of {list(CLIENTS)}")
    args = parser.parse_args()
    model = args.model or demo_model_dir()
    command = [sys.executable, "-m", "colibri_stream", "serve", str(model), "--port", str(args.port), "--api-key", KEY]
    server_log = tempfile.NamedTemporaryFile("w+", prefix="serve-", suffix=".log", delete=False)
    server = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT)  # a pipe unread would block it
    print(f"serve log: {server_log.name}", file=sys.stderr)
    failures = 0
    try:
        wait_ready(args.port, server)
        print(f"{'client':12} {'route':22} {'status':7} {'ended':11} {'answer':>6} {'prompt':>7}  text")
        for client in args.clients.split(","):
            recorded = json.loads((FIXTURES / f"{client}_recorded.json").read_text())
            path = recorded["path"]
            headers = {"authorization": f"Bearer {KEY}", "x-api-key": KEY, "anthropic-version": "2023-06-01"}
            started = time.perf_counter()
            status, answer = post(args.port, path, capped(path, recorded["body"], args.max_tokens), headers)
            if status != 200:
                failures += 1
                print(f"{client:12} {path:22} {status:<7} {json.dumps(answer)[:200]}")
                continue
            stop, out, prompt, text = ending(path, answer)
            failures += out >= args.max_tokens
            seconds = time.perf_counter() - started
            print(f"{client:12} {path:22} {status:<7} {stop:11} {out:6} {prompt:7}  {text[:70]!r} ({seconds:.0f} s)")
    finally:
        server.terminate()
        server.wait(30)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
