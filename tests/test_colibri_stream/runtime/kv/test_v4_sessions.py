"""DeepSeek-V4 sessions: its lean KV log (storage/kv/lean_log.py) holds per position the compressed entries and
snapshots of the window state, so a warm restart in a new process continues with nothing re-prefilled, a
damaged log or an edited conversation restores the last whole snapshot before the damage or the edit and
re-prefills fewer than ``snapshot_every`` positions, and a log held in memory continues exactly as one
restored from the file; every turn's tokens are a fresh run's."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from colibri_stream import cli
from colibri_stream.devtools import fixtures
from colibri_stream.errors import SessionError
from colibri_stream.planning.kv_bytes import (
    cache_bytes_per_token,
    compressed_kv_bytes_per_token,
    kv_geometry,
    naive_kv_bytes_per_token,
    session_geometry,
)
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.kv.pool import SessionPool
from colibri_stream.runtime.kv.sessions import Session, session_info
from colibri_stream.runtime.loader import load_checkpoint
from engine.config.args import ModelArgs
from storage.kv.lean_log import LeanLog
from storage.kv.log import HEADER_BYTES, KVLog, read_header_state

# 20 > index_topk (4) x CSA rate (2): the indexer selects. With 8 new tokens the log holds 27 positions:
# the restart lands inside an open HCA window (8) and an open CSA window (2).
PROMPT = fixtures.make_prompt(512, 20)
ADDED = [77, 78, 79, 80]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def v4(tiny_v4_checkpoint):
    return load_checkpoint(tiny_v4_checkpoint)


def _argv(checkpoint, ids, kv_dir) -> list[str]:
    run = ["run", str(checkpoint), "--ids", ",".join(map(str, ids)), "--max-new-tokens", str(NEW_TOKENS), "--json"]
    return [*run, "--session", "chat", "--kv-dir", str(kv_dir)]


def _turn(capsys, checkpoint, ids, kv_dir) -> dict:
    """One `run --session chat` turn in this process: its --json object."""
    capsys.readouterr()
    assert cli.main(_argv(checkpoint, ids, kv_dir)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _turn_in_a_new_process(checkpoint, ids, kv_dir) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "colibri_stream", *_argv(checkpoint, ids, kv_dir)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_warm_restart_in_a_new_process_reuses_everything_and_matches(v4, tiny_v4_checkpoint, tmp_path, capsys):
    turn1 = _turn(capsys, tiny_v4_checkpoint, PROMPT, tmp_path)
    prompt2 = PROMPT + turn1["ids"] + ADDED
    turn2 = _turn_in_a_new_process(tiny_v4_checkpoint, prompt2, tmp_path)  # only the log carries over
    history = len(PROMPT) + NEW_TOKENS - 1  # the last generated token was never run
    assert turn2["stats"]["reused_tokens"] == history
    assert turn2["stats"]["prefill_tokens"] == len(prompt2) - history == 1 + len(ADDED)

    cache = v4.model.new_cache()
    first = generate(v4.model, PROMPT, NEW_TOKENS, v4.experts, cache=cache).ids
    second = generate(v4.model, prompt2, NEW_TOKENS, v4.experts, cache=cache).ids  # one process, both turns
    fresh = generate(v4.model, prompt2, NEW_TOKENS, v4.experts).ids
    assert first == turn1["ids"] and turn2["ids"] == second == fresh
    assert len(set(fresh)) > 1  # a varied answer, not one repeated token


# 40 + 8 new tokens: the float32 log (a kept snapshot every 32 positions) holds 47 positions, the kept
# snapshot at 32 and the end snapshot at 47.
LONG_PROMPT = fixtures.make_prompt(512, 40, seed=5)


def _frames(path, args):
    """The log's frames, read as the session would (its own fingerprint from the header)."""
    fingerprint, geometry, state = read_header_state(path)
    with LeanLog(path, fingerprint, geometry, state=state) as log:
        return log.frames, log.snapshots


