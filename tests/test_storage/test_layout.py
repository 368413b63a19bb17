"""The package boundaries the architecture fixes: engine and storage never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_top_levels(package: str) -> set[str]:
    names: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_engine_imports_neither_storage_nor_the_app():
    assert not _imported_top_levels("engine") & {"storage", "colibri_stream"}


def test_storage_imports_neither_engine_nor_the_app():
    assert not _imported_top_levels("storage") & {"engine", "colibri_stream"}


def test_no_unsafe_loaders_in_package_code():
    for package in ("colibri_stream", "engine", "storage"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert "pickle.load" not in text and "torch.load(" not in text, path
