"""Budgets and flags -> StoreConfig: human sizes, percentages of the model's routed-expert bytes,
`auto`, TOML budget files, and the store options a command's flags give (``StoreOptions``).

A budget file holds these keys and no others (``BUDGET_KEYS``); a key it leaves out keeps ``Budget``'s
default, and those of the store settings are ``StoreConfig``'s (storage/tiers/tiered.py), stated once:

    [memory]  ram = "8GiB" | "25%" | "auto"    vram = 0 | "12GiB" | "50%"
    [io]      direct = true | false             threads = N (1..MAX_IO_THREADS, storage.tiers.tiered)
    [cache]   policy = "frequent" | "lru" | "hybrid" | "pinned"    prefetch = true | false    prefetch_layers = N (>= 1)
              preload = true | false    history = "usage.json"
    [prefix]  ram = "512MiB"    disk = "8GiB"    enabled = true | false   (the shared prefix cache)
    [kv]      context = N (positions the KV cache and activations are sized for; default and at most
              the model's max_position_embeddings; a longer prompt is refused)

Any other table or key (a misspelling, or a setting a budget does not hold: the session directory and
record dtype are --kv-dir and --kv-dtype) is refused. Errors are one line naming the file and the key.

``auto`` sizes the RAM tier from what is available (MemAvailable, or the headroom of the memory cgroup the
process runs in where that is lower: planning/machine_memory.py), leaving room for the
dense weights, the KV cache at the planned context (--context, else [kv] context, else the model's
max_position_embeddings) and a safety margin (shaved only down to the store's floor). A budget file's
RAM size is capped at that same figure: a file written for a bigger machine still runs here. When even
the floor does not fit, ``placement.check_fits`` refuses with RAM available, dense, KV and floor.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil
import torch

from colibri_stream.errors import BudgetError
from colibri_stream.planning.geometry import ModelGeometry
from colibri_stream.planning.machine_memory import memory_here
from colibri_stream.planning.placement import RUNTIME_BASELINE_BYTES, floor_bytes, plan
from engine.config.args import ModelArgs
from storage.errors import FormatError
from storage.files.safe_read import decode_utf8, read_bounded
from storage.kv.prefix_store import PrefixConfig
from storage.tiers.policy import POLICY_NAMES
from storage.tiers.tiered import MAX_IO_THREADS, StoreConfig

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
SAFETY_MARGIN = 0.10
MAX_BUDGET_FILE_BYTES = 1 << 20  # a budget is a dozen keys; anything near this size is not one
T = TypeVar("T")


def parse_size(value: str | int, expert_bytes: int, key: str = "size", auto_bytes: int | None = None) -> int:
    """Bytes from 123, "8GiB", "512MB", "25%" (of expert_bytes) or "auto" (needs auto_bytes)."""
    if isinstance(value, bool):
        raise BudgetError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if text == "auto":
        if auto_bytes is None:
            raise BudgetError(f"{key}: 'auto' is not available here")
        return auto_bytes
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise BudgetError(f"{key}: bad percentage {value!r}") from None
        if not (math.isfinite(percent) and percent >= 0):  # float() also reads "inf", "nan", "-5"
            raise BudgetError(f"{key}: bad percentage {value!r} (a finite number >= 0, e.g. 25%)")
        return int(expert_bytes * percent / 100)
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise BudgetError(f"{key}: bad size {value!r} (use e.g. 8GiB, 512MB, 25%, auto)")
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(size):  # 400 digits read as a float are inf
        raise BudgetError(f"{key}: size {value!r} is too large")
    return int(size)


def auto_ram_bytes(
    dense_bytes: int,
    kv_bytes: int,
    floor: int = 0,
    available: int | None = None,
    activation_bytes: int = 0,
    runtime_bytes: int | None = None,
) -> int:
    """RAM for expert slots: available memory (``memory_here()`` unless given) minus dense weights, KV, the
    prefill activations and the runtime's own memory this process has yet to take (``runtime_to_come()``
    unless given), less a safety margin; the margin never takes it below ``floor`` bytes when those fit
    (when they do not, the plan refuses). So the plan's expected peak RSS (the runtime baseline, those parts
    and the slots) stays within what this process can reach: its RSS now plus what is available."""
    available = memory_here().available_bytes if available is None else available
    runtime_bytes = runtime_to_come() if runtime_bytes is None else runtime_bytes
    left = available - dense_bytes - kv_bytes - activation_bytes - runtime_bytes
    return max(0, int(left * (1 - SAFETY_MARGIN)), min(floor, left))


def runtime_to_come() -> int:
    """The part of the runtime baseline (placement.RUNTIME_BASELINE_BYTES: torch, code pages, pools after a
    first step) this process has not taken yet: `plan` runs before torch has run anything, and in a tight
    memory group the difference is more than the safety margin leaves (2.62 GiB planned in 2.57)."""
    return max(0, RUNTIME_BASELINE_BYTES - psutil.Process().memory_info().rss)


_STORE = StoreConfig(ram_bytes=0)  # the store's defaults: a budget's store settings start from them
_PREFIX = PrefixConfig()  # the prefix cache's defaults


@dataclass(frozen=True)
class Budget:
    """What a budget file sets (``source``), or no file: these defaults."""

    ram: str | int = "100%"  # [memory] ram: RAM for expert slots: a size, a % of the expert bytes, or auto
    vram: str | int = _STORE.vram_bytes  # [memory] vram: VRAM for expert slots (a size or a %)
    direct: bool = _STORE.direct  # [io] direct: O_DIRECT reads where the filesystem allows
    threads: int = _STORE.threads  # [io] threads: disk reader threads
    policy: str = _STORE.policy  # [cache] policy: eviction policy
    prefetch: bool = _STORE.prefetch  # [cache] prefetch: read the router's guesses ahead
    prefetch_layers: int = _STORE.prefetch_layers  # [cache] prefetch_layers: MoE layers guessed ahead
    preload: bool = _STORE.preload  # [cache] preload: read every expert at load when RAM holds them all
    history: str | None = None  # [cache] history: usage-history file (learned hot store)
    context: int | None = None  # [kv] context: positions KV and activations are sized for (None: the model's)
    prefix_ram: str | int = _PREFIX.ram_bytes  # [prefix] ram: RAM for the prefix cache's recent blocks
    prefix_disk: str | int = _PREFIX.disk_bytes  # [prefix] disk: the prefix cache's blocks in the KV directory
    prefix_enabled: bool = _PREFIX.enabled  # [prefix] enabled: restore prompts' cached prefixes
    source: str = "defaults"  # the budget file these came from


# Every key a budget file may hold: "table.key" -> (Budget field, TOML types accepted).
BUDGET_KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    # first: a bare "ram" misplaced in another table is then hinted as memory.ram (listed later)
    "prefix.ram": ("prefix_ram", (str, int)),
    "prefix.disk": ("prefix_disk", (str, int)),
    "prefix.enabled": ("prefix_enabled", (bool,)),
    "memory.ram": ("ram", (str, int)),
    "memory.vram": ("vram", (str, int)),
    "io.direct": ("direct", (bool,)),
    "io.threads": ("threads", (int,)),
    "cache.policy": ("policy", (str,)),
    "cache.prefetch": ("prefetch", (bool,)),
    "cache.prefetch_layers": ("prefetch_layers", (int,)),
    "cache.preload": ("preload", (bool,)),
    "cache.history": ("history", (str,)),
    "kv.context": ("context", (int,)),
}
TABLES = sorted({key.split(".")[0] for key in BUDGET_KEYS})
# Settings that are not a budget's: refused with where they are set, rather than read by nothing.
_SET_ELSEWHERE = {"kv.dir": "--kv-dir", "kv.dtype": "--kv-dtype"}


def load_budget_file(path: str | Path) -> Budget:
    path = Path(path)
    data = _read_toml(path)
    values: dict[str, Any] = {}
    for table, content in data.items():
        if not isinstance(content, dict):
            raise BudgetError(f"{path}: key {table} is outside a table{_closest(table, _BY_KEY)}")
        for key, value in content.items():
            name = f"{table}.{key}"
            field_name, types = _known_key(path, name)
            if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
                raise BudgetError(f"{path}: {name} must be {' or '.join(t.__name__ for t in types)}")
            values[field_name] = value
    budget = Budget(**values, source=str(path))
    _check_values(budget, path)
    return budget


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = decode_utf8(read_bounded(path, MAX_BUDGET_FILE_BYTES, "budget file"), path, "budget file")
        return tomllib.loads(text)
    except FileNotFoundError:
        raise BudgetError(f"{path}: budget file not found") from None
    except FormatError as exc:  # a directory, FIFO or device; too large; not UTF-8
        raise BudgetError(str(exc)) from None
    except tomllib.TOMLDecodeError as exc:
        raise BudgetError(f"{path}: not valid TOML ({exc})") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise BudgetError(f"{path}: not valid TOML (arrays or tables nested too deeply)") from None


def _known_key(path: Path, name: str) -> tuple[str, tuple[type, ...]]:
    """The Budget field and types of ``table.key``; anything else is a BudgetError naming it, with the
    valid key closest to it."""
    if name in BUDGET_KEYS:
        return BUDGET_KEYS[name]
    if name in _SET_ELSEWHERE:
        raise BudgetError(f"{path}: {name} is not a budget setting; use {_SET_ELSEWHERE[name]}")
    table, key = name.split(".", 1)
    if table not in TABLES:
        hint = _closest(name, {k: k for k in BUDGET_KEYS}) or _closest(key, _BY_KEY)
        known = ", ".join(f"[{t}]" for t in TABLES)
        raise BudgetError(f"{path}: unknown table [{table}] in {name}{hint or f' (a budget file has {known})'}")
    same_table = {k.split(".", 1)[1]: k for k in BUDGET_KEYS if k.startswith(f"{table}.")}
    hint = _closest(key, same_table) or _closest(key, _BY_KEY)  # misspelt, or in the wrong table
    known = ", ".join(same_table.values())
    raise BudgetError(f"{path}: unknown key {name}{hint or f' (known: {known})'}")


_BY_KEY = {full.split(".", 1)[1]: full for full in BUDGET_KEYS}  # "ram" -> "memory.ram"


def _closest(word: str, choices: dict[str, str]) -> str:
    """' (did you mean memory.ram?)' for the choice whose name is closest to ``word``; '' when none is."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {choices[close[0]]}?)" if close else ""