@pytest.mark.parametrize("how", ["torn-end-snapshot", "bit-flip-in-the-end-snapshot", "bit-flip-in-the-kept-snapshot"])
def test_a_damaged_log_restores_its_last_whole_snapshot_and_matches_a_fresh_run(
    v4, tiny_v4_checkpoint, tmp_path, capsys, how
):
    turn1 = _turn(capsys, tiny_v4_checkpoint, LONG_PROMPT, tmp_path)
    path = tmp_path / "chat.kvlog"
    frames, snapshots = _frames(path, v4.args)
    every = session_geometry(v4.args).snapshot_every
    assert snapshots == [0, every, len(LONG_PROMPT) + NEW_TOKENS - 1]  # a kept snapshot, the end one
    kept = next(f for f in frames if f.tag == b"SNP\x00" and f.position == every)
    end = [f for f in frames if f.tag == b"SNP\x00"][-1]  # followed by the turn's bookmark (its prompt's end)
    assert frames[-1].tag == b"BMK\x00" and frames[-1].position == len(LONG_PROMPT) - 1
    data = bytearray(path.read_bytes())
    if how == "torn-end-snapshot":
        data = data[: end.offset + (end.end - end.offset) // 2]
    else:
        frame = end if how == "bit-flip-in-the-end-snapshot" else kept
        data[(frame.offset + frame.end) // 2] ^= 0x20
    path.write_bytes(bytes(data))
    restored = every if how != "bit-flip-in-the-kept-snapshot" else 0  # a torn snapshot is never used
    prompt2 = LONG_PROMPT + turn1["ids"] + ADDED
    turn2 = _turn(capsys, tiny_v4_checkpoint, prompt2, tmp_path)
    assert turn2["stats"]["reused_tokens"] == restored
    assert turn2["stats"]["prefill_tokens"] == len(prompt2) - restored
    assert turn2["ids"] == generate(v4.model, prompt2, NEW_TOKENS, v4.experts).ids
    assert cli.main(["kv", "info", str(tiny_v4_checkpoint), "chat", "--kv-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == len(prompt2) + NEW_TOKENS - 1  # recut, refilled


@pytest.mark.parametrize("at", [13, 37])
def test_an_edited_conversation_cuts_the_log_and_continues_exactly(v4, tiny_v4_checkpoint, tmp_path, capsys, at):
    """The edit lands inside an open HCA window (8 positions) and CSA window (2): the log restores its last
    snapshot at or before it (none before the kept one at 32: the empty state) and re-prefills the rest."""
    _turn(capsys, tiny_v4_checkpoint, LONG_PROMPT, tmp_path)
    edited = LONG_PROMPT[:at] + [5, 6, 7] + LONG_PROMPT[at + 3 :]
    result = _turn(capsys, tiny_v4_checkpoint, edited, tmp_path)
    every = session_geometry(v4.args).snapshot_every
    restored = at // every * every
    assert result["stats"]["reused_tokens"] == restored
    assert result["stats"]["prefill_tokens"] == len(edited) - restored  # at - restored < every re-prefilled
    assert result["ids"] == generate(v4.model, edited, NEW_TOKENS, v4.experts).ids
    again = _turn(capsys, tiny_v4_checkpoint, edited + result["ids"] + ADDED, tmp_path)  # the cut log continues
    assert again["stats"]["reused_tokens"] == len(edited) + NEW_TOKENS - 1
    assert again["ids"] == generate(v4.model, edited + result["ids"] + ADDED, NEW_TOKENS, v4.experts).ids


def test_an_edit_continued_from_memory_trims_the_cache_and_the_log(v4, tmp_path):
    """The server's path: the cache held in memory cannot be cut back past its released rows
    (RowsReleased), so the log restores its last snapshot before the edit."""
    session = Session(tmp_path, "edit", "fp", v4.args)
    start = session.start_turn(LONG_PROMPT, torch.float32)
    ids = LONG_PROMPT + generate(v4.model, LONG_PROMPT, NEW_TOKENS, v4.experts, cache=start.cache).ids
    session.end_turn(start.cache, ids)
    held_ids = ids[: start.cache.length]
    edited = LONG_PROMPT[:37] + [5, 6, 7] + LONG_PROMPT[40:]
    turn = session.continue_turn(start.cache, held_ids, edited)
    every = session.geometry.snapshot_every
    assert turn.reused_tokens == turn.cache.length == session.log.length == every
    answer = generate(v4.model, edited, NEW_TOKENS, v4.experts, cache=turn.cache).ids
    session.close()
    assert answer == generate(v4.model, edited, NEW_TOKENS, v4.experts).ids


def _next_turn_logits(v4, cache, prompt, reused: int) -> torch.Tensor:
    return v4.model(torch.tensor([prompt[reused:]]), reused, cache, v4.experts)[0]


@pytest.mark.parametrize("record_dtype", ["bfloat16", "float32"])
def test_a_turn_continued_from_memory_equals_one_restored_from_the_log(v4, tmp_path, record_dtype):
    session = Session(tmp_path, "held", "fp", v4.args, record_dtype)
    start = session.start_turn(PROMPT, torch.float32)
    ids = PROMPT + generate(v4.model, PROMPT, NEW_TOKENS, v4.experts, cache=start.cache).ids
    session.end_turn(start.cache, ids)
    pool = SessionPool(1)
    pool.put(session, start.cache, ids[: start.cache.length])  # as_logged: rows rounded, entries dropped
    held = pool.take("held")
    prompt2 = ids + ADDED
    memory = held.session.continue_turn(held.cache, held.ids, prompt2)
    held.session.close()
    reread = Session(tmp_path, "held", "fp", v4.args, record_dtype)
    restored = reread.start_turn(prompt2, torch.float32)
    reread.close()
    assert memory.reused_tokens == restored.reused_tokens == len(ids) - 1
    from_memory = _next_turn_logits(v4, memory.cache, prompt2, memory.reused_tokens)
    from_log = _next_turn_logits(v4, restored.cache, prompt2, restored.reused_tokens)
    assert torch.equal(from_memory, from_log)
    if record_dtype == "bfloat16":  # the same positions as computed, not as logged: the rounding shows
        unrounded = v4.model.new_cache()
        v4.model(torch.tensor([ids[:-1]]), 0, unrounded, v4.experts)
        assert not torch.equal(_next_turn_logits(v4, unrounded, prompt2, len(ids) - 1), from_log)


def test_kv_info_reports_v4_bytes_per_token(tiny_v4_checkpoint, tmp_path, capsys):
    """Sizes recomputed from config.json by hand: entries one per m positions, and the log's bytes per
    token within twice the in-memory state."""
    _turn(capsys, tiny_v4_checkpoint, PROMPT, tmp_path)
    assert cli.main(["kv", "info", str(tiny_v4_checkpoint), "chat", "--kv-dir", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    config = json.loads((tiny_v4_checkpoint / "config.json").read_text())
    d, index, rates = config["head_dim"], config["index_head_dim"], config["compress_rates"]
    rows = {
        "sliding_attention": d,
        "heavily_compressed_attention": d + 2 * d,  # kv; compressor kv and gate
        "compressed_sparse_attention": d + 2 * (2 * d) + 2 * (2 * index),  # + overlapping halves, indexer
    }
    entries = {
        "sliding_attention": 0,
        "heavily_compressed_attention": d / rates["heavily_compressed_attention"],
        "compressed_sparse_attention": (d + index) / rates["compressed_sparse_attention"],
    }
    types = config["layer_types"]
    assert set(types) == set(rows)  # every layer type is in the fixture
    assert info["tokens"] == len(PROMPT) + NEW_TOKENS - 1
    path = tmp_path / "chat.kvlog"
    assert info["file_bytes"] == path.stat().st_size
    assert info["in_memory_bytes_per_token"] == 4 * sum(entries[t] for t in types)  # rows released once logged
    assert info["bytes_per_token"] <= 2 * info["in_memory_bytes_per_token"]
    assert (info["snapshots"], info["snapshot_every"]) == (1, 32)  # the end snapshot; kept ones every 32
    # The file: the header, the turn's frames (prompt chunks and decode syncs), the end snapshot and the
    # bookmark of the turn's prompt.
    fixed = HEADER_BYTES + info["fixed_bytes_max"]
    assert info["file_bytes"] <= fixed + info["tokens"] * info["bytes_per_token"]
    assert info["compressed_kv_bytes_per_token"] == 4 * sum(entries[t] for t in types)
    assert info["naive_kv_bytes_per_token"] == 4 * d * len(types)  # one K=V head per layer
    assert info["naive_kv"] == "one uncompressed K=V head per layer (MQA)"
    assert info["compression_vs_naive"] == round(info["naive_kv_bytes_per_token"] / info["bytes_per_token"], 2)
    assert sum(rows[t] for t in types) * 4 > 5 * info["bytes_per_token"]  # the rows a format-3 log held


# DeepSeek-V4-Flash's config.json (the published hub file, as transcribed in public test suites): 43
# layers, two sliding-only, then CSA (m=4) and HCA (m'=128) alternating; one K=V head of 512, index 128.
FLASH = dict(
    model_type="deepseek_v4",
    vocab_size=129280,
    hidden_size=4096,
    moe_intermediate_size=2048,
    num_hidden_layers=43,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=6,
    num_hash_layers=3,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    sliding_window=128,
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],  # the last entry: the MTP layer
    max_position_embeddings=1048576,
    rope_theta=10000,
    compress_rope_theta=160000,
    rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1),
)


def test_deepseek_v4_flash_kv_bytes_per_token():
    """bf16, per token: the log holds 2 x 512 + 21 CSA x 3072 + 20 HCA x 1536 values (188 KiB), 4.4x a
    naive one-head cache; the compressed entries attention works from are 21 x (512 + 128) / 4 + 20 x
    512 / 128 values (6.7 KiB), 6.4x less than the naive cache and 10x less than V3's MLA latent."""
    args = ModelArgs.from_hf_config(FLASH)
    types = args.v4.layer_types
    assert [types.count(t) for t in ("sliding_attention", "compressed_sparse_attention")] == [2, 21]
    record = kv_geometry(args, "bfloat16").record_bytes
    assert record == 4 + 2 * (2 * 512 + 21 * 3072 + 20 * 1536) + 4 == 192520
    assert naive_kv_bytes_per_token(args, "bfloat16") == 43 * 512 * 2 == 44032
    assert compressed_kv_bytes_per_token(args, "bfloat16") == 2 * (21 * 160 + 20 * 4) == 6880
    assert cache_bytes_per_token(args, "bfloat16") == 6880  # rows released once logged
    v3_latent = 61 * (512 + 64) * 2  # DeepSeek-V3's MLA record payload, bf16
    assert round(v3_latent / compressed_kv_bytes_per_token(args, "bfloat16"), 1) == 10.2


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deepseek_v4_flash_session_log_bytes_per_token_within_twice_the_in_memory_state(dtype):
    """The lean session log on V4-Flash: per token the entries (6880 B in bf16) + token + a frame per
    position (an append per token, the worst case) + a kept snapshot of the windows (6.0 MB in bf16:
    43 x 127 K=V rows of 512, 21 CSA x 4 compressor rows of 2 x 1024, 21 x 4 indexer rows of 2 x 256)
    every 896 positions: 13633 B in bf16, <= 2 x 6880; the record a prefix block keeps is 14x that."""
    args = ModelArgs.from_hf_config(FLASH)
    geometry = session_geometry(args, dtype)
    item = 2 if dtype == "bfloat16" else 4
    in_memory = cache_bytes_per_token(args, dtype)
    assert geometry.snapshot_every == 896  # a multiple of 128 (HCA's m') and 4 (CSA's m)
    window_values = 43 * 127 * 512 + 21 * 4 * 2 * 1024 + 21 * 4 * 2 * 256
    assert geometry.kept_snapshot_bytes == 28 + window_values * item
    assert geometry.bytes_per_token == 4 + 28 + in_memory + geometry.kept_snapshot_bytes / 896
    assert geometry.bytes_per_token <= 2 * in_memory
    assert kv_geometry(args, dtype).record_bytes > 14 * geometry.bytes_per_token


def test_kv_info_of_a_model_with_sliding_layers_only(tmp_path):
    """No compressed layer: per token only its token and frame, the window snapshotted every 4096
    positions, and no ratio to divide by zero."""
    args = ModelArgs.from_hf_config({**FLASH, "compress_ratios": [0] * 44})
    Session(tmp_path, "s", "fp", args, "bfloat16").close()
    info = session_info(tmp_path / "s.kvlog", args)
    assert info["snapshot_every"] == 4096
    assert info["bytes_per_token"] == round(4 + 28 + (28 + 43 * 127 * 512 * 2) / 4096, 2)
    assert (info["compressed_kv_bytes_per_token"], info["compressed_vs_naive"]) == (0.0, None)


def test_a_long_prompt_in_a_session_is_logged_chunk_by_chunk_and_its_rows_released(tiny_v4_checkpoint, tmp_path):
    """A session logs each prompt chunk as it is computed, so the V4 cache holds the window rows, not
    the whole prompt's; the turn's tokens are those of a run without the session."""
    from colibri_stream.checkpoint.fingerprint import model_fingerprint
    from colibri_stream.runtime.batching import ContinuousBatch, GenerationRequest
    from colibri_stream.runtime.generate import generate
    from colibri_stream.runtime.kv.front import prompt_chunk_hook
    from colibri_stream.runtime.loader import load_checkpoint

    loaded = load_checkpoint(tiny_v4_checkpoint)
    prompt = fixtures.make_prompt(loaded.args.vocab_size, 70, seed=11)
    session = Session(tmp_path, "long", model_fingerprint(tiny_v4_checkpoint), loaded.args)
    try:
        cache = session.start_turn(prompt, torch.float32).cache
        held: list[int] = []
        log_chunk = prompt_chunk_hook(None, session, cache, prompt)

        def on_chunk() -> None:
            log_chunk()
            held.append(max(layer.kv.length - layer.kv.base for layer in cache.layers))

        batch = ContinuousBatch(loaded.model, loaded.experts, prefill_chunk=16)
        request = GenerationRequest(prompt, 6, cache=cache, on_prompt_chunk=on_chunk)
        batch.add(request)
        finished: list = []
        while not finished:
            finished = batch.step()
        assert session.log.length == 64  # four chunks of 16 logged before the last one ran
    finally:
        session.close()
    assert held and max(held) == loaded.args.v4.sliding_window - 1
    assert finished[0].result.ids == generate(loaded.model, prompt, 6, loaded.experts).ids


def test_a_format_3_log_of_every_row_is_refused_in_one_line_saying_to_reset(v4, tmp_path):
    """Logs written before the lean format (format 3: every row per position) are not read: --reset."""
    with KVLog(tmp_path / "old.kvlog", "fp", kv_geometry(v4.args)) as old:
        old.append(np.zeros(1, np.uint32), np.zeros((1, old.geometry.payload_bytes), np.uint8))
    with pytest.raises(
        SessionError, match=r"session 'old' is a KV log of format 3, .* format 4\): use --reset"
    ) as error:
        Session(tmp_path, "old", "fp", v4.args)
    assert "\n" not in str(error.value)
    with Session(tmp_path, "old", "fp", v4.args, reset=True).log as log:  # --reset starts it over, lean
        assert log.length == 0


def test_kill_9_during_a_v4_append_resumes_from_the_last_whole_snapshot(v4, tiny_v4_checkpoint, tmp_path):
    """A turn killed while its positions are written: the next turn restores the last snapshot that was
    written whole (never a torn one) and gives a fresh run's tokens."""
    code = f"""
import os, signal, torch
from colibri_stream.runtime.loader import load_checkpoint
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.kv.sessions import Session
from storage.kv import lean_log as kvsnap
loaded = load_checkpoint({str(tiny_v4_checkpoint)!r})
prompt = {LONG_PROMPT!r}
session = Session({str(tmp_path)!r}, "chat", "fp", loaded.args)
start = session.start_turn(prompt, torch.float32)
ids = prompt + generate(loaded.model, prompt, 4, loaded.experts, cache=start.cache).ids
def kill(point):
    if point == "mid_record":
        os.kill(os.getpid(), signal.SIGKILL)
session.log.file._fault = kill
session.bookmark = None  # the frames: positions, the kept snapshot, positions, the end snapshot (torn)
session.end_turn(start.cache, ids)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    session = Session(tmp_path, "chat", "fp", v4.args)
    every = session.geometry.snapshot_every
    # The frames before the tear are whole (the kept snapshot at 32, maybe positions after it), the torn
    # end snapshot is not offered.
    assert every <= session.log.length <= len(LONG_PROMPT) + 3 and session.log.restore_point(10**6) == every
    prompt2 = LONG_PROMPT + ADDED
    turn = session.start_turn(prompt2, torch.float32)
    assert turn.reused_tokens == every
    answer = generate(v4.model, prompt2, NEW_TOKENS, v4.experts, cache=turn.cache).ids
    session.close()
    assert answer == generate(v4.model, prompt2, NEW_TOKENS, v4.experts).ids


def test_a_regenerated_or_edited_answer_restores_the_turns_prompt(v4, tiny_v4_checkpoint, tmp_path, capsys):
    """The log keeps the state at the turn's last prompt position (a bookmark): the same prompt again
    re-runs one position, and a next prompt that edits the answer re-prefills from the prompt's end."""
    turn1 = _turn(capsys, tiny_v4_checkpoint, PROMPT, tmp_path)
    again = _turn(capsys, tiny_v4_checkpoint, PROMPT, tmp_path)  # regenerate: the same prompt
    assert again["stats"]["reused_tokens"] == len(PROMPT) - 1 and again["ids"] == turn1["ids"]
    edited = PROMPT + turn1["ids"][:3] + [9, 9] + ADDED  # the answer cut and edited, then a new message
    turn2 = _turn(capsys, tiny_v4_checkpoint, edited, tmp_path)
    assert turn2["stats"]["reused_tokens"] == len(PROMPT) - 1
    assert turn2["ids"] == generate(v4.model, edited, NEW_TOKENS, v4.experts).ids
