"""Process-wide defaults colibri_stream sets on import, before torch loads OpenMP."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = "import colibri_stream, os, torch; print(os.environ['OMP_WAIT_POLICY'])"


def probe(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_openmp_threads_wait_passively_unless_the_user_says_otherwise():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert probe(env) == "PASSIVE"
    assert probe({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
