"""The shipped demo, converted and run by an aarch64 Python under qemu, token for token against this x86 host.

python tools/arm64_emulated_demo.py [--tokens 24] [--cpus max,cortex-a57,max:neon] [--threads 1]

Slow (~8 min: every aarch64 instruction is emulated), so a tool run by hand, not a test. Debian x86-64 hosts
(apt-get, dpkg-deb, Debian's archive keyring; Ubuntu needs debian-archive-keyring) with aarch64-linux-gnu-gcc;
downloads once into --cache (~8 GB):
  1. an aarch64 Python 3.11 sysroot: Debian bookworm's arm64 .debs, fetched with a private apt state (no
     `dpkg --add-architecture`, nothing installed on the host) and unpacked with `dpkg-deb -x`;
  2. qemu-user 10 from bookworm-backports, unpacked the same way (bookworm's qemu 7.2 crashes in torch's
     import: SIGSEGV in torch._C's init);
  3. aarch64 wheels of the package's dependencies, pinned to the versions this host has installed, from PyPI
     (`pip download --platform`; torch's aarch64 wheel on PyPI is a CUDA build, so its CUDA libraries come
     too: they are only loaded, the run is on the CPU);
  4. the package's wheel for linux_aarch64: `pip wheel` of this tree, its x86 extension swapped for engine/csrc
     cross-compiled with setup.py's flags (engine/kernels/_kernels.cpython-311-aarch64-linux-gnu.so), retagged,
     then `pip install --target --platform linux_aarch64` of it: the ARM targets import what that wheel holds.
Then per target (this host; qemu as each --cpus model, MODEL:ISA also setting COLIBRI_STREAM_ISA=ISA):
`python -m colibri_stream demo --json` in a fresh cache (converts the demo to int4, generates from the
container), then tools/arm64_demo_probe.py on that container (doctor's kernel level; greedy ids of the float
checkpoint and of the container with int8 activations; every model's prefill logits; transformers' ids on the
host). Exits 1 unless every id list equals the host's, the host's float ids equal transformers', every ARM
logit is within LOGIT_TOLERANCES of the host's, and each ARM target names the NEON level its CPU model (and ISA
cap) should take; 2 when a setup step fails (the message says which).
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "import os\n\n\nclass Path:\n    def __init__(self, "  # varied greedy text (the default prompt loops)
DEBIAN = "http://deb.debian.org/debian"
ARM64_SOURCES = f"""deb [arch=arm64] {DEBIAN} bookworm main
deb [arch=arm64] {DEBIAN} bookworm-updates main
deb [arch=arm64] http://deb.debian.org/debian-security bookworm-security main
"""
QEMU_SOURCES = f"deb {DEBIAN} bookworm-backports main\n"
SYSROOT_DEBS = (
    "libc6", "libgcc-s1", "libstdc++6", "python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib",
    "libpython3.11-dev", "libexpat1", "zlib1g", "libffi8", "libssl3", "libbz2-1.0", "liblzma5", "libsqlite3-0",
    "libuuid1", "libcrypt1", "libzstd1", "libncursesw6", "libtinfo6", "libreadline8", "libdb5.3", "libtirpc3",
    "libnsl2",
)  # fmt: skip
# pyproject's runtime dependencies, pinned below to this host's versions
DEPENDENCIES = (
    "torch", "numpy", "zarr", "psutil", "safetensors", "tokenizers", "jinja2", "tqdm", "crc32c", "huggingface_hub",
    "cryptography",
)  # fmt: skip
PLATFORMS = [f"manylinux_2_{v}_aarch64" for v in range(17, 29)] + ["manylinux2014_aarch64", "linux_aarch64"]
DOTPROD_CPUS = ("max", "neoverse-n1", "neoverse-n2", "neoverse-v1", "cortex-a76", "cortex-a710")  # qemu -cpu models
NO_DOTPROD_CPUS = ("cortex-a53", "cortex-a57", "cortex-a72")


class SetupError(RuntimeError):
    """A step of the setup failed; the message says which and why."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(
    cmd: list[str], what: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env)
    if done.returncode != 0:
        raise SetupError(f"{what} failed ({done.returncode}): {' '.join(cmd[:6])} ...\n{done.stderr[-3000:]}")
    return done


