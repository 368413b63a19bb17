"""COLIBRI_STREAM_ISA=avx2: on a CPU with AVX-512 the kernels take their AVX2 loops (what a host without
AVX-512 runs, measured on this one) and give the same tokens; a misspelt value is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from colibri_stream.bench.system import cli_argv
from engine.kernels import _kernels
from engine.kernels.isa import ISA_ENV, check_isa_env


def test_a_misspelt_cap_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="COLIBRI_STREAM_ISA='avx512f': expected one of best, avx2, avx512"):
        check_isa_env({ISA_ENV: "avx512f"})
    check_isa_env({})
    check_isa_env({ISA_ENV: "avx2"})
    done = subprocess.run([sys.executable, "-c", "import engine"], env=_env("AVX2"), capture_output=True, text=True)
    assert done.returncode != 0 and "COLIBRI_STREAM_ISA='AVX2'" in done.stderr


def _env(isa: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ISA_ENV}
    return env if isa is None else {**env, ISA_ENV: isa}


def _constants(isa: str | None, names: str = "SIMD_LEVEL, Q8_VNNI, BF16_SIMD, ISA_CAP") -> tuple[int, ...]:
    """The extension's constants ``names`` as a process started with COLIBRI_STREAM_ISA=isa (None: unset) sees them."""
    values = ", ".join(f"k.{name.strip()}" for name in names.split(","))
    code = f"from engine.kernels import _kernels as k; print({values})"
    done = subprocess.run([sys.executable, "-c", code], env=_env(isa), capture_output=True, text=True, check=True)
    return tuple(int(word) for word in done.stdout.split())


NO_AVX512 = pytest.mark.skipif(_kernels.SIMD_LEVEL < 2, reason="no AVX-512 here: the best loops are AVX2 already")


@NO_AVX512
def test_the_cap_takes_the_avx2_loops():
    assert _constants(None)[::3] == (2, 2) and _constants("best")[::3] == (2, 2)
    assert _constants("avx2") == (1, 0, 1, 1)  # AVX2 loops, no VNNI, the bf16 kernel's AVX2 loops, capped


@pytest.mark.skipif(not _kernels.Q8_AMX, reason="no AMX here: the tile products take the AVX-512 loops already")
def test_the_avx512_cap_leaves_the_amx_tiles_alone():
    names = "Q8_AMX, Q8_TILES_FAST, SIMD_LEVEL, ISA_CAP"
    assert _constants(None, names) == (1, 1, 2, 2)
    assert _constants("avx512", names) == (0, 1, 2, 2)  # AMX off, the AVX-512 loops kept
    assert _constants("avx2", names) == (0, 0, 1, 1)


@NO_AVX512
@pytest.mark.parametrize("dense, activations", [("int8", "int8"), ("bf16", "float32")])
def test_the_capped_loops_give_the_same_tokens(make_container, tmp_path, dense, activations):
    container = make_container("deepseek_v3", "int4", dense)
    ids = {}
    for isa in (None, "avx2"):
        argv = cli_argv("run", str(container), "--ids", "5,9,17,33,2", "--max-new-tokens", "8", "--json")
        argv += ["--activations", activations, "--kv-dir", str(tmp_path / f"kv-{isa}"), "--no-prefix-cache"]
        done = subprocess.run(argv, env=_env(isa), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        ids[isa] = json.loads(done.stdout.strip().splitlines()[-1])["ids"]
    assert len(ids[None]) == 8 and ids["avx2"] == ids[None]
