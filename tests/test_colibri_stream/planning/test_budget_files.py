"""The example budget files load, validate, and hold together for the models their comments name."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from colibri_stream.planning.budget import BUDGET_KEYS, load_budget_file, parse_size

ROOT = Path(__file__).resolve().parents[3]
BUDGETS = ROOT / "budgets"
GIB = 2**30

# (machine RAM, VRAM, dense bf16, KV at full context, one layer's experts, all experts) in GiB, from the
# configs the files' comments name (computed with engine.ModelArgs on the meta device).
MACHINES = {
    "laptop-32g.toml": (32, 0, 2.9, 0.24, 0.27, 7.1),  # Moonlight-16B-A3B
    "workstation-128g-24gvram.toml": (128, 24, 31.9, 10.7, 5.6, 323.5),  # DeepSeek-V3
}


def test_every_budget_file_is_covered():
    assert sorted(p.name for p in BUDGETS.glob("*.toml")) == sorted(MACHINES)


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_budget_file_loads_and_fits_its_machine(name):
    budget = load_budget_file(BUDGETS / name)
    ram_total, vram_total, dense, kv, layer, experts = MACHINES[name]
    ram = parse_size(budget["ram"], int(experts * GIB), "ram") / GIB
    vram = parse_size(budget["vram"], int(experts * GIB), "vram") / GIB
    assert layer <= ram  # at least one layer's experts: the store's minimum
    assert ram + dense + kv <= 0.85 * ram_total  # room left for the OS and the runtime
    assert vram <= 0.9 * vram_total
    assert budget["policy"] in ("lru", "hybrid", "pinned") and budget["threads"] >= 1
    assert budget.source.endswith(name)
    text = (BUDGETS / name).read_text()
    assert "colibri-stream plan" in text and "#" in text  # commented, with the command to check it


def test_the_readme_example_is_a_valid_budget_showing_every_key(tmp_path):
    """The README's budget file is where users learn the keys: it loads, and it names each one."""
    readme = (ROOT / "README.md").read_text()
    example = readme.split("A TOML budget file sets the same things:", 1)[1].split("```toml\n", 1)[1].split("```")[0]
    path = tmp_path / "readme.toml"
    path.write_text(example)
    load_budget_file(path)
    shown = {f"{table}.{key}" for table, content in tomllib.loads(example).items() for key in content}
    assert shown == set(BUDGET_KEYS)