def apt_fetch(state: Path, sources: str, packages: tuple[str, ...], arch: str | None) -> list[Path]:
    """Download .debs with apt-get using a private state under ``state`` (the host's apt is left alone)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise SetupError("apt-get and dpkg-deb are needed (a Debian or Ubuntu host)")
    for sub in ("lists/partial", "cache/archives/partial", "debs"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / "sources.list").write_text(sources)
    opts = [f"-oDir::Etc::SourceList={state / 'sources.list'}", "-oDir::Etc::SourceParts=/nonexistent",
            f"-oDir::State::Lists={state / 'lists'}", f"-oDir::Cache={state / 'cache'}",
            "-oDir::State::status=/dev/null", "-oDebug::NoLocking=1", "-oAPT::Sandbox::User=root"]  # fmt: skip
    if arch is not None:
        opts += [f"-oAPT::Architecture={arch}", f"-oAPT::Architectures::={arch}"]
    run(["apt-get", *opts, "update"], "apt-get update")
    debs = state / "debs"
    for old in debs.glob("*.deb"):
        old.unlink()
    run(["apt-get", *opts, "download", *packages], "apt-get download", cwd=debs)
    return sorted(debs.glob("*.deb"))


def unpack(debs: list[Path], into: Path) -> None:
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    for deb in debs:
        run(["dpkg-deb", "-x", str(deb), str(into)], f"unpacking {deb.name}")


def ensure_sysroot(cache: Path) -> Path:
    root = cache / "sysroot"
    if not (root / ".done").is_file():
        log("aarch64 sysroot: downloading Debian bookworm's arm64 Python 3.11 .debs")
        unpack(apt_fetch(cache / "apt-arm64", ARM64_SOURCES, SYSROOT_DEBS, "arm64"), root)
        (root / ".done").touch()
    return root


def ensure_qemu(cache: Path, given: str | None) -> Path:
    if given is not None:
        return Path(given)
    qemu = cache / "qemu" / "usr" / "bin" / "qemu-aarch64"
    if not qemu.is_file():
        log("qemu-user 10: downloading bookworm-backports' qemu-user (static binaries)")
        unpack(apt_fetch(cache / "apt-qemu", QEMU_SOURCES, ("qemu-user",), None), cache / "qemu")
    return qemu


def pinned_requirements() -> list[str]:
    pins = []
    for name in DEPENDENCIES:
        version = importlib.metadata.version(name).split("+")[0]  # torch 2.13.0+cpu: PyPI's 2.13.0
        pins.append(f"{name}=={version}")
    return pins


def ensure_site(cache: Path) -> Path:
    site, wheels = cache / "site-packages", cache / "wheels"
    pins = pinned_requirements()
    stamp = site / ".pins"
    if stamp.is_file() and stamp.read_text() == " ".join(pins):
        return site
    platform = [arg for p in PLATFORMS for arg in ("--platform", p)]
    target = [*platform, "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3",
              "--abi", "none", "--only-binary=:all:"]  # fmt: skip
    log(f"aarch64 wheels: pip download {' '.join(pins)} (and their dependencies; ~3 GB with torch's CUDA libs)")
    pip = [sys.executable, "-m", "pip"]
    run([*pip, "download", *target, "-d", str(wheels), *pins], "pip download")
    log("aarch64 wheels: pip install --target")
    shutil.rmtree(site, ignore_errors=True)
    run([*pip, "install", "--no-compile", "--target", str(site), "--no-index", "--find-links", str(wheels), *target,
         *pins], "pip install --target")  # fmt: skip
    stamp.write_text(" ".join(pins))
    return site


def c_files() -> list[str]:
    """setup.py's C_FILES (read, not imported: importing setup.py runs setup())."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "C_FILES" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise SetupError("setup.py has no C_FILES")


