"""Budget sizes and files, `plan`, and the streaming stats `run --json` reports."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from types import SimpleNamespace

import pytest

from colibri_stream import cli
from colibri_stream.cli import options
from colibri_stream.errors import BudgetError
from colibri_stream.planning import machine_memory
from colibri_stream.planning.activations import PREFILL_CHUNK_TOKENS
from colibri_stream.planning.budget import (
    BUDGET_KEYS,
    Budget,
    StoreOptions,
    load_budget_file,
    parse_size,
    worker_store_config,
)
from colibri_stream.planning.placement import RUNTIME_BASELINE_BYTES
from colibri_stream.planning.settings import SETTINGS
from storage.container.reader import Container
from storage.tiers.config import StoreConfig
from storage.tiers.tiered import slots_for

GIB = 2**30


@pytest.mark.parametrize(
    "text, expected",
    [("8GiB", 8 * GIB), ("512MB", 512 * 10**6), ("1.5g", 1_500_000_000), ("25%", 250), (4096, 4096), ("0", 0)],
)
def test_sizes(text, expected):
    assert parse_size(text, expert_bytes=1000) == expected


@pytest.mark.parametrize("text", ["eight", "8 parsecs", "%", True])
def test_bad_sizes_name_the_key(text):
    with pytest.raises(BudgetError, match="memory.ram"):
        parse_size(text, 1000, key="memory.ram")


def test_budget_file_reads_every_section(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text(
        '[memory]\nram = "25%"\nvram = "2GiB"\n[io]\ndirect = false\nthreads = 2\n'
        '[cache]\npolicy = "hybrid"\nprefetch = false\nprefetch_layers = 3\npreload = false\nhistory = "h.json"\n'
    )
    budget = load_budget_file(path)
    assert (budget["ram"], budget["vram"], budget["direct"], budget["threads"]) == ("25%", "2GiB", False, 2)
    assert (budget["policy"], budget["prefetch"], budget["prefetch_layers"], budget["history"]) == (
        "hybrid",
        False,
        3,
        "h.json",
    )
    assert budget["preload"] is False and budget.source == str(path)


@pytest.mark.parametrize(
    "content, culprit",
    [
        ("[cache]\npolcy = 'lru'\n", "unknown key cache.polcy (did you mean cache.policy?)"),
        ("[memory]\nrma = '8GiB'\n", "unknown key memory.rma (did you mean memory.ram?)"),
        ("[io]\npolicy = 'lru'\n", "unknown key io.policy (did you mean cache.policy?)"),  # the wrong table
        ("[memroy]\nram = '8GiB'\n", "unknown table [memroy] in memroy.ram (did you mean memory.ram?)"),
        ("ram = '8GiB'\n", "key ram is outside a table (did you mean memory.ram?)"),
        ("[memory]\nlimit = '8GiB'\n", "unknown key memory.limit (known: memory.ram, memory.vram)"),
        ("[kv]\ndir = '/tmp/kv'\n", "kv.dir is not a budget setting; use --kv-dir"),
        ("[kv]\ndtype = 'bfloat16'\n", "kv.dtype is not a budget setting; use --kv-dtype"),
        ("[memory]\nram = true\n", "memory.ram must be str or int"),
        ("[memory]\nram = 'lots'\n", "memory.ram: bad size 'lots'"),
        ("[memory]\nvram = 'auto'\n", "memory.vram: 'auto' is not available here"),
        ("[io]\nthreads = 0\n", "io.threads must be 1..256, got 0"),
        ("[cache]\nprefetch_layers = 0\n", "cache.prefetch_layers must be >= 1"),
        ("[cache]\nprefetch_layers = 'far'\n", "cache.prefetch_layers must be int"),
        ("[cache]\npolicy = 'mru'\n", "cache.policy must be one of"),
        (
            "[disk]\nx = 1\n",
            "unknown table [disk] in disk.x (a budget file has [cache], [io], [kv], [memory], [prefix], [serve])",
        ),
        ("[memory\nram = 1\n", "not valid TOML"),
    ],
)
def test_budget_file_errors_are_one_line_naming_the_file_and_the_key(tmp_path, content, culprit):
    """Nothing in a budget file is read by nothing: a misspelt key, one in the wrong table or a setting
    that lives elsewhere is refused, with the closest valid key where one is close."""
    path = tmp_path / "bad.toml"
    path.write_text(content)
    with pytest.raises(BudgetError) as error:
        load_budget_file(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and culprit in message and "\n" not in message


def test_every_budget_key_sets_a_setting_and_every_setting_of_a_budget_has_a_key():
    assert sorted(name for name, _ in BUDGET_KEYS.values()) == sorted(s.name for s in SETTINGS if s.key is not None)
    assert [s.key for s in SETTINGS if s.key is None] == [None]  # --vram-device only: this machine's device


def test_the_budget_takes_the_store_settings_defaults_from_store_config():
    """One home for a default: a Budget (no file) builds the StoreConfig that StoreConfig's own defaults
    are, whatever those are."""
    store = {f.name: f.default for f in fields(StoreConfig)}
    budget = Budget()
    same = {"vram": "vram_bytes", "direct": "direct", "threads": "threads", "policy": "policy"}
    same |= {"prefetch": "prefetch", "prefetch_layers": "prefetch_layers", "preload": "preload"}
    assert {mine: budget[mine] for mine in same} == {mine: store[theirs] for mine, theirs in same.items()}
    config = worker_store_config(StoreOptions(ram="1000"), expert_bytes=1000)
    assert config == StoreConfig(ram_bytes=1000)  # the VRAM device too: one default, cuda where available


def test_flags_win_over_the_budget_file_either_way(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text(
        "[io]\ndirect = false\nthreads = 3\n[cache]\nprefetch = false\npreload = false\nprefetch_layers = 4\n"
    )
    from_file = worker_store_config(StoreOptions(budget=path, ram="1000"), expert_bytes=1000)
    assert (from_file.direct, from_file.threads, from_file.prefetch, from_file.preload) == (False, 3, False, False)
    assert from_file.prefetch_layers == 4
    flags = StoreOptions(
        budget=path, ram="1000", direct=True, threads=1, prefetch=True, preload=True, prefetch_layers=1
    )
    config = worker_store_config(flags, expert_bytes=1000)
    assert (config.direct, config.threads, config.prefetch, config.preload, config.prefetch_layers) == (
        True,
        1,
        True,
        True,
        1,
    )


def _store_help(monkeypatch, defaults: Budget, **kwargs) -> str:
    monkeypatch.setattr(options, "DEFAULTS", defaults)
    parser = argparse.ArgumentParser(
        prog="x", formatter_class=lambda prog: argparse.HelpFormatter(prog, width=1000, max_help_position=200)
    )
    options.add_store_arguments(parser, **kwargs)
    return parser.format_help()


@pytest.mark.parametrize(
    "defaults",
    [
        Budget(),
        Budget(
            {"ram": "7%", "vram": "3GiB", "policy": "hybrid", "prefetch": False, "prefetch_layers": 5}
            | {"preload": False, "threads": 9}
        ),
    ],
)
def test_store_flag_help_shows_the_budget_defaults_not_literals(monkeypatch, defaults):
    text = _store_help(monkeypatch, defaults)
    on = {True: "on", False: "off"}
    for flag, shown in [
        ("--ram", defaults["ram"]),
        ("--vram", defaults["vram"]),
        ("--policy", defaults["policy"]),
        ("--prefetch", on[defaults["prefetch"]]),
        ("--prefetch-layers", defaults["prefetch_layers"]),
        ("--preload", on[defaults["preload"]]),
        ("--io-threads", defaults["threads"]),
    ]:
        line = next(line for line in text.splitlines() if line.split() and line.split()[0].rstrip(",") == flag)
        assert f"(default {shown}" in line, line
    assert "(default auto)" in _store_help(monkeypatch, defaults, ram_default="auto")


def test_direct_help_says_which_io_is_the_default(monkeypatch):
    lines = {
        line.split()[0]: line
        for line in _store_help(monkeypatch, Budget({"direct": False})).splitlines()
        if "--" in line
    }
    assert "(the default)" in lines["--buffered"] and "(the default)" not in lines["--direct"]


def test_plan_reports_the_placement_before_loading(stream_container, capsys):
    container = Container(stream_container)
    record = container.layout.record_bytes
    assert cli.main(["plan", str(stream_container), "--ram", str(40 * record), "--json"]) == 0
    placement = json.loads(capsys.readouterr().out)
    assert placement["ram_slots"] == 40 and placement["minimum_ram_slots"] == container.experts_per_token == 4
    assert placement["bytes_per_token_at_zero_hits"] == len(container.moe_layers) * 4 * record
    assert placement["expert_bytes"] == container.expert_bytes
    assert placement["kv_bytes_per_token"] > 0 and placement["dense_bytes"] > 0
    assert placement["activation_bytes"] > 0 and placement["prefill_chunk_tokens"] == PREFILL_CHUNK_TOKENS
    parts = ("dense_bytes", "kv_bytes_at_max_context", "activation_bytes")
    expected = RUNTIME_BASELINE_BYTES + 40 * record + sum(placement[key] for key in parts)
    assert placement["expected_peak_rss_bytes"] == expected


def test_plan_and_run_refuse_impossible_budgets_with_numbers(stream_container, capsys, monkeypatch):
    monkeypatch.setattr(machine_memory, "cgroup_cap", lambda: None)  # the machine's RAM, in any group
    record = Container(stream_container).layout.record_bytes
    assert cli.main(["plan", str(stream_container), "--ram", str(3 * record)]) == 1
    assert "holds 3 expert records; the minimum is 4 (one token's routed experts" in capsys.readouterr().err
    assert cli.main(["run", str(stream_container), "--ids", "5,6", "--ram", "100TiB"]) == 1
    assert "exceed this machine" in capsys.readouterr().err


def test_run_json_reports_measured_streaming_stats(stream_container, tmp_path, capsys):
    budget = tmp_path / "b.toml"
    budget.write_text('[memory]\nram = "30%"\n[cache]\npolicy = "hybrid"\n')
    trace = tmp_path / "trace.jsonl"
    argv = ["run", str(stream_container), "--ids", "5,9,17,33", "--max-new-tokens", "6", "--budget", str(budget)]
    assert cli.main([*argv, "--trace", str(trace), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    container = Container(stream_container)
    assert stats["ram_slots"] == slots_for(parse_size("30%", container.expert_bytes), container.layout.record_bytes)
    assert stats["hits"]["ram"] + stats["hits"]["vram"] + stats["misses"] == stats["expert_requests"]
    assert stats["expert_bytes_read"] == stats["reads"] * Container(stream_container).layout.record_bytes
    assert stats["io_service_s"] > 0 and stats["io_wait_s"] >= 0
    assert set(stats["prefetch"]) == {"issued", "useful", "wasted", "cancelled"}
    assert stats["peak_rss_bytes"] > 0 and stats["peak_uss_bytes"] > 0
    lines = trace.read_text().splitlines()
    assert sum(len(json.loads(line)["experts"]) for line in lines) == stats["expert_requests"]
    # The decode-phase counters start at the first token: the prompt is one acquire per MoE layer.
    moe_layers = len(Container(stream_container).moe_layers)
    assert len(lines) == moe_layers * (1 + stats["decode_tokens"])
    decode = stats["decode_phase"]
    assert decode["expert_requests"] == sum(len(json.loads(line)["experts"]) for line in lines[moe_layers:])
    assert decode["hits"]["ram"] + decode["misses"] == decode["expert_requests"]
    assert decode["misses"] <= stats["misses"] and decode["expert_bytes_read"] <= stats["expert_bytes_read"]
    assert decode["disk_read_bytes"] >= 0


def test_auto_ram_leaves_room_for_dense_kv_activations_and_a_margin(stream_container, capsys, monkeypatch):
    import psutil

    class Memory:
        available = 10 * GIB
        total = 16 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    monkeypatch.setattr(machine_memory, "cgroup_cap", lambda: None)  # whatever group the tests run in
    _process_at(monkeypatch, RUNTIME_BASELINE_BYTES)  # the runtime's memory all taken already
    assert cli.main(["plan", str(stream_container), "--ram", "auto", "--json"]) == 0
    placement = json.loads(capsys.readouterr().out)
    others = placement["dense_bytes"] + placement["kv_bytes_at_max_context"] + placement["activation_bytes"]
    expected = int((10 * GIB - others) * 0.9)
    assert placement["ram_budget_bytes"] == expected


def test_auto_ram_keeps_the_expected_peak_within_what_the_process_can_reach(stream_container, capsys, monkeypatch):
    """`plan` runs before torch has run anything: a process at 50 MiB will still take the rest of the runtime
    baseline. Before, auto left that to the 10% margin, and in a tight group the plan's own expected peak
    came out above the limit it had planned for (2.62 GiB in 2.57)."""
    import psutil

    class Memory:
        available = 1 * GIB
        total = 2 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    _process_at(monkeypatch, 50 * 2**20)
    monkeypatch.setattr(machine_memory, "cgroup_cap", lambda: None)
    assert cli.main(["plan", str(stream_container), "--ram", "auto", "--json"]) == 0
    placement = json.loads(capsys.readouterr().out)
    others = placement["dense_bytes"] + placement["kv_bytes_at_max_context"] + placement["activation_bytes"]
    to_come = RUNTIME_BASELINE_BYTES - 50 * 2**20
    assert placement["ram_budget_bytes"] == int((1 * GIB - others - to_come) * 0.9)
    assert placement["expected_peak_rss_bytes"] <= 50 * 2**20 + 1 * GIB


def _process_at(monkeypatch, rss: int) -> None:
    """psutil sees this process at ``rss`` bytes resident."""
    import psutil

    monkeypatch.setattr(psutil, "Process", lambda: SimpleNamespace(memory_info=lambda: SimpleNamespace(rss=rss)))


@pytest.mark.parametrize(
    "flags, budget_text, preloaded",
    [([], "", True), (["--no-preload"], "", False), ([], "[cache]\npreload = false\n", False)],
)
def test_run_reads_every_expert_at_load_when_they_all_fit_unless_told_not_to(
    stream_container, tmp_path, capsys, flags, budget_text, preloaded
):
    budget = tmp_path / "b.toml"
    budget.write_text('[memory]\nram = "100%"\n' + budget_text)
    argv = ["run", str(stream_container), "--ids", "5,9,17,33", "--max-new-tokens", "3", "--budget", str(budget)]
    assert cli.main([*argv, *flags, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    assert stats["expert_requests"] > 0
    assert (stats["misses"] == 0 and stats["reads"] == 0) is preloaded  # the turn's own reads
