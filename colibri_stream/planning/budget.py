"""Settings -> configs: what a command's flags and budget file ask of the store (``StoreOptions``, its
budget file read once where the command starts), turned into storage's StoreConfig and PrefixConfig and
the context a run is planned for. The settings themselves, their keys, flags, defaults and ranges, are
the table in planning/settings.py (docs/planning.md shows it); a flag given wins over the budget file,
which wins over the default.

``auto`` sizes the RAM tier from what is available (MemAvailable, or the headroom of the memory cgroup the
process runs in where that is lower: planning/machine_memory.py), leaving room for the
dense weights, the KV cache at the planned context (--context, else [kv] context, else the model's
max_position_embeddings) and a safety margin (shaved only down to the store's floor). A budget file's
RAM size is capped at that same figure: a file written for a bigger machine still runs here. When even
the floor does not fit, ``placement.check_fits`` refuses with RAM available, dense, KV and floor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import psutil

from colibri_stream.errors import BudgetError
from colibri_stream.planning.geometry import ModelGeometry
from colibri_stream.planning.machine_memory import memory_here
from colibri_stream.planning.placement import RUNTIME_BASELINE_BYTES, Placement, floor_bytes, plan, with_store
from colibri_stream.planning.settings import BUDGET_KEYS as BUDGET_KEYS  # callers' old home of these four
from colibri_stream.planning.settings import BY_NAME, Setting, Value, owned_values, prefix_size
from colibri_stream.planning.settings import Budget as Budget
from colibri_stream.planning.settings import load_budget_file as load_budget_file
from colibri_stream.planning.settings import parse_size as parse_size
from engine.config.args import ModelArgs
from storage.kv.prefix_store import PrefixConfig
from storage.tiers.config import StoreConfig

SAFETY_MARGIN = 0.10


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


@dataclass(frozen=True, init=False)
class StoreOptions:
    """What a command asks of the expert store and the prefix cache: the settings given (flags, or a
    caller's keywords: ``StoreOptions(ram="25%", preload=False)``, named as in planning/settings.py) over
    its budget file over the defaults. A budget file path is read and checked here, once: code that
    derives options from these (``dataclasses.replace``) passes the Budget on, never the path.
    Containers only: an HF directory is loaded resident."""

    budget: Budget  # the budget file as read (Budget(): none)
    given: Mapping[str, Value]  # setting name -> value given; a setting absent here is the budget's
    trace: str | Path | None  # routing trace, one JSON line per acquire
    kv_sequences: int  # KV caches held at once, each counted at the full context (serve: 2 x slots)
    beside_store_bytes: int  # RAM the run holds beside the plan's parts: the prefix cache's RAM tier

    def __init__(
        self,
        budget: Budget | str | Path | None = None,
        given: Mapping[str, Value] | None = None,
        trace: str | Path | None = None,
        kv_sequences: int = 1,
        beside_store_bytes: int = 0,
        **settings: Value,
    ) -> None:
        unknown = sorted(set(settings) - set(BY_NAME))
        if unknown:
            raise TypeError(f"StoreOptions: no setting named {', '.join(unknown)} (planning/settings.py)")
        merged = {name: v for name, v in {**(given or {}), **settings}.items() if v is not None}
        read = budget if isinstance(budget, Budget) else load_budget_file(budget) if budget else Budget()
        set_ = object.__setattr__  # frozen: set once, here
        set_(self, "budget", read)
        set_(self, "given", MappingProxyType(merged))
        set_(self, "trace", trace)
        set_(self, "kv_sequences", kv_sequences)
        set_(self, "beside_store_bytes", beside_store_bytes)

    def __getitem__(self, name: str) -> Value:
        """The setting's value for this run: given, else the budget file's, else the default."""
        return self.given[name] if name in self.given else self.budget[name]

    def origin(self, name: str) -> str:
        """Where ``name``'s value comes from, as an error names it: the flag, or the budget file's key."""
        setting = BY_NAME[name]
        return setting.flag if name in self.given else f"{self.budget.source}: {setting.key}"

    def with_ram(self, ram: str) -> StoreOptions:
        """``ram`` where neither a flag nor a budget file sizes the RAM tier (plan, pull, doctor: auto)."""
        if "ram" in self.given or self.budget.path is not None:
            return self
        given = {**self.given, "ram": ram}
        return StoreOptions(self.budget, given, self.trace, self.kv_sequences, self.beside_store_bytes)


def planned_context(options: StoreOptions, args: ModelArgs) -> int:
    """The context a run is sized and checked for: --context over the budget file's [kv] context over the
    model's max_position_embeddings, refused beyond it (positions the model was never trained on)."""
    context = options["context"]
    if context is None:
        return args.max_position_embeddings
    where = options.origin("context")
    assert isinstance(context, int)  # a COUNT setting, checked as one where it was given
    BY_NAME["context"].check(context, where)
    if context > args.max_position_embeddings:
        raise BudgetError(
            f"{where} {context} is longer than this model's context: max_position_embeddings is "
            f"{args.max_position_embeddings}"
        )
    return context


def store_plan(
    options: StoreOptions, geometry: ModelGeometry, dtype: str = "float32", int8_activations: bool = False
) -> tuple[StoreConfig, Placement]:
    """The store's configuration and the placement it gives, planned once: flags over the budget file over
    defaults; `auto` RAM from what is available after the dense weights, the KV cache and the prefill
    activations at the planned context (``planned_context``) for ``options.kv_sequences`` sequences and what
    the run holds beside them (the prefix cache's RAM); a budget file's RAM at most that.
    ``int8_activations``: the dense part as the loader then holds it (placement.plan)."""
    context = planned_context(options, geometry.args)
    sequences, int8 = options.kv_sequences, int8_activations
    unplaced = plan(
        geometry, StoreConfig(ram_bytes=0), dtype, sequences=sequences, context=context, int8_activations=int8
    )
    auto = auto_ram_bytes(
        unplaced.dense_bytes,
        unplaced.kv_bytes_at_max_context,
        floor_bytes(unplaced),
        activation_bytes=unplaced.activation_bytes + options.beside_store_bytes,
    )
    config = _store_config(options, _ram_bytes(options, geometry.expert_bytes, auto), geometry.expert_bytes)
    return config, with_store(unplaced, config, geometry.total_records)


def store_config(
    options: StoreOptions, geometry: ModelGeometry, dtype: str = "float32", int8_activations: bool = False
) -> StoreConfig:
    """``store_plan``'s configuration, for a caller that needs no placement."""
    return store_plan(options, geometry, dtype, int8_activations)[0]


def worker_store_config(options: StoreOptions, expert_bytes: int) -> StoreConfig:
    """The store of a worker process (colibri_stream/cluster): no dense part, no KV cache, so `auto` RAM
    is what is available less the safety margin."""
    return _store_config(options, _ram_bytes(options, expert_bytes, auto_ram_bytes(0, 0)), expert_bytes)


def _ram_bytes(options: StoreOptions, expert_bytes: int, auto: int) -> int:
    ram = options["ram"]
    assert isinstance(ram, str | int)  # a SIZE setting, checked as one where it was given
    size = parse_size(ram, expert_bytes, options.origin("ram"), auto_bytes=auto)
    if "ram" not in options.given and options.budget.path is not None:
        size = min(size, auto)  # written for some machine: no more than this one has available
    return size


def _store_config(options: StoreOptions, ram: int, expert_bytes: int) -> StoreConfig:
    def size(setting: Setting, value: str | int) -> int:
        return parse_size(value, expert_bytes, options.origin(setting.name))

    return dataclasses.replace(StoreConfig(ram_bytes=ram), **owned_values(StoreConfig, options.__getitem__, size))


def prefix_config(options: StoreOptions) -> PrefixConfig:
    """The prefix cache's sizes: flags over the budget file's [prefix] table over PrefixConfig's defaults."""

    def size(setting: Setting, value: str | int) -> int:
        return prefix_size(value, options.origin(setting.name))

    return dataclasses.replace(PrefixConfig(), **owned_values(PrefixConfig, options.__getitem__, size))