def cross_build_extension(sysroot: Path, out: Path) -> Path:
    """engine/csrc cross-built for aarch64 into ``out`` (setup.py's flags, Debian's aarch64 Python headers)."""
    compiler = shutil.which("aarch64-linux-gnu-gcc")
    if compiler is None:
        raise SetupError("aarch64-linux-gnu-gcc not found (apt-get install gcc-aarch64-linux-gnu)")
    # pyconfig.h includes <aarch64-linux-gnu/python3.11/pyconfig.h>; -idirafter: the compiler's libc headers first
    includes = [f"-I{sysroot}/usr/include/python3.11", "-idirafter", f"{sysroot}/usr/include"]
    flags = ["-DNDEBUG", "-fwrapv", "-Wall", "-fPIC", "-O3", "-ffp-contract=off", "-shared"]
    sources = [str(ROOT / "engine" / "csrc" / f"{name}.c") for name in c_files()]
    log(f"cross-compiling {len(sources)} engine/csrc files for aarch64")
    run([compiler, *flags, *includes, *sources, "-o", str(out), "-lm", "-lpthread"], "aarch64-linux-gnu-gcc")
    return out


def aarch64_wheel(cache: Path, sysroot: Path) -> Path:
    """The package's wheel for linux_aarch64: pip builds this host's wheel, whose x86 extension is swapped for
    the cross-built one, its tag retagged and its RECORD rewritten (what `wheel tags` does, with the stdlib)."""
    out = cache / "wheels"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log("building the package's wheel (pip wheel, this host)")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out / "host"),
         str(ROOT)], "pip wheel")  # fmt: skip
    (host,) = (out / "host").glob("colibri_stream-*.whl")
    extension = cross_build_extension(sysroot, out / "_kernels.cpython-311-aarch64-linux-gnu.so")
    arm = out / host.name.replace("linux_x86_64", "linux_aarch64")
    if arm == out / host.name:
        raise SetupError(f"{host.name}: not a linux_x86_64 wheel to retag")
    with zipfile.ZipFile(host) as source, zipfile.ZipFile(arm, "w", zipfile.ZIP_DEFLATED) as wheel:
        record = next(name for name in source.namelist() if name.endswith(".dist-info/RECORD"))
        files: dict[str, bytes] = {}
        for name in source.namelist():
            if name == record or (name.startswith("engine/kernels/_kernels.") and name.endswith(".so")):
                continue
            data = source.read(name)
            files[name] = data.replace(b"linux_x86_64", b"linux_aarch64") if name.endswith("/WHEEL") else data
        files[f"engine/kernels/{extension.name}"] = extension.read_bytes()
        rows = [f"{name},sha256={_digest(data)},{len(data)}" for name, data in files.items()] + [f"{record},,"]
        for name, data in {**files, record: ("\n".join(rows) + "\n").encode()}.items():
            wheel.writestr(name, data)
    return arm


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def install_wheel(cache: Path, wheel: Path) -> Path:
    """``wheel`` installed by pip for aarch64 CPython 3.11 into a target folder (what the ARM targets import)."""
    target = cache / "installed"
    shutil.rmtree(target, ignore_errors=True)
    run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), "--platform",
         "linux_aarch64", "--python-version", "3.11", "--implementation", "cp", "--only-binary=:all:", str(wheel)],
        "pip install --target (the aarch64 wheel)")  # fmt: skip
    built = sorted(p.name for p in (target / "engine" / "kernels").glob("_kernels.*.so"))
    if built != ["_kernels.cpython-311-aarch64-linux-gnu.so"]:
        raise SetupError(f"the installed aarch64 wheel holds {built}, not the aarch64 extension alone")
    log(f"installed {wheel.name} for aarch64 into {target}")
    return target