def _check_values(budget: Budget, path: Path) -> None:
    """Values a type does not rule out, refused when the file is read: each error names file and key."""
    if not 1 <= budget.threads <= MAX_IO_THREADS:
        raise BudgetError(f"{path}: io.threads must be 1..{MAX_IO_THREADS}, got {budget.threads}")
    if budget.context is not None and budget.context < 1:
        raise BudgetError(f"{path}: kv.context must be >= 1 (positions), got {budget.context}")
    if budget.prefetch_layers < 1:
        raise BudgetError(f"{path}: cache.prefetch_layers must be >= 1 (MoE layers guessed ahead)")
    if budget.policy not in POLICY_NAMES:
        raise BudgetError(f"{path}: cache.policy must be one of {', '.join(POLICY_NAMES)}, got {budget.policy!r}")
    parse_size(budget.ram, 0, f"{path}: memory.ram", auto_bytes=0)  # the form only: % and auto need the model
    parse_size(budget.vram, 0, f"{path}: memory.vram")
    for key, value in (("prefix.ram", budget.prefix_ram), ("prefix.disk", budget.prefix_disk)):
        prefix_size(value, f"{path}: {key}")


def prefix_size(value: str | int, key: str) -> int:
    """A prefix-cache budget: a size (0 turns the tier off); a percentage or auto has nothing to be of."""
    if isinstance(value, str) and value.strip().endswith("%") or str(value).strip() == "auto":
        raise BudgetError(f"{key}: expected a size such as 512MiB or 0, got {value!r}")
    return parse_size(value, 0, key)


