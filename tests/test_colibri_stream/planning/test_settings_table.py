"""One table declares every setting (colibri_stream/planning/settings.py): the flags, the budget-file keys,
the docs' table and the workers' flags all come from it, and a command reads its budget file once and
plans once."""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from colibri_stream import cli
from colibri_stream.errors import BudgetError
from colibri_stream.experts.cluster.group import local_worker_flags
from colibri_stream.planning import placement, settings
from colibri_stream.planning.budget import StoreOptions, load_budget_file, prefix_config, worker_store_config
from colibri_stream.planning.settings import BUDGET_KEYS, SETTINGS, Kind, Setting, markdown_table
from storage.kv.prefix_store import PrefixConfig
from storage.tiers.config import StoreConfig

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = {Kind.SIZE: "3GiB", Kind.BLOCKS: "64MiB", Kind.PATH: "h.json", Kind.TEXT: "cpu"}


def _sample(setting: Setting) -> object:
    """A value of the setting other than its default."""
    if setting.kind is Kind.COUNT:
        return (setting.low or 0) + 2
    if setting.kind is Kind.CHOICE:
        return next(c for c in setting.choices if c != setting.default)
    if setting.kind is Kind.SWITCH:
        return not setting.default
    return SAMPLES[setting.kind]


def test_the_docs_settings_table_is_the_generated_one():
    text = (ROOT / "docs" / "planning.md").read_text()
    shown = text.split("<!-- settings table: generated, do not edit by hand -->\n", 1)[1]
    generated = markdown_table()
    assert shown.split("\n<!-- end of settings table -->", 1)[0] == generated, (
        "docs/planning.md's settings table is not the table's: paste in the output of\n"
        "python -c 'from colibri_stream.planning.settings import markdown_table; print(markdown_table())'"
    )


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_every_row_has_a_flag_the_commands_read(setting):
    """Each row's flag reaches the StoreOptions a command builds (run holds the store, prefix and context
    groups; serve its own too), with the value given."""
    value = _sample(setting)
    if setting.kind is Kind.SWITCH:
        flag = [setting.flag if value else setting.off_flag or f"--no-{setting.flag[2:]}"]
    else:
        flag = [setting.flag, str(value)]
    command = ["serve", "MODEL"] if setting.group == "serve" else ["run", "MODEL", "--ids", "1"]
    args = cli.build_parser().parse_args([*command, *flag])
    given = cli.options.store_options(args).given
    assert given == {setting.name: value}


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.key is not None], ids=lambda s: s.name)
def test_every_row_with_a_key_is_read_from_a_budget_file_and_checked(setting, tmp_path):
    table, key = setting.key.split(".")
    value = _sample(setting)
    path = tmp_path / "b.toml"
    path.write_text(f"[{table}]\n{key} = {value!r}\n".replace("False", "false").replace("True", "true"))
    assert load_budget_file(path)[setting.name] == value
    assert BUDGET_KEYS[setting.key] == (setting.name, setting.kind.types)
    wrong = 1.5  # a TOML float is no setting's type
    path.write_text(f"[{table}]\n{key} = {wrong}\n")
    with pytest.raises(BudgetError, match=f"{path}: {setting.key} must be"):
        load_budget_file(path)


def test_the_only_row_without_a_budget_key_is_the_vram_device():
    assert [s.name for s in SETTINGS if s.key is None] == ["vram_device"]


@pytest.mark.parametrize("owner", [StoreConfig, PrefixConfig])
def test_every_config_field_is_a_row_and_its_default_and_range_are_read_not_restated(owner):
    """A new StoreConfig (or PrefixConfig) field without its row fails here; a row states no default or
    range of a field it sets: it reads them."""
    rows = {s.target: s for s in SETTINGS if s.owner is owner}
    planned_elsewhere = {"ram_bytes"} if owner is StoreConfig else set()  # `auto` and % need the model
    assert set(rows) == {f.name for f in fields(owner)} - planned_elsewhere
    for spec in fields(owner):
        if spec.name in rows:
            row = rows[spec.name]
            assert row.default == (None if spec.default is MISSING else spec.default)
            assert (row.low, row.high) == spec.metadata.get("range", (None, None))
            assert row.choices == tuple(spec.metadata.get("choices", ()))


