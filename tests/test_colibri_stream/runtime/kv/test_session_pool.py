"""SessionPool: sessions kept open with their KV in memory between turns. What a turn continues from
memory is what it would read back from the log (bf16 records included), and a session evicted from the
pool is closed (its lock free again)."""

from __future__ import annotations

import pytest
import torch

from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.kv.pool import SessionPool
from colibri_stream.runtime.kv.sessions import Session
from colibri_stream.runtime.loader import load_checkpoint
from storage.errors import IncompatibleStateError

PROMPT = fixtures.make_prompt(512, 20)


@pytest.fixture(scope="module")
def dsa(tiny_checkpoints):
    return load_checkpoint(tiny_checkpoints["glm_moe_dsa"])


def open_session(dsa, kv_dir, name: str, record_dtype: str = "float32") -> Session:
    return Session(kv_dir, name, "fingerprint", dsa.args, record_dtype)


@pytest.mark.parametrize("record_dtype", ["float32", "bfloat16"])
def test_a_held_cache_is_what_the_log_gives_back(dsa, tmp_path, record_dtype):
    session = open_session(dsa, tmp_path, "held", record_dtype)
    start = session.start_turn(PROMPT, torch.float32)
    out = generate(dsa.model, PROMPT, 5, dsa.experts, cache=start.cache)
    ids = PROMPT + out.ids
    session.end_turn(start.cache, ids)
    pool = SessionPool(2)
    pool.put(session, start.cache, ids[: start.cache.length])
    held = pool.take("held")
    assert held is not None and pool.take("held") is None
    held.session.close()
    reread = open_session(dsa, tmp_path, "held", record_dtype)
    restored = reread.start_turn(ids + [3], torch.float32)  # the whole log is a prefix of this prompt
    reread.close()
    assert restored.reused_tokens == held.cache.length == len(held.ids)
    for memory, log in zip(held.cache.layers, restored.cache.layers, strict=True):
        for name in ("latent", "rope_key", "index_key"):
            a, b = getattr(memory, name), getattr(log, name)
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a[:, : memory.length], b[:, : log.length])


def test_continue_turn_keeps_the_common_prefix_and_cuts_the_log(dsa, tmp_path):
    session = open_session(dsa, tmp_path, "edit")
    start = session.start_turn(PROMPT, torch.float32)
    out = generate(dsa.model, PROMPT, 4, dsa.experts, cache=start.cache)
    ids = PROMPT + out.ids
    session.end_turn(start.cache, ids)
    held_ids = ids[: start.cache.length]
    edited = PROMPT[:12] + [7, 7, 7]
    turn = session.continue_turn(start.cache, held_ids, edited)
    assert turn.reused_tokens == 12 and turn.cache.length == 12 and held_ids == PROMPT[:12]
    assert session.log.length == 12
    session.close()


def test_the_least_recently_used_session_is_closed_past_capacity(dsa, tmp_path):
    pool = SessionPool(1)
    first, second = open_session(dsa, tmp_path, "a"), open_session(dsa, tmp_path, "b")
    with pytest.raises(IncompatibleStateError):  # held: a second open of "a" is refused
        open_session(dsa, tmp_path, "a")
    pool.put(first, dsa.model.new_cache(), [])
    pool.put(second, dsa.model.new_cache(), [])
    assert "a" not in pool and "b" in pool and len(pool) == 1
    open_session(dsa, tmp_path, "a").close()  # closed by the pool: its lock is free
    pool.close()
    open_session(dsa, tmp_path, "b").close()