def prefix_config(
    budget_path: str | Path | None, ram: str | None = None, disk: str | None = None, enabled: bool | None = None
) -> PrefixConfig:
    """The prefix cache's sizes: flags over the budget file's [prefix] table over PrefixConfig's defaults."""
    budget = load_budget_file(budget_path) if budget_path else Budget()
    return PrefixConfig(
        ram_bytes=prefix_size(budget.prefix_ram if ram is None else ram, "prefix ram"),
        disk_bytes=prefix_size(budget.prefix_disk if disk is None else disk, "prefix disk"),
        enabled=budget.prefix_enabled if enabled is None else enabled,
    )


@dataclass(frozen=True)
class StoreOptions:
    """What a command's flags ask of the expert store; None defers to the budget file, then defaults.
    Containers only: an HF directory is loaded resident."""

    budget: str | Path | None = None  # TOML budget file
    ram: str | None = None  # "8GiB", "25%", "auto"
    vram: str | None = None
    vram_device: str | None = None  # default cuda where available, else cpu standing in
    policy: str | None = None
    prefetch: bool | None = None  # --prefetch / --no-prefetch
    direct: bool | None = None  # True --direct, False --buffered, None: the budget file
    io_threads: int | None = None
    prefetch_layers: int | None = None  # MoE layers guessed ahead (--prefetch-layers)
    preload: bool | None = None  # --preload / --no-preload
    history: str | Path | None = None  # usage-history file, updated after every turn
    trace: str | Path | None = None  # routing trace, one JSON line per acquire
    kv_sequences: int = 1  # KV caches held at once, each counted at the full context (serve: 2 x slots)
    context: int | None = None  # --context: positions KV and activations are sized for (planned_context)
    beside_store_bytes: int = 0  # RAM the run holds beside the plan's parts: the prefix cache's RAM tier


