"""Sessions end to end: warm restart across processes with zero re-prefill, divergence, reset, locks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from colibri_stream import cli
from colibri_stream.devtools import fixtures
from colibri_stream.planning.kv_bytes import kv_geometry, naive_kv_bytes_per_token
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint

PROMPT = fixtures.make_prompt(512, 20)  # > index_topk (8): the DSA indexer selects from the start
ADDED = [77, 78, 79, 80]


def _run_cli(checkpoint, ids, kv_dir, *extra) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri_stream",
            "run",
            str(checkpoint),
            "--ids",
            ",".join(map(str, ids)),
            "--max-new-tokens",
            "8",
            "--session",
            "chat",
            "--kv-dir",
            str(kv_dir),
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_warm_restart_in_a_new_process_reuses_everything_and_matches(tiny_checkpoints, tmp_path):
    checkpoint = tiny_checkpoints["deepseek_v32"]
    turn1 = _run_cli(checkpoint, PROMPT, tmp_path)
    prompt2 = PROMPT + turn1["ids"] + ADDED
    turn2 = _run_cli(checkpoint, prompt2, tmp_path)  # a new process: only the session file carries over
    history = len(PROMPT) + len(turn1["ids"]) - 1  # the last generated token was never run
    assert turn2["stats"]["reused_tokens"] == history
    assert turn2["stats"]["prefill_tokens"] == len(prompt2) - history == 1 + len(ADDED)

    loaded = load_checkpoint(checkpoint)
    cache = loaded.model.new_cache()
    first = generate(loaded.model, PROMPT, 8, loaded.experts, cache=cache).ids
    second = generate(loaded.model, prompt2, 8, loaded.experts, cache=cache).ids  # one process, both turns
    fresh = generate(loaded.model, prompt2, 8, loaded.experts).ids
    assert first == turn1["ids"] and turn2["ids"] == second == fresh


def test_an_edited_conversation_reuses_the_common_prefix_only(tiny_checkpoints, tmp_path):
    checkpoint = tiny_checkpoints["glm_moe_dsa"]
    _run_cli(checkpoint, PROMPT, tmp_path)
    edited = PROMPT[:12] + [5, 6, 7] + PROMPT[15:]
    result = _run_cli(checkpoint, edited, tmp_path)
    assert result["stats"]["reused_tokens"] == 12
    loaded = load_checkpoint(checkpoint)
    assert result["ids"] == generate(loaded.model, edited, 8, loaded.experts).ids


def test_reset_starts_over(tiny_checkpoints, tmp_path, capsys):
    checkpoint = str(tiny_checkpoints["kimi_k2"])
    argv = ["run", checkpoint, "--ids", ",".join(map(str, PROMPT)), "--session", "s", "--kv-dir", str(tmp_path)]
    assert cli.main([*argv, "--json"]) == 0
    assert cli.main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]["reused_tokens"] == len(PROMPT) - 1
    assert cli.main([*argv, "--reset", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]["reused_tokens"] == 0


def test_a_session_open_in_another_process_is_a_clear_error(tiny_checkpoints, tmp_path, capsys):
    checkpoint = tiny_checkpoints["deepseek_v3"]
    argv = ["run", str(checkpoint), "--ids", "5,6,7", "--session", "busy", "--kv-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'r+'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(30)",
            str(tmp_path / "busy.kvlog"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        capsys.readouterr()
        assert cli.main(argv) == 1
        assert "in use by another process" in capsys.readouterr().err
    finally:
        holder.kill()


def test_a_session_of_another_model_is_refused(tiny_checkpoints, tmp_path, capsys):
    ids = ",".join(map(str, PROMPT))
    assert (
        cli.main(
            ["run", str(tiny_checkpoints["deepseek_v3"]), "--ids", ids, "--session", "x", "--kv-dir", str(tmp_path)]
        )
        == 0
    )
    before = (tmp_path / "x.kvlog").read_bytes()
    assert (
        cli.main(["run", str(tiny_checkpoints["kimi_k2"]), "--ids", ids, "--session", "x", "--kv-dir", str(tmp_path)])
        == 1
    )
    assert "fingerprint mismatch" in capsys.readouterr().err
    assert (tmp_path / "x.kvlog").read_bytes() == before


def test_kv_info_reports_bytes_per_token_and_the_ratio(tiny_checkpoints, tmp_path, capsys):
    checkpoint = tiny_checkpoints["deepseek_v32"]
    _run_cli(checkpoint, PROMPT, tmp_path)
    assert cli.main(["kv", "info", str(checkpoint), "chat", "--kv-dir", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    args = load_checkpoint(checkpoint).args
    per_token = (
        args.n_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * 4 + args.n_layers * args.index_head_dim * 4
    )
    assert info["bytes_per_token"] == per_token + 8  # + token id and crc32c
    assert info["tokens"] == len(PROMPT) + 8 - 1
    assert info["compression_vs_naive"] == round(naive_kv_bytes_per_token(args, "float32") / info["bytes_per_token"], 2)
    assert cli.main(["kv", "ls", str(checkpoint), "--kv-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("chat\t27 tokens")
    assert cli.main(["kv", "rm", str(checkpoint), "chat", "--kv-dir", str(tmp_path)]) == 0
    assert not (tmp_path / "chat.kvlog").exists()


def test_glm5_geometry_compression():
    """Real GLM-5 shapes (transformers' defaults): 576 floats per token per layer against 64 heads x 512."""
    from transformers import GlmMoeDsaConfig

    from engine.config.args import ModelArgs

    args = ModelArgs.from_hf_config({**GlmMoeDsaConfig().to_dict(), "model_type": "glm_moe_dsa"})
    naive = naive_kv_bytes_per_token(args, "float32")
    mla_only = naive / (args.n_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * 4)
    assert mla_only == pytest.approx(56.9, abs=0.05)
    with_indexer = naive / kv_geometry(args).record_bytes
    assert with_indexer == pytest.approx(46.5, abs=0.1)  # every GLM-5 default layer is a full DSA layer


def test_bfloat16_records_restore_close_to_float32(tiny_checkpoints, tmp_path):
    """bf16 halves the file; restored states differ by bf16 rounding (tokens may drift; see the note)."""
    from colibri_stream.runtime.kv.records import cache_from_payloads, cache_payloads

    loaded = load_checkpoint(tiny_checkpoints["deepseek_v32"])
    cache = loaded.model.new_cache()
    loaded.model(torch.tensor([PROMPT]), 0, cache, loaded.experts)
    for dtype, tolerance in (("float32", 0.0), ("bfloat16", 1e-2)):
        geometry = kv_geometry(loaded.args, dtype)
        restored = cache_from_payloads(
            cache_payloads(cache, 0, len(PROMPT), geometry), geometry, loaded.args, torch.float32
        )
        for a, b in zip(cache.state(), restored.state(), strict=True):
            for key in a:
                assert (a[key] - b[key]).abs().max().item() <= tolerance * a[key].abs().max().item()


def test_kv_sync_every_n_tokens_appends_during_the_turn(tiny_checkpoints, tmp_path, monkeypatch, capsys):
    from storage.kv.log import KVLog

    appends: list[int] = []
    original = KVLog.append

    def spy(self, tokens, payloads, sync=True):
        appends.append(len(tokens))
        return original(self, tokens, payloads, sync)

    monkeypatch.setattr(KVLog, "append", spy)
    argv = ["run", str(tiny_checkpoints["deepseek_v3"]), "--ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "9"]
    assert cli.main([*argv, "--session", "s", "--kv-dir", str(tmp_path), "--kv-sync-every", "3"]) == 0
    # tokens 3 and 6 and 9 each persist what was computed so far; the turn end has nothing left to add
    assert appends == [len(PROMPT) + 2, 3, 3]
    assert cli.main(["kv", "info", argv[1], "s", "--kv-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == len(PROMPT) + 8
