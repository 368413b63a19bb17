"""The valid inputs every mutation starts from, built once per run: the tiny deepseek_v32 checkpoint
(DSA, so KV records carry indexer keys), its int4 container, a session's KV log, a usage history, a
routing trace, a budget file and a KV pack — the last four written by real ``run`` and ``kv export``
commands, so they are what the product itself writes. Each case copies what its surface needs into its own directory."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from colibri_stream.devtools.fuzz.canary import plant
from colibri_stream.devtools.fuzz.harness import Case, Worker, judge

FAMILY = "deepseek_v32"
SESSION = "s"
PROMPT_IDS = "5,6,7,8"
PACK = "pack.kvpack"  # a KV pack of two blocks, written by `kv export` (pack_scenario.py)
PACK_IDS = ",".join(str(5 + i) for i in range(130))
BUDGET_TOML = """\
[memory]
ram = "50%"
vram = 0
[io]
direct = false
threads = 2
[cache]
policy = "pinned"
prefetch = true
history = "history.json"
"""

# What a case directory may hold, each copied from the base of the same name.
ENTRIES = ("ckpt", "container", "kv", "history.json", "trace.jsonl", "budget.toml", PACK, "cluster")


def build(root: Path, worker: Worker, checkpoint: Path | None = None, container: Path | None = None) -> Path:
    """Write every base input under ``root/base`` (reusing a checkpoint/container when given) and the
    canary files under ``root/outside``; return ``root/base``."""
    base = root / "base"
    base.mkdir(parents=True, exist_ok=True)
    plant(root / "outside")
    if checkpoint is None:
        from colibri_stream.devtools import fixtures

        checkpoint = fixtures.build_tiny_checkpoint(FAMILY, root / "built-ckpt")
    shutil.copytree(checkpoint, base / "ckpt")
    if container is None:
        _must(worker, base, ["convert", "ckpt", "container"])
    else:
        shutil.copytree(container, base / "container")
    (base / "budget.toml").write_text(BUDGET_TOML)
    _must(worker, base, ["run", "container", "--ids", PROMPT_IDS, "--max-new-tokens", "3", "--budget", "budget.toml",
                         "--kv-dir", "kv", "--session", SESSION, "--trace", "trace.jsonl", "--json"])  # fmt: skip
    _must(
        worker, base, ["run", "container", "--ids", PACK_IDS, "--max-new-tokens", "1", "--kv-dir", "pack-kv", "--json"]
    )
    _must(worker, base, ["kv", "export", "container", PACK, "--ids", PACK_IDS, "--kv-dir", "pack-kv", "--json"])
    shutil.rmtree(base / "pack-kv")
    _write_index(base / "ckpt")
    _must_call(worker, base, "colibri_stream.devtools.fuzz.cluster_calls:write_bases")  # the cluster frame files
    for entry in ENTRIES:
        assert (base / entry).exists(), f"base input {entry} was not written"
    return base


def _must(worker: Worker, cwd: Path, argv: list[str]) -> None:
    case = Case("base", str(cwd), [], [], argv=argv)
    verdict = judge(case, worker.run(case), extra_roots=worker.scratch_roots())
    if verdict.judgement != "ok":
        stderr = verdict.result.get("stderr", "")[-2000:]
        raise RuntimeError(f"building a base input failed: {case.command()}: {verdict.detail}\n{stderr}")


def _must_call(worker: Worker, cwd: Path, target: str) -> None:
    """A library function run in the child (it imports torch; this process does not)."""
    case = Case("base", str(cwd), [], [], kind="call", target=target, args=[str(cwd)])
    verdict = judge(case, worker.run(case), extra_roots=worker.scratch_roots())
    if verdict.judgement != "ok":
        raise RuntimeError(f"building the base input failed: {target}: {verdict.result.get('stderr', '')[-2000:]}")


def _write_index(ckpt: Path) -> None:
    """A one-shard model.safetensors.index.json, as multi-shard checkpoints ship (the loader reads it
    when present), so its paths are a surface."""
    data = (ckpt / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    names = sorted(k for k in json.loads(data[8 : 8 + n]) if k != "__metadata__")
    index = {"metadata": {"total_size": len(data) - 8 - n}, "weight_map": {k: "model.safetensors" for k in names}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def copy_case(base: Path, case_dir: Path, entries: tuple[str, ...]) -> None:
    case_dir.mkdir(parents=True)
    for entry in entries:
        src = base / entry
        if src.is_dir():
            shutil.copytree(src, case_dir / entry)
        else:
            shutil.copy2(src, case_dir / entry)
