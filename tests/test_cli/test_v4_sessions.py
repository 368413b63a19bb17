"""DeepSeek-V4 sessions: its KV log holds every layer's rows per position, so a warm restart in a new
process, a damaged log's valid prefix, an edited conversation and a bf16 log held in memory all
continue exactly as a fresh run would, re-prefilling only what is new."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from colibri_stream import cli
from colibri_stream.devtools import fixtures
from colibri_stream.planning.kv_bytes import (
    cache_bytes_per_token,
    compressed_kv_bytes_per_token,
    kv_geometry,
    naive_kv_bytes_per_token,
)
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint
from colibri_stream.runtime.session_pool import SessionPool
from colibri_stream.runtime.sessions import Session, session_info
from engine.args import ModelArgs
from storage.kvlog import HEADER_BYTES

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


def _damage(path, how: str, record_bytes: int) -> int:
    """Damage the log; return the count of records still valid."""
    data = bytearray(path.read_bytes())
    if how == "torn-tail":
        path.write_bytes(bytes(data[: len(data) - record_bytes // 2]))  # the last record half written
        return (len(data) - HEADER_BYTES) // record_bytes - 1
    data[HEADER_BYTES + 15 * record_bytes + record_bytes // 3] ^= 0x20  # one bit inside record 15's rows
    path.write_bytes(bytes(data))
    return 15


@pytest.mark.parametrize("how", ["torn-tail", "bit-flip"])
def test_a_damaged_log_resumes_from_its_valid_prefix_and_matches_a_fresh_run(
    v4, tiny_v4_checkpoint, tmp_path, capsys, how
):
    turn1 = _turn(capsys, tiny_v4_checkpoint, PROMPT, tmp_path)
    valid = _damage(tmp_path / "chat.kvlog", how, kv_geometry(v4.args).record_bytes)
    prompt2 = PROMPT + turn1["ids"] + ADDED
    turn2 = _turn(capsys, tiny_v4_checkpoint, prompt2, tmp_path)
    assert turn2["stats"]["reused_tokens"] == valid
    assert turn2["ids"] == generate(v4.model, prompt2, NEW_TOKENS, v4.experts).ids
    assert cli.main(["kv", "info", str(tiny_v4_checkpoint), "chat", "--kv-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == len(prompt2) + NEW_TOKENS - 1  # recut, refilled


def test_an_edited_conversation_cuts_the_log_and_continues_exactly(v4, tiny_v4_checkpoint, tmp_path, capsys):
    """The edit lands inside an open HCA window (positions 8..15) and CSA window (12..13)."""
    _turn(capsys, tiny_v4_checkpoint, PROMPT, tmp_path)
    edited = PROMPT[:13] + [5, 6, 7] + PROMPT[16:]
    result = _turn(capsys, tiny_v4_checkpoint, edited, tmp_path)
    assert result["stats"]["reused_tokens"] == 13
    assert result["ids"] == generate(v4.model, edited, NEW_TOKENS, v4.experts).ids
    again = _turn(capsys, tiny_v4_checkpoint, edited + result["ids"] + ADDED, tmp_path)  # the cut log continues
    assert again["stats"]["reused_tokens"] == len(edited) + NEW_TOKENS - 1
    assert again["ids"] == generate(v4.model, edited + result["ids"] + ADDED, NEW_TOKENS, v4.experts).ids


def test_an_edit_continued_from_memory_trims_the_cache_and_the_log(v4, tmp_path):
    """The server's path: the cache held in memory is cut back (V4Cache.trim), not reread."""
    session = Session(tmp_path, "edit", "fp", v4.args)
    start = session.start_turn(PROMPT, torch.float32)
    ids = PROMPT + generate(v4.model, PROMPT, NEW_TOKENS, v4.experts, cache=start.cache).ids
    session.end_turn(start.cache, ids)
    held_ids = ids[: start.cache.length]
    edited = PROMPT[:13] + [5, 6, 7] + PROMPT[16:]
    turn = session.continue_turn(start.cache, held_ids, edited)
    assert turn.reused_tokens == turn.cache.length == session.log.length == 13
    answer = generate(v4.model, edited, NEW_TOKENS, v4.experts, cache=turn.cache).ids
    session.close()
    assert answer == generate(v4.model, edited, NEW_TOKENS, v4.experts).ids


