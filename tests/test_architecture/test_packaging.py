"""What a non-editable install gets: the demo model as package data (found through importlib.resources,
not through the clone), and no test-only code (colibri_stream/devtools is for tests/ and tools/)."""

from __future__ import annotations

import ast
import fnmatch
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import resources
from pathlib import Path

import pytest

from colibri_stream.checkpoint.demo_model import DEMO_MODEL_FOLDER, demo_model_dir

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("colibri_stream", "engine", "storage")
TEST_ONLY = "colibri_stream/devtools"


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _shipped_sources() -> set[str]:
    """Every .py file of the three packages but the test-only folder, as wheel paths."""
    paths = {p.relative_to(ROOT).as_posix() for package in SHIPPED for p in (ROOT / package).rglob("*.py")}
    return {p for p in paths if not p.startswith(TEST_ONLY + "/")}


def test_the_demo_model_is_package_data():
    path = demo_model_dir()
    assert path == resources.files("colibri_stream") / DEMO_MODEL_FOLDER
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        f.name for f in path.iterdir()
    }
    patterns = _setuptools_config()["package-data"]["colibri_stream"]
    for data in path.iterdir():
        assert any(fnmatch.fnmatch(f"{DEMO_MODEL_FOLDER}/{data.name}", p) for p in patterns), data


def test_only_tests_and_tools_import_the_devtools():
    """devtools is left out of the wheel: an installed module importing it would fail there."""
    assert {"colibri_stream.devtools", "colibri_stream.devtools.*"} <= set(
        _setuptools_config()["packages"]["find"]["exclude"]
    )
    importers = []
    for relative in _shipped_sources():
        for node in ast.walk(ast.parse((ROOT / relative).read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "colibri_stream.devtools" or n.startswith("colibri_stream.devtools.") for n in names):
                importers.append(relative)
    assert not importers


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel of a copy of the tree (the build writes build/ and egg-info beside its sources). CC=false
    fails the C extension's build, which setup.py tolerates: the file list is what is checked here, and
    compiling would cost minutes."""
    if shutil.which("false") is None:
        pytest.skip("no `false` to stand in for the compiler")
    try:  # --no-build-isolation builds with what is installed: setuptools 70.1+ has bdist_wheel itself
        import setuptools.command.bdist_wheel  # noqa: F401
    except ImportError:
        pytest.importorskip("wheel")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in SHIPPED:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    out = tmp_path_factory.mktemp("wheel")
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        str(src),
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "CC": "false"})
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = out.glob("colibri_stream-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_ships_the_demo_model_and_every_module_but_the_devtools(wheel):
    names = set(wheel.namelist())
    for data in demo_model_dir().iterdir():
        entry = f"colibri_stream/{DEMO_MODEL_FOLDER}/{data.name}"
        assert entry in names and wheel.getinfo(entry).file_size == data.stat().st_size, entry
    assert {n for n in names if n.endswith(".py")} == _shipped_sources()
    assert not [n for n in names if n.startswith((TEST_ONLY, "tests/", "tools/", "engine/csrc/"))]
