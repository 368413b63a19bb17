"""The aarch64 NEON kernels give the x86 kernels' bits: tools/kernel_bits_harness.c built here (the AVX2 loops)
and with aarch64-linux-gnu-gcc, run under qemu-aarch64 as a CPU with dot-product (-cpu max: the SDOT loops) and
one without (cortex-a57: plain NEON), every kernel on test_int4_kernel's and test_q8's shapes and ragged ones,
line for line the same. Skipped, saying what is missing, without the cross compiler or qemu (.ci/run installs
both). The pure-Python part (the ISA names of either architecture) runs everywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from engine.kernels.isa import ISA_ENV, check_isa_env, describe_isa, isa_caps

ROOT = Path(__file__).resolve().parents[3]
SOURCES = [ROOT / "tools" / "kernel_bits_harness.c"] + [
    ROOT / "engine" / "csrc" / f"{name}.c"
    for name in ("nibble", "q8", "q8_tiles", "bf16", "decode_ops", "index_select", "split", "read_ahead")
]
# -O1: half the compile time of -O3 on a busy box; the bits do not depend on it (no float reassociation without
# -ffast-math, no fusing with -ffp-contract=off)
FLAGS = ["-O1", "-ffp-contract=off", f"-I{ROOT / 'engine' / 'csrc'}"]
CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
needs_arm_tools = pytest.mark.skipif(
    shutil.which(CROSS) is None or shutil.which(QEMU) is None,
    reason=f"{CROSS} or {QEMU} not installed (apt-get install gcc-aarch64-linux-gnu qemu-user; .ci/run does)",
)


def _build(compiler: str, out: Path, *extra: str) -> Path:
    cmd = [compiler, *FLAGS, *extra, "-o", str(out), *map(str, SOURCES), "-lm", "-lpthread"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return out


def _run(cmd: list[str], isa: str | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != ISA_ENV}
    if isa is not None:
        env[ISA_ENV] = isa
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "ok" and not any(line.startswith("FAIL") for line in lines)
    return lines


@pytest.fixture(scope="module")
def x86_lines(tmp_path_factory) -> list[str]:
    if shutil.which("cc") is None:
        pytest.skip("no native C compiler")
    lines = _run([str(_build("cc", tmp_path_factory.mktemp("x86") / "bits"))])
    if "simd=0" in lines[0]:
        pytest.skip("this CPU has no AVX2: no x86 SIMD bits to compare against")
    return lines


@pytest.fixture(scope="module")
def arm_binary(tmp_path_factory) -> Path:
    return _build(CROSS, tmp_path_factory.mktemp("arm") / "bits", "-static")


@needs_arm_tools
@pytest.mark.parametrize(
    ("cpu", "isa", "levels"),
    [
        ("max", None, "simd=1 wide=1"),  # dot-product: the q8 kernel's SDOT loops
        ("cortex-a57", None, "simd=1 wide=0"),  # ARMv8.0, no dot-product: plain NEON
        ("max", "neon", "simd=1 wide=0"),  # the cap holds a dot-product CPU to plain NEON
    ],
    ids=["dotprod", "no-dotprod", "capped"],
)
def test_neon_kernels_give_the_x86_bits(x86_lines, arm_binary, cpu, isa, levels):
    arm = _run([QEMU, "-cpu", cpu, str(arm_binary)], isa)
    assert levels in arm[0]
    assert len(arm) == len(x86_lines) > 150
    # every kernel, every case: the same bytes of output (and of q8's prepared x)
    assert arm[1:] == x86_lines[1:]


@needs_arm_tools
def test_the_arm_build_carries_the_sdot_and_neon_loops(arm_binary):
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump is None:
        pytest.skip("aarch64-linux-gnu-objdump not installed")
    text = subprocess.run([objdump, "-d", str(arm_binary)], capture_output=True, text=True, check=True).stdout
    assert "\tsdot\t" in text and "\tfmla\t" in text and "\ttbl\t" in text


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang not installed (apt-get install clang)")
def test_clang_builds_the_kernels_with_the_same_bits(x86_lines, tmp_path):
    assert _run([str(_build("clang", tmp_path / "bits"))]) == x86_lines


CLANG_ARM = ["--target=aarch64-linux-gnu", "--sysroot=/usr/aarch64-linux-gnu", "--gcc-toolchain=/usr"]


@needs_arm_tools
@pytest.mark.skipif(shutil.which("clang") is None, reason="clang not installed (apt-get install clang)")
def test_clang_builds_the_arm_kernels_with_the_same_bits(x86_lines, tmp_path):
    """clang for aarch64 (the gcc cross toolchain's libraries and linker), both CPU models."""
    binary = _build("clang", tmp_path / "bits", *CLANG_ARM, "-fuse-ld=/usr/bin/aarch64-linux-gnu-ld", "-static")
    for cpu in ("max", "cortex-a57"):
        assert _run([QEMU, "-cpu", cpu, str(binary)])[1:] == x86_lines[1:]


@needs_arm_tools
def test_every_extension_source_compiles_for_aarch64(tmp_path):
    """The whole extension's sources, Python entry points included, for aarch64 with gcc (and clang where
    installed), warnings as errors; against this machine's Python headers (no aarch64 Python here to link)."""
    include = sysconfig.get_paths()["include"]
    compilers = [[CROSS]] + ([["clang", *CLANG_ARM]] if shutil.which("clang") else [])
    for compiler in compilers:
        for source in sorted((ROOT / "engine" / "csrc").glob("*.c")):
            cmd = [*compiler, "-O0", "-Wall", "-Werror", "-ffp-contract=off", "-fPIC", f"-I{include}", "-c"]
            cmd += [f"-I{ROOT / 'engine' / 'csrc'}", str(source), "-o", str(tmp_path / f"{source.stem}.o")]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{' '.join(compiler)} {source.name}: {done.stderr[-2000:]}"


def test_each_architecture_names_its_own_caps():
    assert isa_caps("x86_64") == ("best", "avx2", "avx512") and isa_caps("aarch64") == ("best", "neon", "dotprod")
    check_isa_env({ISA_ENV: "neon"}, machine="arm64")
    with pytest.raises(ValueError, match="expected one of best, neon, dotprod"):
        check_isa_env({ISA_ENV: "avx2"}, machine="aarch64")
    with pytest.raises(ValueError, match="expected one of best, avx2, avx512"):
        check_isa_env({ISA_ENV: "neon"}, machine="x86_64")
    assert describe_isa(2, 2, False, 1, machine="aarch64") == "NEON dot-product"
    assert describe_isa(1, 1, False, 3, machine="aarch64") == (
        "NEON (i8mm present, not used) (capped by COLIBRI_STREAM_ISA=neon)"
    )
    assert describe_isa(1, 1, False, 0, machine="x86_64") == "AVX2 (capped by COLIBRI_STREAM_ISA=avx2)"
    assert describe_isa(2, 2, True, 0, machine="x86_64") == "AVX-512 VNNI"
    assert describe_isa(2, 2, True, 0, machine="x86_64", amx=True) == "AVX-512 VNNI, AMX tiles"
