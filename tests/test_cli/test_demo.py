"""The shipped demo model (colibri_stream/demo_model) and `colibri-stream demo`.

The demo checkpoint is committed, so these tests run it for real: the engine must match transformers
on it, the demo command must convert it and stream its experts, the session must make the second run
warm, the trained router must be skewed, and int4 must keep its held-out perplexity within 5%.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch

from colibri_stream import cli
from colibri_stream.checkpoint.demo_model import DEMO_PROMPT, demo_model_dir
from colibri_stream.cli.demo import describe
from colibri_stream.devtools.fixtures import load_reference, oracle_greedy
from colibri_stream.devtools.train_demo import engine_perplexity, expert_counts, heldout_windows
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import CheckpointError, load_checkpoint, load_container
from colibri_stream.text.chat_format import load_tokenizer

DEMO = demo_model_dir()


def run_demo(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["demo", "--json", "--max-new-tokens", "6", *argv]) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The first demo run in a fresh cache directory: it converts the model, then generates."""
    cache_home = tmp_path_factory.mktemp("xdg")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache_home))
        return cache_home, run_demo()


@pytest.fixture(scope="module")
def windows() -> list[torch.Tensor]:
    """A small held-out slice (2 x 256 tokens of stdlib modules the model was not trained on)."""
    return heldout_windows(DEMO, seq_len=256, n_tokens=512)


def test_demo_checkpoint_is_small_and_has_every_streamed_feature():
    config = json.loads((DEMO / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa"
    assert config["n_routed_experts"] >= 16 and config["num_experts_per_tok"] > 1 and config["n_shared_experts"] == 1
    assert {"full", "shared"} <= set(config["indexer_types"]) and config["index_n_heads"] >= 16
    assert sum(f.stat().st_size for f in DEMO.iterdir()) < 40 * 1024 * 1024
    assert (DEMO / "tokenizer.json").is_file() and "chat_template" in json.loads(
        (DEMO / "tokenizer_config.json").read_text()
    )


def test_demo_help_and_missing_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    assert "colibri-stream demo --prompt" in capsys.readouterr().out.split("examples:", 1)[1]
    with pytest.raises(CheckpointError, match="demo model is missing"):
        demo_model_dir(tmp_path)


def test_engine_greedy_equals_transformers_on_the_demo_model():
    prompt = load_tokenizer(DEMO).encode(DEMO_PROMPT).ids
    loaded = load_checkpoint(DEMO)
    ours = generate(loaded.model, prompt, 12, loaded.experts).ids
    assert ours == oracle_greedy(load_reference(DEMO), prompt, 12)


def test_first_demo_run_converts_and_streams_experts(first_run):
    cache_home, out = first_run
    assert list((cache_home / "colibri-stream" / "demo").glob("*.cstream")), "the demo converted nothing"
    stats = out["stats"]
    assert len(out["ids"]) == 6 and out["text"]
    assert stats["misses"] > 0 and stats["expert_bytes_read"] > 0
    assert stats["hits"]["ram"] + stats["misses"] == stats["expert_requests"]
    assert stats["prefetch_recall"] is not None and stats["reused_tokens"] == 0
    assert "misses" in describe(stats, 1 << 20)


def test_second_demo_run_reuses_the_session(first_run, monkeypatch):
    cache_home, first = first_run
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    stats = run_demo()["stats"]
    assert stats["reused_tokens"] > 0
    assert stats["prefill_tokens"] == first["stats"]["prefill_tokens"] - stats["reused_tokens"]


def test_trained_router_usage_is_skewed(windows):
    """A trained router prefers some experts: in every MoE layer the busiest expert gets several
    times the routings of the idlest (uniform routing would give a ratio near 1)."""
    counts = expert_counts(load_checkpoint(DEMO), windows).float()
    ratio = counts.max(dim=1).values / counts.min(dim=1).values.clamp(min=1)
    assert (ratio > 4).all(), ratio.tolist()


def test_int4_heldout_perplexity_within_5_percent_of_float(first_run, windows):
    cache_home, _ = first_run
    container = next((cache_home / "colibri-stream" / "demo").glob("*.cstream"))
    float_ppl = engine_perplexity(load_checkpoint(DEMO), windows)
    int4_ppl = engine_perplexity(load_container(container), windows)
    # trained: 56.6 over 16k held-out tokens (demo_model/README.md); random weights give ~4096
    assert math.isfinite(float_ppl) and float_ppl < 200
    assert abs(int4_ppl / float_ppl - 1) < 0.05, (float_ppl, int4_ppl)


def test_serve_without_a_model_serves_the_demo_with_tools(first_run, tmp_path):
    """`colibri-stream serve` with no PATH: the demo's container (the one the first demo run converted), named
    colibri-demo, with a context an agent's preamble fits in and a template that renders the tools offered."""
    cache_home, _ = first_run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "colibri_stream", "serve", "--port", str(port), "--kv-dir", str(tmp_path)]
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "serve did not start"
            try:
                models = client.models.list().data
                break
            except openai.APIConnectionError:
                time.sleep(0.2)
        assert [m.id for m in models] == ["colibri-demo"]
        tool = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}
        preamble = "You are a coding agent. " * 1200  # ~6k tokens: past the old 2048-token context
        answer = client.chat.completions.create(
            model="anything",
            messages=[{"role": "system", "content": preamble}, {"role": "user", "content": "List the files."}],
            tools=[tool],
            max_tokens=4,
            temperature=0,
        )
        assert answer.model == "colibri-demo" and answer.usage.prompt_tokens > 2048
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 0
