"""mypy is part of the test command: the library (engine, storage, colibri_stream's library folders) is
checked strictly and the apps loosely, as pyproject.toml's [tool.mypy] sets out; any error fails CI.

The same run checks the test files in ALSO_CHECKED (test_declared_interfaces.py's ``_conformance`` block:
the implementations held to the Protocols): one mypy process over everything, since each run re-analyses
the imported library (~2 minutes of the suite on 2 cores)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALSO_CHECKED = ("tests/test_architecture/test_declared_interfaces.py",)


def mypy_files() -> list[str]:
    return [*tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"], *ALSO_CHECKED]


def test_mypy_is_clean():
    # flags from pyproject.toml (files given here replace its list); the cache (.mypy_cache, ignored by git)
    # makes reruns fast
    result = subprocess.run([sys.executable, "-m", "mypy", *mypy_files()], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