@dataclass
class Target:
    name: str
    prefix: list[str]  # the Python to run (qemu + aarch64 python, or this one)
    env: dict[str, str]
    cpu: str | None = None
    isa: str | None = None  # COLIBRI_STREAM_ISA


def run_target(target: Target, tokens: int, oracle: bool, results: Path) -> dict[str, object]:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as xdg:
        log(f"{target.name}: colibri-stream demo (convert to int4 in a fresh cache, then generate)")
        demo = [*target.prefix, "-m", "colibri_stream", "demo", "--json", "--reset", "--prompt", PROMPT,
                "--max-new-tokens", str(tokens)]  # fmt: skip
        shown = run(demo, "colibri-stream demo", env={**target.env, "XDG_CACHE_HOME": xdg}).stdout
        demo_ids = json.loads(shown.splitlines()[-1])["ids"]
        containers = list(Path(xdg).glob("colibri-stream/demo/*.cstream"))
        if len(containers) != 1:
            raise SetupError(f"{target.name}: the demo left {len(containers)} containers in its cache, not 1")
        log(f"{target.name}: probe (kernel level, float and int8-activation greedy, logits)")
        logits = results / f"{target.name.replace(' ', '_')}.npz"
        probe = [*target.prefix, str(ROOT / "tools" / "arm64_demo_probe.py"), "--tokens", str(tokens), "--prompt",
                 PROMPT, "--container", str(containers[0]), "--logits-out", str(logits)]  # fmt: skip
        done = run(probe + (["--oracle"] if oracle else []), "probe", env=target.env)
    result: dict[str, object] = {**json.loads(done.stdout.splitlines()[-1]), "demo_ids": demo_ids, "logits": logits}
    result["wall_s"] = round(time.perf_counter() - start)
    log(f"{target.name}: done in {result['wall_s']} s ({result['kernels']})")
    return result


# The NEON kernels give the x86 kernels' bits (tools/kernel_bits_harness.c); torch's ops do not (another build
# and BLAS): 1.6e-5 measured on logits up to 16.3. Scaling half of each NEON 8-lane sum by 0.999 moved the int4
# logits 7.6e-3 and the int8-activation ones 3.6e-2, every id unchanged (docs/kernels.md, "ARM (NEON)"): the
# int4 model's 1e-3 catches that. The int8-activation model gets more room: torch's 1e-5 before a layer can
# move an activation across an int8 rounding step (1/127 of its row's largest), which the fine-tuned demo's
# weights turned into 1.6e-2 on its logits with the NEON kernels still byte-equal to x86's.
LOGIT_TOLERANCES = {"float": 1e-3, "int4": 1e-3, "int4_int8_activations": 5e-2}
IDS = ("demo_ids", "float_ids", "int8_activation_ids")  # demo: int4 experts, float activations, streamed


def logit_gaps(result: dict[str, object], host: dict[str, object]) -> dict[str, float]:
    """max |logit - host logit| per model (float, int4, int4 + int8 activations); 0 when bit-identical."""
    mine, theirs = np.load(str(result["logits"])), np.load(str(host["logits"]))
    return {k: float(np.abs(mine[k] - theirs[k]).max()) for k in theirs.files}


