"""Budgets and flags -> StoreConfig: human sizes, percentages of the model's routed-expert bytes,
`auto`, TOML budget files, and the store options a command's flags give (``StoreOptions``).

    [memory]            ram = "8GiB" | "25%" | "auto"    vram = "0" | "12GiB" | "50%"
    [io]                direct = true     threads = 4
    [cache]             policy = "lru" | "hybrid" | "pinned"    prefetch = true    history = "path.json"

Errors name the file and the key. ``auto`` sizes the RAM tier from what psutil says is available
(MemAvailable), leaving room for the dense weights, the KV cache at full context and a safety margin
(shaved only down to the store's floor). A budget file's RAM size is capped at that same figure: a file
written for a bigger machine still runs here. When even the floor does not fit, ``placement.check_fits``
refuses with RAM available, dense, KV and floor.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from colibri_stream.errors import BudgetError
from colibri_stream.planning.geometry import ModelGeometry
from colibri_stream.planning.placement import floor_bytes, plan
from storage.errors import FormatError
from storage.policy import POLICY_NAMES
from storage.safe_read import decode_utf8, read_bounded
from storage.tiered import StoreConfig

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
    dense_bytes: int, kv_bytes: int, floor: int = 0, available: int | None = None, activation_bytes: int = 0
) -> int:
    """RAM for expert slots: available memory (MemAvailable unless given) minus dense weights, KV and the
    prefill activations, less a safety margin; the margin never takes it below ``floor`` bytes when those
    fit (when they do not, the plan refuses)."""
    available = psutil.virtual_memory().available if available is None else available
    left = available - dense_bytes - kv_bytes - activation_bytes
    return max(0, int(left * (1 - SAFETY_MARGIN)), min(floor, left))


@dataclass(frozen=True)
class Budget:
    ram: str | int = "100%"
    vram: str | int = 0
    direct: bool = True
    threads: int = 4
    policy: str = "lru"
    prefetch: bool = True
    lookahead: int = 2
    preload: bool = True
    history: str | None = None
    source: str = "defaults"
    extra: dict[str, Any] = field(default_factory=dict)


_SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    "memory": {"ram": (str, int), "vram": (str, int), "limit": (str, int)},
    "io": {"direct": (bool,), "threads": (int,)},
    "cache": {"policy": (str,), "prefetch": (bool,), "lookahead": (int,), "preload": (bool,), "history": (str,)},
    "kv": {"dir": (str,), "dtype": (str,)},
}


def load_budget_file(path: str | Path) -> Budget:
    path = Path(path)
    try:
        text = decode_utf8(read_bounded(path, MAX_BUDGET_FILE_BYTES, "budget file"), path, "budget file")
        data = tomllib.loads(text)
    except FileNotFoundError:
        raise BudgetError(f"{path}: budget file not found") from None
    except FormatError as exc:  # a directory, FIFO or device; too large; not UTF-8
        raise BudgetError(str(exc)) from None
    except tomllib.TOMLDecodeError as exc:
        raise BudgetError(f"{path}: not valid TOML ({exc})") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise BudgetError(f"{path}: not valid TOML (arrays or tables nested too deeply)") from None
    values: dict[str, Any] = {}
    for section, content in data.items():
        if section not in _SCHEMA or not isinstance(content, dict):
            raise BudgetError(f"{path}: unknown section [{section}] (known: {sorted(_SCHEMA)})")
        for key, value in content.items():
            types = _SCHEMA[section].get(key)
            if types is None:
                raise BudgetError(f"{path}: unknown key {section}.{key} (known: {sorted(_SCHEMA[section])})")
            if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
                raise BudgetError(f"{path}: {section}.{key} must be {' or '.join(t.__name__ for t in types)}")
            values[f"{section}.{key}"] = value
    if values.get("io.threads", 1) < 1:
        raise BudgetError(f"{path}: io.threads must be >= 1")
    if values.get("cache.lookahead", 1) < 1:
        raise BudgetError(f"{path}: cache.lookahead must be >= 1 (MoE layers guessed ahead)")
    policy = values.get("cache.policy", "lru")
    if policy not in POLICY_NAMES:
        raise BudgetError(f"{path}: cache.policy must be one of {', '.join(POLICY_NAMES)}, got {policy!r}")
    return Budget(
        ram=values.get("memory.ram", "100%"),
        vram=values.get("memory.vram", 0),
        direct=values.get("io.direct", True),
        threads=values.get("io.threads", 4),
        policy=policy,
        prefetch=values.get("cache.prefetch", True),
        lookahead=values.get("cache.lookahead", 2),
        preload=values.get("cache.preload", True),
        history=values.get("cache.history"),
        source=str(path),
        extra={k: v for k, v in values.items() if k.startswith(("kv.", "memory.limit"))},
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
    prefetch: bool = True  # False: --no-prefetch (wins over the budget file)
    direct: bool | None = None  # True --direct, False --buffered, None: the budget file
    io_threads: int | None = None
    lookahead: int | None = None  # MoE layers guessed ahead (--lookahead)
    preload: bool = True  # False: --no-preload (wins over the budget file)
    history: str | Path | None = None  # usage-history file, updated after every turn
    trace: str | Path | None = None  # routing trace, one JSON line per acquire
    kv_sequences: int = 1  # KV caches held at once, each counted at the full context (serve: 2 x slots)


def store_config(options: StoreOptions, geometry: ModelGeometry, dtype: str = "float32") -> StoreConfig:
    """The store's configuration: flags over the budget file over defaults; `auto` RAM from what is
    available after the dense weights, the KV cache and the prefill activations at full context; a budget
    file's RAM at most that."""
    budget = load_budget_file(options.budget) if options.budget else Budget()
    expert_bytes = geometry.expert_bytes
    provisional = plan(geometry, StoreConfig(ram_bytes=0), dtype, sequences=options.kv_sequences)
    auto = auto_ram_bytes(
        provisional.dense_bytes,
        provisional.kv_bytes_at_max_context,
        floor_bytes(provisional),
        activation_bytes=provisional.activation_bytes,
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
    ram = parse_size(budget.ram, expert_bytes, "memory.ram", auto_bytes=auto)
    if options.budget:  # written for some machine: no more than this one has available
        ram = min(ram, auto)
    return ram


def _store_config(options: StoreOptions, budget: Budget, ram: int, expert_bytes: int) -> StoreConfig:
    vram = parse_size(options.vram if options.vram is not None else budget.vram, expert_bytes, "vram")
    history = options.history if options.history is not None else budget.history
    return StoreConfig(
        ram_bytes=ram,
        vram_bytes=vram,
        vram_device=options.vram_device or ("cuda" if torch.cuda.is_available() else "cpu"),
        policy=options.policy or budget.policy,
        prefetch=budget.prefetch and options.prefetch,
        direct=budget.direct if options.direct is None else options.direct,
        threads=options.io_threads or budget.threads,
        lookahead_layers=options.lookahead or budget.lookahead,
        preload=budget.preload and options.preload,
        history_path=Path(history) if history else None,
    )