def test_defaults_build_the_configs_own_defaults():
    assert worker_store_config(StoreOptions(ram="1000"), expert_bytes=1000) == StoreConfig(ram_bytes=1000)
    assert prefix_config(StoreOptions()) == PrefixConfig()


def test_a_local_workers_flags_give_it_the_coordinators_store(tmp_path):
    """Every store setting reaches a local worker (the flags are generated from the rows): the worker's
    StoreConfig is the coordinator's, with its share of RAM and VRAM and its own history file."""
    values = {s.target: _sample(s) for s in SETTINGS if s.owner is StoreConfig}
    values |= {"vram_bytes": 3000, "history_path": tmp_path / "h.json"}  # bytes and a Path, as the store holds them
    store = StoreConfig(ram_bytes=9000, **values)
    assert all(getattr(store, f.name) != f.default for f in fields(StoreConfig) if f.default is not MISSING)
    flags = local_worker_flags(store, 3, 1)
    coordinator = ["--rank", "1", "--world-size", "4", "--master-addr", "127.0.0.1", "--master-port", "1"]
    args = cli.build_parser().parse_args(["worker", "MODEL", *coordinator, *flags])
    worker = worker_store_config(cli.options.store_options(args), expert_bytes=9000)
    shares = {"ram_bytes": 3000, "vram_bytes": 1000, "history_path": Path(f"{tmp_path / 'h.json'}.worker1")}
    assert worker == StoreConfig(**values | shares)


def test_serve_with_a_budget_file_reads_it_once_and_plans_once(make_container, tmp_path, monkeypatch, capsys):
    """`serve --budget B.toml` resolves its settings where it starts: B.toml read and checked once, and
    the placement planned once (auto RAM sized from it, the same plan checked), however many parts of
    the load ask for a setting."""
    from colibri_stream.serve import http

    reads: list[Path] = []
    read = settings.read_budget_toml
    monkeypatch.setattr(settings, "read_budget_toml", lambda path: reads.append(path) or read(path))
    plans: list[object] = []
    real_plan = placement.plan

    def counted_plan(*args: object, **kwargs: object) -> placement.Placement:
        plans.append(args)
        return real_plan(*args, **kwargs)

    for module in [m for name, m in sys.modules.items() if name.startswith("colibri_stream")]:
        if getattr(module, "plan", None) is real_plan:  # every name bound to it, and lazy imports
            monkeypatch.setattr(module, "plan", counted_plan)
    monkeypatch.setattr(http, "run_server", lambda config: True)
    budget = tmp_path / "b.toml"
    budget.write_text('[memory]\nram = "auto"\n[kv]\ncontext = 64\n[prefix]\nram = "1MiB"\n')
    container = make_container("deepseek_v3")
    argv = ["serve", str(container), "--budget", str(budget), "--kv-dir", str(tmp_path / "kv"), "--port", "1"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert reads == [budget] and len(plans) == 1


def test_a_budget_files_half_life_reaches_the_ram_policy(make_container, tmp_path):
    """cache.half_life (one row and its StoreConfig field): the file's value is the frequent policy's, per
    routed use, and the flag wins over the file."""
    from colibri_stream.planning.budget import store_config
    from colibri_stream.planning.geometry import geometry_from_container
    from storage.container.reader import Container
    from storage.tiers.policy import FrequentPolicy
    from storage.tiers.tiered import TieredExpertStore

    container = Container(make_container("deepseek_v3"))
    budget = tmp_path / "b.toml"
    budget.write_text('[cache]\npolicy = "frequent"\nhalf_life = 5\n')
    geometry = geometry_from_container(container)
    assert store_config(StoreOptions(budget), geometry).half_life == 5
    assert store_config(StoreOptions(budget, half_life=7), geometry).half_life == 7
    store = TieredExpertStore(container, store_config(StoreOptions(budget), geometry), lambda record: record)
    try:
        policy = store.ram.policy
        uses_per_token = len(container.moe_layers) * container.experts_per_token
        assert isinstance(policy, FrequentPolicy) and policy.half_life == 5 * uses_per_token
    finally:
        store.close()
