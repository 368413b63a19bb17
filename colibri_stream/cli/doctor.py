"""`colibri-stream doctor`: read-only checks of this machine (and optionally a model) with a verdict.

Nothing is written and no model is loaded: each check reads metadata or probes the system, so the
command is safe on a machine that could not run the model at all — which is when it is most useful.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from colibri_stream.cli.help import help_options
from colibri_stream.cli.options import add_dtype_argument, add_store_arguments, store_options
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.planning.machine_memory import memory_here
from engine.kernels.isa import kernel_isa
from storage.files.buffers import PAGE
from storage.files.io_features import feature_states
from storage.files.page_cache import Bypass, bypass_refusal, platform_bypass

EPILOG = """\
examples:
  colibri-stream doctor                                   # this machine only
  colibri-stream doctor MODEL.cstream --budget budgets/laptop-32g.toml
  colibri-stream doctor MODEL.cstream --full --json       # also every expert checksum
  colibri-stream doctor config.json --ram auto            # before the download: `plan`'s verdict only

each line: ok / warn / FAIL, the check, what was found; the last line is the verdict. The budget check
carries `colibri-stream plan`'s verdict line (fits / fits with N% of experts cached / does not fit);
without --ram or --budget it plans `--ram auto`, as plan does.
exit status: 0 when nothing failed (warnings allowed), 1 when a check failed, 2 on bad flags."""

OK, WARN, FAIL = "ok", "warn", "FAIL"
GIB = 2**30


@dataclass(frozen=True)
class Check:
    status: str
    name: str
    detail: str


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "doctor",
        help="check this machine (and a model) before running: versions, memory, disk, container, budget",
        description="Read-only checks: Python, torch, CUDA, free RAM and disk; with PATH also `plan`'s verdict, "
        "the container structure (every checksum with --full) and whether reads of the model bypass the page cache.",
        **help_options(EPILOG),
    )
    parser.add_argument(
        "path", nargs="?", help="a converted container, a Hugging Face checkpoint directory or a config.json"
    )
    parser.add_argument("--full", action="store_true", help="verify every expert checksum (reads the whole model)")
    add_dtype_argument(parser, default="bfloat16")
    parser.add_argument("--json", action="store_true", help="print the checks and verdict as one JSON object")
    add_store_arguments(parser)
    parser.set_defaults(handler=run_doctor)


def _gib(n: float) -> str:
    """Human size: GiB for model-scale numbers, MiB below one GiB (small models, tests)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def machine_checks() -> Iterator[Check]:
    version = platform.python_version()
    yield Check(OK if sys.version_info >= (3, 11) else FAIL, "python", f"{version} ({sys.executable})")
    import torch

    yield Check(OK, "torch", f"{torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    yield Check(OK, "kernels", kernel_isa())
    if torch.cuda.is_available():
        names = [
            f"{torch.cuda.get_device_name(i)} {_gib(torch.cuda.get_device_properties(i).total_memory)}"
            for i in range(torch.cuda.device_count())
        ]
        yield Check(OK, "cuda", "; ".join(names))
    else:
        yield Check(OK, "cuda", "not available: CPU only (no VRAM tier)")
    memory = memory_here()
    status = OK if memory.available_bytes >= 4 * GIB else WARN
    limited = "" if memory.cap is None else f" (memory cgroup limit, {memory.cap.source})"
    yield Check(status, "ram", f"{_gib(memory.available_bytes)} available of {_gib(memory.total_bytes)}{limited}")
    yield io_check()


def io_check() -> Check:
    """The platform features the I/O and memory code uses here (storage/files/io_features.py); a misspelt
    COLIBRI_STREAM_IO_FEATURES is a SettingError, which the command prints as one line."""
    states = feature_states()
    words = ", ".join(f"{feature} {state}" for feature, state in states.items())
    bypass = platform_bypass()
    how = "no page-cache bypass" if bypass is Bypass.NONE else f"page cache bypassed with {bypass.flag}"
    return Check(OK if bypass is not Bypass.NONE else WARN, "io", f"{how}; {words}")


def disk_check(name: str, path: Path) -> Check:
    existing = next(p for p in (path, *path.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    return Check(OK if free >= 10 * GIB else WARN, name, f"{_gib(free)} free on the filesystem of {existing}")


def page_cache_check(path: Path) -> Check:
    """One read past the page cache of a model file, as the store reads experts by default (--direct)."""
    files = [p for p in sorted(path.rglob("*")) if p.is_file() and p.stat().st_size >= PAGE]
    if not files:
        return Check(WARN, "page cache", f"no file of 4 KiB or more under {path} to probe")
    refusal = bypass_refusal(files[0])
    if refusal is not None:
        return Check(WARN, "page cache", f"{refusal}: experts will be read through the page cache")
    flag = platform_bypass().flag
    return Check(OK, "page cache", f"bypassed: experts are read with {flag} (the default; --buffered to opt out)")


def plan_check(path: Path, store: StoreOptions, dtype: str) -> Check:
    """`plan`'s verdict line, as a check: a container as it is, a checkpoint or config.json as converted."""
    from colibri_stream.planning.budget import store_plan
    from colibri_stream.planning.geometry import model_geometry
    from colibri_stream.planning.placement import verdict

    geometry = model_geometry(path)
    placement = store_plan(store.with_ram("auto"), geometry, dtype)[1]
    result = verdict(placement)
    if not result.fits:
        return Check(FAIL, "budget", result.line)
    summary = (
        f"{result.line}: dense {_gib(placement.dense_bytes)} + {placement.ram_slots} expert slots "
        f"({_gib(placement.ram_slots * placement.expert_record_bytes)}) + KV {_gib(placement.kv_bytes_at_max_context)}"
        f" at {placement.max_context} tokens: peak ~{_gib(placement.expected_peak_rss_bytes)}"
    )
    fits = placement.expected_peak_rss_bytes <= placement.available_ram_bytes
    return Check(OK if fits else WARN, "budget", summary + ("" if fits else " > available RAM now"))


def container_checks(path: Path, full: bool) -> Iterator[Check]:
    from storage.container.reader import Container
    from storage.container.verify import verify_container

    container = Container(path)
    if full:
        problems = verify_container(path)
        detail = f"{len(problems)} problems" + (f"; first: {problems[0]}" if problems else ", every checksum valid")
        yield Check(FAIL if problems else OK, "container", detail)
    else:
        for layer in container.moe_layers:
            container.check_expert_metadata(layer)
        detail = f"{len(container.moe_layers)} MoE layers x {container.n_experts} experts, structure sound"
        yield Check(OK, "container", detail + " (--full checks every checksum)")


def checkpoint_checks(path: Path) -> Iterator[Check]:
    from colibri_stream.checkpoint.files import shard_files
    from colibri_stream.runtime.loader import read_config
    from engine.config.args import ModelArgs

    model_args = ModelArgs.from_hf_config(read_config(path))
    size = sum(f.stat().st_size for f in shard_files(path))
    yield Check(OK, "checkpoint", f"{model_args.n_layers} layers, {_gib(size)} of safetensors (loaded resident)")
    available = memory_here().available_bytes
    status = OK if size <= available else FAIL
    advice = "" if status == OK else ": convert it and stream the experts (the budget check says how it would fit)"
    yield Check(status, "resident", f"{_gib(size)} resident vs {_gib(available)} available{advice}")


def model_checks(path: Path, full: bool, store: StoreOptions, dtype: str) -> Iterator[Check]:
    from colibri_stream.checkpoint.fingerprint import model_fingerprint
    from colibri_stream.runtime.kv.sessions import default_kv_dir
    from colibri_stream.text.chat_format import load_chat_format
    from storage.container.reader import is_container

    if not path.exists():
        yield Check(FAIL, "model", f"{path}: not a directory or a config.json")
        return
    yield from _guarded("budget", lambda: [plan_check(path, store, dtype)])
    if path.is_file():
        return  # a bare config.json: the plan is all there is to check
    if is_container(path):
        yield from _guarded("model", lambda: container_checks(path, full))
    else:
        yield from _guarded("model", lambda: checkpoint_checks(path))
    tokenizer = (path / "tokenizer.json").is_file()
    yield Check(
        OK if tokenizer else WARN,
        "tokenizer",
        "tokenizer.json found" if tokenizer else "no tokenizer.json: only --ids prompts work",
    )
    yield from _guarded("chat template", lambda: [_template_check(load_chat_format(path))])
    yield disk_check("model disk", path)
    yield disk_check("kv disk", default_kv_dir(model_fingerprint(path)))
    yield page_cache_check(path)


def _template_check(chat) -> Check:
    if chat.is_fallback:
        return Check(WARN, "chat template", "none in the model: chat/serve use the built-in fallback template")
    chat.render([{"role": "user", "content": "ping"}])
    return Check(OK, "chat template", f"renders in the sandbox; stop ids {list(chat.stop_ids)}")


def _guarded(name: str, make: Callable[[], Iterator[Check] | list[Check]]) -> Iterator[Check]:
    """A check that raises is a failed check with its message, not a crashed doctor."""
    try:
        yield from list(make())
    except Exception as exc:
        yield Check(FAIL, name, f"{type(exc).__name__}: {exc}")


def verdict(checks: list[Check]) -> str:
    failed = [c for c in checks if c.status == FAIL]
    warned = [c for c in checks if c.status == WARN]
    if failed:
        return f"verdict: NOT READY: {failed[0].name}: {failed[0].detail}"
    if warned:
        return f"verdict: ready, with {len(warned)} warning(s): {', '.join(c.name for c in warned)}"
    return "verdict: ready"


def run_doctor(args: argparse.Namespace) -> int:
    checks = list(machine_checks())
    checks.append(disk_check("disk", Path.cwd()))
    if args.path:
        checks += list(model_checks(Path(args.path), args.full, store_options(args), args.dtype))
    line = verdict(checks)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "verdict": line}))
    else:
        for c in checks:
            print(f"{c.status:<5} {c.name:<14} {c.detail}")
        print(line)
    return 1 if any(c.status == FAIL for c in checks) else 0
