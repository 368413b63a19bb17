"""mypy is part of the test command: the library (engine, storage, colibri_stream's library folders) is
checked strictly and the apps loosely, as pyproject.toml's [tool.mypy] sets out; any error fails CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_is_clean():
    # the files and flags come from pyproject.toml; the cache (.mypy_cache, ignored by git) makes reruns fast
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