def planned_context(options: StoreOptions, args: ModelArgs) -> int:
    """The context a run is sized and checked for: --context over the budget file's [kv] context over the
    model's max_position_embeddings, refused beyond it (positions the model was never trained on)."""
    budget = load_budget_file(options.budget) if options.budget and options.context is None else Budget()
    context = options.context if options.context is not None else budget.context
    if context is None:
        return args.max_position_embeddings
    where = "--context" if options.context is not None else f"{budget.source}: kv.context"
    if context < 1:
        raise BudgetError(f"{where} must be >= 1 (positions), got {context}")
    if context > args.max_position_embeddings:
        raise BudgetError(
            f"{where} {context} is longer than this model's context: max_position_embeddings is "
            f"{args.max_position_embeddings}"
        )
    return context


def store_config(
    options: StoreOptions, geometry: ModelGeometry, dtype: str = "float32", int8_activations: bool = False
) -> StoreConfig:
    """The store's configuration: flags over the budget file over defaults; `auto` RAM from what is
    available after the dense weights, the KV cache and the prefill activations at the planned context
    (``planned_context``) and what the run holds beside them (the prefix cache's RAM); a budget file's
    RAM at most that. ``int8_activations``: the dense part as the loader then holds it (placement.plan)."""
    budget = load_budget_file(options.budget) if options.budget else Budget()
    expert_bytes = geometry.expert_bytes
    context = planned_context(options, geometry.args)
    empty = StoreConfig(ram_bytes=0)
    sequences, int8 = options.kv_sequences, int8_activations
    provisional = plan(geometry, empty, dtype, sequences=sequences, context=context, int8_activations=int8)
    auto = auto_ram_bytes(
        provisional.dense_bytes,
        provisional.kv_bytes_at_max_context,
        floor_bytes(provisional),
        activation_bytes=provisional.activation_bytes + options.beside_store_bytes,
    )
    return _store_config(options, budget, _ram_bytes(options, budget, expert_bytes, auto), expert_bytes)


def worker_store_config(options: StoreOptions, expert_bytes: int) -> StoreConfig:
    """The store of a worker process (colibri_stream/cluster): no dense part, no KV cache, so `auto` RAM
    is what is available less the safety margin."""
    budget = load_budget_file(options.budget) if options.budget else Budget()
    ram = _ram_bytes(options, budget, expert_bytes, auto_ram_bytes(0, 0))
    return _store_config(options, budget, ram, expert_bytes)


def _ram_bytes(options: StoreOptions, budget: Budget, expert_bytes: int, auto: int) -> int:
    if options.ram is not None:
        return parse_size(options.ram, expert_bytes, "--ram", auto_bytes=auto)
    ram = parse_size(budget.ram, expert_bytes, _key(None, "ram", budget), auto_bytes=auto)
    if options.budget:  # written for some machine: no more than this one has available
        ram = min(ram, auto)
    return ram


def _store_config(options: StoreOptions, budget: Budget, ram: int, expert_bytes: int) -> StoreConfig:
    vram = parse_size(_chosen(options.vram, budget.vram), expert_bytes, _key(options.vram, "vram", budget))
    history = _chosen(options.history, budget.history)
    return StoreConfig(
        ram_bytes=ram,
        vram_bytes=vram,
        vram_device=options.vram_device or ("cuda" if torch.cuda.is_available() else "cpu"),
        policy=_chosen(options.policy, budget.policy),
        prefetch=_chosen(options.prefetch, budget.prefetch),
        direct=_chosen(options.direct, budget.direct),
        threads=_chosen(options.io_threads, budget.threads),
        prefetch_layers=_chosen(options.prefetch_layers, budget.prefetch_layers),
        preload=_chosen(options.preload, budget.preload),
        history_path=Path(history) if history else None,
    )


def _chosen(flag: T | None, budget_value: T) -> T:
    """A flag that was given wins over the budget (its file, else its defaults)."""
    return budget_value if flag is None else flag


def _key(flag: object, name: str, budget: Budget) -> str:
    """What a size error names: the flag, or the budget file's key."""
    return f"--{name}" if flag is not None else f"{budget.source}: memory.{name}"
