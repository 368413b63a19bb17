"""docs/architecture.md's layout describes the tree as it stands, by whole paths: every file it names
exists where the page puts it, and every package folder and every module has its line (a moved, added or
renamed module fails here until the page says where it went)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("colibri_stream", "engine", "storage")
DESCRIBED_WHOLE = (
    "engine",
    "storage",
    *(f"colibri_stream/{f}" for f in ("checkpoint", "text", "planning", "experts", "runtime")),
)
NAME_COLUMN = 26  # an entry's names start before this column; its description (and continuation lines) at it
ENTRY = re.compile(r"[A-Za-z_][\w./]*")


def _layout_block() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1]


def _expand(name: str) -> list[str]:
    """``csrc/nibble.c/.h`` names two files; anything else one path (a folder ends in /)."""
    if name.endswith("/.h"):
        stem = name[: -len("/.h")]
        return [stem, stem.rsplit(".", 1)[0] + ".h"]
    return [name]


def layout_paths(block: str) -> tuple[set[str], set[str]]:
    """(files, folders) the block names, as whole paths from the repository root: an entry line starts
    (before the description column) with one or more names, and sits in the folder of the nearest line
    above it with less indentation that names a folder."""
    files: set[str] = set()
    folders: set[str] = set()
    parents: list[tuple[int, str]] = []  # (indent, folder path)
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= NAME_COLUMN:
            continue
        names = []
        for token in line.split():
            if not (ENTRY.fullmatch(token) and (token.endswith((".py", ".c", ".h", ".pyi", "/")))):
                break
            names.append(token)
        while parents and parents[-1][0] >= indent:
            parents.pop()
        base = parents[-1][1] if parents else ""
        for name in names:
            if name.endswith("/"):
                folders.add(base + name.rstrip("/"))
            else:
                files.update(base + path for path in _expand(name))
        if len(names) == 1 and names[0].endswith("/"):
            parents.append((indent, base + names[0]))
    return files, folders


def _package_folders() -> set[str]:
    return {
        path.parent.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def test_every_file_the_layout_names_exists_at_that_path():
    files, _ = layout_paths(_layout_block())
    assert len(files) > 150, "the layout block was not found or lists almost nothing"
    missing = sorted(path for path in files if not (ROOT / path).is_file())
    assert not missing, f"docs/architecture.md names files that do not exist there: {missing}"


def test_every_package_folder_is_named_in_the_layout():
    _, folders = layout_paths(_layout_block())
    unnamed = sorted(_package_folders() - folders)
    assert not unnamed, f"package folders missing from docs/architecture.md's layout: {unnamed}"


def test_every_module_is_named_at_its_path():
    files, _ = layout_paths(_layout_block())
    modules = {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    }
    unnamed = sorted(modules - files)
    assert not unnamed, f"modules missing from docs/architecture.md's layout: {unnamed}"


def test_the_checks_would_catch_a_stale_or_misplaced_page():
    block = "\n".join(
        [
            "engine/                   x",
            "  kernels/                y",
            "    q8.py                 z",
            "  gone.py                 w",
        ]
    )
    files, folders = layout_paths(block)
    assert files == {"engine/kernels/q8.py", "engine/gone.py"} and folders == {"engine", "engine/kernels"}
    assert layout_paths("storage/\n  csrc/a.c/.h            x\n")[0] == {"storage/csrc/a.c", "storage/csrc/a.h"}