def level_expected(level: str, cpu: str, isa: str | None) -> bool:
    """doctor's kernels line names the NEON loops this qemu CPU model (and COLIBRI_STREAM_ISA) should take."""
    if not level.startswith("NEON"):
        return False
    if isa == "neon" or cpu in NO_DOTPROD_CPUS:
        return not level.startswith("NEON dot-product")
    return cpu not in DOTPROD_CPUS or level.startswith("NEON dot-product")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=24, help="tokens to generate (default 24)")
    parser.add_argument(
        "--cpus", default="max,cortex-a57,max:neon", help="qemu -cpu models, MODEL:ISA sets COLIBRI_STREAM_ISA"
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS everywhere (default 1)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "colibri-stream" / "arm64-emulated")
    parser.add_argument("--qemu", help="a qemu-aarch64 to use (>= 8; default: bookworm-backports' 10, downloaded)")
    args = parser.parse_args()
    try:
        sysroot = ensure_sysroot(args.cache)
        qemu = ensure_qemu(args.cache, args.qemu)
        version = run([str(qemu), "--version"], "qemu --version").stdout.split("\n", 1)[0]
        if int(re.findall(r"version (\d+)", version)[0]) < 8:
            raise SetupError(f"{version}: too old (7.2 crashes in torch's import); leave out --qemu")
        site = ensure_site(args.cache)
        installed = install_wheel(args.cache, aarch64_wheel(args.cache, sysroot))
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COLIBRI_STREAM_ISA", "PYTHONHOME")}
    base["OMP_NUM_THREADS"] = str(args.threads)
    arm_env = {**base, "PYTHONPATH": f"{installed}:{site}"}
    python = str(sysroot / "usr" / "bin" / "python3.11")
    targets = [Target("x86-64 host", [sys.executable], {**base, "PYTHONPATH": str(ROOT)})]
    for spec in args.cpus.split(","):
        cpu, _, isa = spec.partition(":")
        prefix = ["nice", "-n", "10", str(qemu), "-cpu", cpu, "-L", str(sysroot), python]
        env = {**arm_env, "COLIBRI_STREAM_ISA": isa} if isa else arm_env
        targets.append(Target(f"aarch64 -cpu {cpu}" + (f" ISA={isa}" if isa else ""), prefix, env, cpu, isa or None))
    log(f"{version.strip()}; prompt {PROMPT!r}, {args.tokens} tokens")
    out = args.cache / "results"
    out.mkdir(exist_ok=True)
    try:
        results = [run_target(t, args.tokens, t.cpu is None, out) for t in targets]
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    host = results[0]
    failures = []
    if host["float_ids"] != host["oracle_ids"]:
        failures.append("host: the float engine's ids differ from transformers'")
    print(f"\n{'target':<26} {'ids: demo/float/int8-act':<25} {'max |dlogit| vs host':<24} {'wall s':>6}  kernels")
    for target, result in zip(targets, results, strict=True):
        same = [result[k] == host[k] for k in IDS]
        level = str(result["kernels"])
        if target.cpu is not None and not level_expected(level, target.cpu, target.isa):
            failures.append(f"{target.name}: kernels {level!r}, not the NEON level this CPU model has")
        if not all(same):
            failures.append(f"{target.name}: ids differ from the host's ({', '.join(IDS)}: {same})")
        tags = "/".join("=" if equal else "DIFFER" for equal in same) + (" host" if target.cpu else " (host)")
        gaps = logit_gaps(result, host) if target.cpu is not None else {}
        over = {k: gap for k, gap in gaps.items() if gap > LOGIT_TOLERANCES[k]}
        if over:
            failures.append(f"{target.name}: logits {over} from the host's, over {LOGIT_TOLERANCES}")
        shown = "/".join(f"{gap:.2g}" for gap in gaps.values()) or "-"
        print(f"{target.name:<26} {tags:<25} {shown:<24} {result['wall_s']:>6}  {level}")
    arm = [np.load(str(r["logits"])) for r in results[1:]]
    if len(arm) > 1:  # informational: torch may pick other loops per CPU model, the NEON kernels promise the same bits
        identical = all(np.array_equal(a[k], arm[0][k]) for a in arm[1:] for k in arm[0].files)
        print(f"aarch64 targets' logits bit-identical to each other: {identical}")
    print(f"host torch {host['torch']} vs aarch64 torch {results[-1]['torch']}; logits: float/int4/int4 int8-act")
    for key in IDS:
        print(f"host {key}: {host[key]}")
    print(f"host float ids = transformers' greedy ids: {host['float_ids'] == host['oracle_ids']}")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