def _next_turn_logits(v4, cache, prompt, reused: int) -> torch.Tensor:
    return v4.model(torch.tensor([prompt[reused:]]), reused, cache, v4.experts)[0]


def test_bf16_records_a_turn_continued_from_memory_equals_one_restored_from_the_log(v4, tmp_path):
    session = Session(tmp_path, "held", "fp", v4.args, "bfloat16")
    start = session.start_turn(PROMPT, torch.float32)
    ids = PROMPT + generate(v4.model, PROMPT, NEW_TOKENS, v4.experts, cache=start.cache).ids
    session.end_turn(start.cache, ids)
    pool = SessionPool(1)
    pool.put(session, start.cache, ids[: start.cache.length])  # as_logged: rows rounded, entries dropped
    held = pool.take("held")
    prompt2 = ids + ADDED
    memory = held.session.continue_turn(held.cache, held.ids, prompt2)
    held.session.close()
    reread = Session(tmp_path, "held", "fp", v4.args, "bfloat16")
    restored = reread.start_turn(prompt2, torch.float32)
    reread.close()
    assert memory.reused_tokens == restored.reused_tokens == len(ids) - 1
    from_memory = _next_turn_logits(v4, memory.cache, prompt2, memory.reused_tokens)
    from_log = _next_turn_logits(v4, restored.cache, prompt2, restored.reused_tokens)
    assert torch.equal(from_memory, from_log)
    unrounded = v4.model.new_cache()  # the same positions as computed, not as logged: the rounding shows
    v4.model(torch.tensor([ids[:-1]]), 0, unrounded, v4.experts)
    assert not torch.equal(_next_turn_logits(v4, unrounded, prompt2, len(ids) - 1), from_log)


def test_kv_info_reports_v4_bytes_per_token(tiny_v4_checkpoint, tmp_path, capsys):
    """Sizes recomputed from config.json by hand: per layer the rows, entries one per m positions."""
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
    assert info["bytes_per_token"] == 4 + 4 * sum(rows[t] for t in types) + 4  # token id, rows, crc32c
    assert info["tokens"] == len(PROMPT) + NEW_TOKENS - 1
    assert info["file_bytes"] == HEADER_BYTES + info["tokens"] * info["bytes_per_token"]
    assert info["in_memory_bytes_per_token"] == 4 * sum(entries[t] for t in types)  # rows released once logged
    assert info["compressed_kv_bytes_per_token"] == 4 * sum(entries[t] for t in types)
    assert info["naive_kv_bytes_per_token"] == 4 * d * len(types)  # one K=V head per layer
    assert info["naive_kv"] == "one uncompressed K=V head per layer (MQA)"
    assert info["compression_vs_naive"] == round(info["naive_kv_bytes_per_token"] / info["bytes_per_token"], 2)


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


def test_kv_info_of_a_model_with_sliding_layers_only(tmp_path):
    """No compressed layer: nothing per token beyond the window, and no ratio to divide by zero."""
    args = ModelArgs.from_hf_config({**FLASH, "compress_ratios": [0] * 44})
    Session(tmp_path, "s", "fp", args, "bfloat16").close()
    info = session_info(tmp_path / "s.kvlog", args)
    assert info["bytes_per_token"] == 4 + 43 * 512 * 2 + 4  # the K=V rows: the naive cache itself
    assert (info["compressed_kv_bytes_per_token"], info["compressed_vs_naive"]) == (0.0, None)


def test_a_long_prompt_in_a_session_is_logged_chunk_by_chunk_and_its_rows_released(tiny_v4_checkpoint, tmp_path):
    """A session logs each prompt chunk as it is computed, so the V4 cache holds the window rows, not
    the whole prompt's; the turn's tokens are those of a run without the session."""
    from colibri_stream.checkpoint.fingerprint import model_fingerprint
    from colibri_stream.runtime.batching import ContinuousBatch, GenerationRequest
    from colibri_stream.runtime.generate import generate
    from colibri_stream.runtime.loader import load_checkpoint
    from colibri_stream.runtime.turn import log_prompt_chunks

    loaded = load_checkpoint(tiny_v4_checkpoint)
    prompt = fixtures.make_prompt(loaded.args.vocab_size, 70, seed=11)
    session = Session(tmp_path, "long", model_fingerprint(tiny_v4_checkpoint), loaded.args)
    try:
        cache = session.start_turn(prompt, torch.float32).cache
        held: list[int] = []
        log_chunk = log_prompt_chunks(session, cache, prompt)

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
