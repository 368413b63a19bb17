"""run's siblings on a DeepSeek-V4 container: chat resumes warm in a new process, serve gives concurrent
sessions their solo tokens, demo --model walks through streaming and the session file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import openai
import pytest

from colibri_stream.runtime.turn import RuntimeOptions, load_runtime

WAIT_S = 120


def _cli(*argv: str, stdin: str | None = None, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_vars}
    done = subprocess.run(
        [sys.executable, "-m", "colibri_stream", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def container(make_container):
    return make_container("deepseek_v4")


def test_chat_turns_resume_warm_in_a_new_process(container, tmp_path):
    argv = [
        "chat",
        str(container),
        "--kv-dir",
        str(tmp_path),
        "--session",
        "v4",
        "--max-new-tokens",
        "6",
        "--ram",
        "60%",
    ]
    first = _cli(*argv, stdin="Hello there\nAnd then?\n:stats\n")
    stats = json.loads(first.stderr.strip().splitlines()[-1])
    assert stats["messages"] == 4 and stats["stored_tokens"] > 0 and stats["store"]["misses"] > 0
    again = _cli(*argv, stdin="One more\n:stats\n")
    assert "resumed, 4 messages" in again.stderr
    assert json.loads(again.stderr.strip().splitlines()[-1])["stored_tokens"] > stats["stored_tokens"]


def test_serve_gives_concurrent_sessions_their_solo_tokens(container, tmp_path, live_server):
    runtime = load_runtime(container, RuntimeOptions(kv_dir=tmp_path, model_id="v4"))
    served = live_server(runtime, slots=2)
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)

    def complete(prompt: str, session: str) -> tuple[str, dict]:
        headers = {"X-Colibri-Session": session}
        done = client.completions.create(model="v4", prompt=prompt, max_tokens=8, temperature=0, extra_headers=headers)
        return done.choices[0].text, done.model_extra["colibri"]

    prompts = ["The quick brown fox", "Experts stream from disk"]
    solo = [complete(p, f"solo-{i}")[0] for i, p in enumerate(prompts)]
    results: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, complete(prompts[i], f"c{i}")[0])) for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WAIT_S)
    assert [results[0], results[1]] == solo
    again, stats = complete(prompts[0], "solo-0")
    assert again == solo[0] and stats["reused_tokens"] > 0


def test_demo_runs_a_v4_container_and_resumes_its_session(container, tmp_path):
    argv = ["demo", "--model", str(container), "--prompt", "Hello there", "--max-new-tokens", "6", "--json"]
    first = json.loads(_cli(*argv, XDG_CACHE_HOME=str(tmp_path)).stdout.strip().splitlines()[-1])
    second = json.loads(_cli(*argv, XDG_CACHE_HOME=str(tmp_path)).stdout.strip().splitlines()[-1])
    assert first["stats"]["misses"] > 0 and first["stats"]["reused_tokens"] == 0
    assert second["ids"] == first["ids"] and second["stats"]["reused_tokens"] > 0
