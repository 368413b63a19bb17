"""docs/architecture.md's layout describes the tree as it stands: every file it names exists, and every
package folder of the three packages is named there (so a moved or added folder fails here until the
page says where it went)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("colibri_stream", "engine", "storage")
FILE_NAME = re.compile(r"(?<![\w.])([A-Za-z_][\w/]*\.(?:py|c|h))\b")
FOLDER_NAME = re.compile(r"(?<![\w.])([A-Za-z_]\w*)/")


def _layout_block() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1]


def _package_folders() -> set[str]:
    folders = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            folders.update(part for part in path.relative_to(ROOT).parent.parts)
    return folders - {"__pycache__"}


def test_every_file_the_layout_names_exists():
    block = _layout_block()
    names = set(FILE_NAME.findall(block))
    assert len(names) > 50, "the layout block was not found or lists almost nothing"
    tree = {path.relative_to(ROOT).as_posix() for package in PACKAGES for path in (ROOT / package).rglob("*.*")}
    missing = sorted(name for name in names if not any(p == name or p.endswith("/" + name) for p in tree))
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_package_folder_is_named_in_the_layout():
    named = set(FOLDER_NAME.findall(_layout_block()))
    unnamed = sorted(_package_folders() - named)
    assert not unnamed, f"package folders missing from docs/architecture.md's layout: {unnamed}"


def test_every_library_module_is_named_in_the_layout():
    """The library's modules (not the applications', which the page describes per folder) each have a line."""
    block = _layout_block()
    library = [
        path
        for folder in ("checkpoint", "text", "planning", "experts", "runtime")
        for path in (ROOT / "colibri_stream" / folder).rglob("*.py")
        if path.name != "__init__.py"
    ]
    unnamed = sorted(path.name for path in library if not re.search(rf"(?<![\w.]){re.escape(path.name)}\b", block))
    assert not unnamed, f"library modules missing from docs/architecture.md's layout: {unnamed}"


def test_the_checks_would_catch_a_stale_page(tmp_path):
    stale = "```\ncolibri_stream/\n  gone_module.py   was moved\n```"
    assert FILE_NAME.findall(stale) == ["gone_module.py"] and "colibri_stream" in FOLDER_NAME.findall(stale)
