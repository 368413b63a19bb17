"""`plan`'s expected peak RSS is a promise at any prompt length: a `run` child process stays within 10%
of it from a short prompt to the full context (--context), in float32 and bfloat16.

The demo model is the subject: its DSA indexer (16 heads) makes long prompts' activations a large
share of its memory (one-shot prefill of 2047 tokens peaked 64% above a plan without them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools.fixtures import make_prompt

DTYPES = ("float32", "bfloat16")
RAM = "40%"
SHORT = 16
CONTEXT = 2048  # --context: the demo's 32k would make a full-context run minutes long; the promise is the same


def _child(*argv: str) -> subprocess.Popen:
    # One thread per child: the children run side by side, and an oversubscribed OpenMP pool only
    # costs time (memory is what is measured).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "colibri_stream", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


def _last_json(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err.decode()[-2000:]
    return json.loads(out.decode().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[tuple[str, int], tuple[int, int]]:
    """(dtype, prompt length) -> (peak RSS of a run child, plan's expected peak RSS)."""
    container = tmp_path_factory.mktemp("plan-promise") / "demo-int4"
    Converter(demo_model_dir(), container, ConvertOptions(), progress=False).run()
    runs, plans = {}, {}
    sized = ["--ram", RAM, "--json", "--context", str(CONTEXT)]
    for dtype in DTYPES:
        plans[dtype] = _child("plan", str(container), *sized, "--dtype", dtype)
        for length in (SHORT, CONTEXT - 1):  # the one generated token fills the context
            ids = ",".join(map(str, make_prompt(4096, length, seed=length)))
            argv = [*sized, "--dtype", dtype, "--max-new-tokens", "1", "--ids", ids]
            runs[dtype, length] = _child("run", str(container), *argv)
    expected = {dtype: _last_json(p)["expected_peak_rss_bytes"] for dtype, p in plans.items()}
    return {key: (_last_json(p)["stats"]["peak_rss_bytes"], expected[key[0]]) for key, p in runs.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prompt", ["short", "full context"])
def test_peak_rss_of_a_run_stays_within_the_plan(measured, dtype, prompt):
    length = SHORT if prompt == "short" else max(n for _, n in measured)
    peak, expected = measured[dtype, length]
    ratio = peak / expected
    print(f"{dtype} {length} tokens: peak {peak / 2**20:.1f} MiB, plan {expected / 2**20:.1f} MiB ({ratio:.3f})")
    assert ratio <= 1.10, f"peak RSS {peak} is {ratio:.2f} x the plan's {expected}"
    assert ratio >= 0.6, f"the plan ({expected}) is padded: {ratio:.2f} x it measured ({peak})"
