"""The shared prefix cache end to end: every family, stateless requests that resend the conversation,
restarts, budgets, other states never used, named sessions, KV packs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colibri_stream import cli
from colibri_stream.devtools import fixtures
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.kv.prefix_cache import BLOCK_TOKENS, PREFIX_DIR
from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, load_runtime, run_turn
from engine.kernels.q8 import tiles_fast
from storage.kv.prefix_store import PrefixConfig

# 203 positions: three whole blocks and an odd tail; past the DSA index_topk (8) and V4's windows
PROMPT = fixtures.make_prompt(512, 203, seed=3)
FOLLOW_UP = fixtures.make_prompt(512, 37, seed=4)
OFF = PrefixConfig(enabled=False)
ON = PrefixConfig()


def _runtime(path: Path, kv_dir: Path, prefix: PrefixConfig = ON, **options):
    return load_runtime(path, RuntimeOptions(kv_dir=kv_dir, text=False, prefix=prefix, **options))


def _turn(runtime, ids, max_new_tokens=6, **options):
    return run_turn(runtime, ids, TurnOptions(max_new_tokens=max_new_tokens, **options))


@pytest.mark.parametrize("family", fixtures.FAMILIES)
def test_stateless_requests_resending_the_conversation_compute_only_what_is_new(tiny_checkpoints, family, tmp_path):
    checkpoint = tiny_checkpoints[family]
    plain = _runtime(checkpoint, tmp_path / "off", OFF)
    cached = _runtime(checkpoint, tmp_path / "kv")
    first, reference1 = _turn(cached, PROMPT), _turn(plain, PROMPT)
    assert first.ids == reference1.ids
    assert first.stats["prompt_sources"] == {"session": 0, "prefix_ram": 0, "prefix_disk": 0, "computed": 203}

    again = _turn(cached, PROMPT)  # the same request: all its whole blocks from RAM
    assert again.ids == reference1.ids
    assert again.stats["prompt_sources"]["prefix_ram"] == 192 and again.stats["prefill_tokens"] == 11

    # the agent's next request: the whole conversation again, with the answer and a new message
    prompt2 = PROMPT + first.ids + FOLLOW_UP
    second, reference2 = _turn(cached, prompt2), _turn(plain, prompt2)
    assert second.ids == reference2.ids
    computed = second.stats["prefill_tokens"]
    assert computed <= len(FOLLOW_UP) + 1 + BLOCK_TOKENS  # the new tokens (+ the unfed last answer token)
    assert second.stats["reused_tokens"] == len(prompt2) - computed == 192
    cached.close()

    restarted = _runtime(checkpoint, tmp_path / "kv")  # a new runtime: only the directory carries over
    third = _turn(restarted, prompt2)
    assert third.ids == reference2.ids
    assert third.stats["prompt_sources"]["prefix_disk"] == third.stats["reused_tokens"] >= 192
    restarted.close()
    plain.close()


def test_a_tight_expert_budget_and_int4_experts_give_the_same_tokens(make_container, tmp_path):
    container = make_container("deepseek_v3", "int4", "f32")
    tight = StoreOptions(ram="30%", preload=False)
    reference = _turn(_runtime(container, tmp_path / "off", OFF, store=tight), PROMPT + FOLLOW_UP).ids
    cached = _runtime(container, tmp_path / "kv", store=tight)
    _turn(cached, PROMPT)
    warm = _turn(cached, PROMPT + FOLLOW_UP)
    assert warm.stats["reused_tokens"] == 192 and warm.ids == reference


def test_blocks_of_another_dtype_or_activation_path_are_never_used(make_container, tmp_path):
    container = make_container("deepseek_v32", "int4", "int8")
    kv = tmp_path / "kv"
    _turn(_runtime(container, kv), PROMPT)
    for options in ({"dtype": "bfloat16"}, {"activations": "int8"}, {"kv_dtype": "bfloat16"}):
        other = _turn(_runtime(container, kv, **options), PROMPT)
        assert other.stats["reused_tokens"] == 0, options
    # and the first state's blocks are still there for it
    assert _turn(_runtime(container, kv), PROMPT).stats["reused_tokens"] == 192


def test_a_planted_or_damaged_block_is_a_miss_and_recomputed(tiny_checkpoints, tmp_path):
    checkpoint = tiny_checkpoints["glm_moe_dsa"]
    reference = _turn(_runtime(checkpoint, tmp_path / "off", OFF), PROMPT).ids
    kv = tmp_path / "kv"
    _turn(_runtime(checkpoint, kv), PROMPT)
    blocks = sorted((kv / PREFIX_DIR).glob("*.kvblock"), key=lambda p: p.stat().st_mtime_ns)
    assert len(blocks) == 3
    data = bytearray(blocks[1].read_bytes())
    data[-10] ^= 0x40  # one bit of the last record's payload
    blocks[1].write_bytes(bytes(data))
    blocks[2].write_bytes(blocks[0].read_bytes())  # a whole valid block of another position and key
    fresh = _runtime(checkpoint, kv)
    turn = _turn(fresh, PROMPT)
    assert turn.ids == reference
    # only the first block is whole and its own; the damaged one is removed, recomputed and written again
    assert turn.stats["reused_tokens"] == BLOCK_TOKENS
    assert _turn(fresh, PROMPT).stats["reused_tokens"] == 192


def test_budgets_hold_and_the_least_recently_used_blocks_go_first(tiny_checkpoints, tmp_path):
    checkpoint = tiny_checkpoints["deepseek_v3"]
    probe = _runtime(checkpoint, tmp_path / "probe")
    _turn(probe, PROMPT[: BLOCK_TOKENS + 1])
    block_file = next((tmp_path / "probe" / PREFIX_DIR).glob("*.kvblock")).stat().st_size
    block_ram = probe.prefix.usage().ram_bytes
    small = PrefixConfig(ram_bytes=2 * block_ram, disk_bytes=3 * block_file)
    runtime = _runtime(checkpoint, tmp_path / "kv", small)
    other = fixtures.make_prompt(512, 203, seed=9)
    _turn(runtime, PROMPT)  # 3 blocks
    _turn(runtime, other)  # 3 more: the disk keeps the newest 3, RAM the newest 2
    usage = runtime.prefix.usage()
    assert (usage.ram_blocks, usage.disk_blocks) == (2, 3)
    assert usage.ram_bytes <= small.ram_bytes and usage.disk_bytes <= small.disk_bytes
    assert len(list((tmp_path / "kv" / PREFIX_DIR).glob("*.kvblock"))) == 3
    assert _turn(runtime, other).stats["reused_tokens"] == 192  # the newest
    assert _turn(runtime, PROMPT).stats["reused_tokens"] == 0  # evicted


def test_a_new_named_session_starts_from_the_shared_preamble_and_logs_it(tiny_checkpoints, tmp_path):
    checkpoint = tiny_checkpoints["deepseek_v3"]
    reference = _turn(_runtime(checkpoint, tmp_path / "off", OFF), PROMPT + FOLLOW_UP, session="x").ids
    runtime = _runtime(checkpoint, tmp_path / "kv")
    _turn(runtime, PROMPT, session="alice")
    bob = _turn(runtime, PROMPT + FOLLOW_UP, session="bob")  # another conversation, the same preamble
    assert bob.ids == reference
    assert bob.stats["prompt_sources"]["prefix_ram"] == 192
    runtime.close()
    restarted = _runtime(checkpoint, tmp_path / "kv", OFF)  # bob's own log now holds what it restored
    resumed = _turn(restarted, PROMPT + FOLLOW_UP + bob.ids, session="bob")
    assert resumed.stats["prompt_sources"]["session"] == len(PROMPT + FOLLOW_UP + bob.ids) - 1


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """The CLI in this process (what is tested is the command, not the process boundary)."""
    capsys.readouterr()
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_kv_packs_ship_a_preamble_to_another_directory_and_refuse_what_is_not_this_models(
    make_container, tiny_checkpoints, tmp_path, capsys
):
    container = make_container("deepseek_v3", "int4", "f32")
    ids = ",".join(map(str, PROMPT))
    _turn(_runtime(container, tmp_path / "a"), PROMPT)
    pack = tmp_path / "preamble.kvpack"
    status, out, err = _cli(
        capsys, "kv", "export", str(container), str(pack), "--ids", ids, "--kv-dir", str(tmp_path / "a"), "--json"
    )
    assert status == 0, err
    assert json.loads(out) == {"pack": "preamble", "positions": 192}

    _, out, _ = _cli(capsys, "kv", "import", str(container), str(pack), "--kv-dir", str(tmp_path / "b"), "--json")
    assert json.loads(out) == {"pack": "preamble", "positions": 192, "blocks_added": 3}
    _, out, _ = _cli(capsys, "kv", "prefix", str(container), "--kv-dir", str(tmp_path / "b"), "--json")
    assert [(g["blocks"], g["tokens"]) for g in json.loads(out)] == [(3, 192)]
    warm = _turn(_runtime(container, tmp_path / "b"), PROMPT + FOLLOW_UP)
    assert warm.stats["prompt_sources"]["prefix_disk"] == 192

    # the same geometry, another model (the checkpoint the container was converted from, float experts)
    other_model = tiny_checkpoints["deepseek_v3"]
    status, _, err = _cli(capsys, "kv", "import", str(other_model), str(pack), "--kv-dir", str(tmp_path / "c"))
    assert status == 1 and "another model" in err
    damaged = tmp_path / "damaged.kvpack"
    data = bytearray(pack.read_bytes())
    data[-100] ^= 1  # the last block's last record
    damaged.write_bytes(bytes(data))
    status, _, err = _cli(capsys, "kv", "import", str(container), str(damaged), "--kv-dir", str(tmp_path / "d"))
    assert status != 0 and "checksum" in err
    assert not list((tmp_path / "d").rglob("*.kvblock"))  # refused whole: nothing half-imported

    _, out, _ = _cli(capsys, "kv", "prefix-clear", str(container), "--kv-dir", str(tmp_path / "b"), "--json")
    assert json.loads(out) == {"removed_blocks": 3}


def test_budget_files_and_flags_size_the_prefix_cache_and_bad_values_name_the_key(tmp_path, capsys):
    from colibri_stream.errors import BudgetError
    from colibri_stream.planning.budget import StoreOptions, prefix_config

    budget = tmp_path / "budget.toml"
    budget.write_text('[prefix]\nram = "64MiB"\ndisk = 0\n')
    assert prefix_config(StoreOptions(budget)) == PrefixConfig(ram_bytes=64 << 20, disk_bytes=0, enabled=True)
    flags = StoreOptions(budget, prefix_ram="1GiB", prefix_enabled=False)
    assert prefix_config(flags) == PrefixConfig(1 << 30, 0, False)  # flags win
    assert prefix_config(StoreOptions()) == PrefixConfig()
    for text, named in (('[prefix]\nram = "25%"\n', "prefix.ram"), ("[prefix]\ndisk = true\n", "prefix.disk")):
        budget.write_text(text)
        with pytest.raises(BudgetError, match=named):
            prefix_config(StoreOptions(budget))
    with pytest.raises(SystemExit):
        cli.main(["run", "model", "--ids", "1", "--prefix-disk", "auto"])
    assert "--prefix-disk" in capsys.readouterr().err


def test_a_runtime_without_disk_tier_writes_no_block_files(tiny_checkpoints, tmp_path):
    runtime = _runtime(tiny_checkpoints["deepseek_v3"], tmp_path / "kv", PrefixConfig(disk_bytes=0))
    _turn(runtime, PROMPT)
    assert _turn(runtime, PROMPT).stats["prompt_sources"]["prefix_ram"] == 192
    assert not list((tmp_path / "kv").rglob("*.kvblock"))


def test_auto_ram_leaves_the_prefix_caches_ram_tier_room(make_container, monkeypatch):
    import psutil

    from colibri_stream.planning.budget import store_config
    from colibri_stream.planning.geometry import geometry_from_container
    from storage.container.reader import Container

    class Memory:
        available = 4 << 30
        total = 8 << 30

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    geometry = geometry_from_container(Container(make_container("deepseek_v3", "int4", "f32")))
    alone = store_config(StoreOptions(ram="auto"), geometry).ram_bytes
    beside = store_config(StoreOptions(ram="auto", beside_store_bytes=512 << 20), geometry).ram_bytes
    assert alone - beside == pytest.approx(0.9 * (512 << 20), abs=1)  # the margin applies to what is left


@pytest.mark.skipif(not tiles_fast(), reason="--activations int8-tiles needs AVX-512 VNNI")
def test_int8_tiles_keeps_prompt_blocks_only_so_a_hit_is_what_recomputing_gives(make_container, tmp_path):
    """A prompt's rows as tile GEMMs compute a position otherwise than decoding it: the answer's positions are
    not kept, so the next request reads them as prompt whether the cache has the rest or not. Plain int8 keeps
    the block the answer completes (250 + 11 positions: block 3 whole)."""
    container = make_container("deepseek_v3", "int4", "int8")
    prompt = fixtures.make_prompt(512, 250, seed=5)
    reused = {}
    for activations in ("int8", "int8-tiles"):
        cached = _runtime(container, tmp_path / activations, activations=activations)
        first = _turn(cached, prompt, max_new_tokens=12)
        follow = prompt + first.ids + FOLLOW_UP
        again = _turn(cached, follow, max_new_tokens=6)
        reused[activations] = again.stats["reused_tokens"]
        if activations == "int8-tiles":  # the hit gives the tokens a cold runtime computes
            assert again.ids == _turn(_runtime(container, tmp_path / "off", OFF, activations=activations), follow).ids
        cached.close()
    assert reused == {"int8": 256, "int8-tiles": 192}
