"""StoreConfig: how the tiered store is sized and run, with each field's default and range stated once (the
library's settings table reads them: colibri_stream/planning/settings.py)."""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from storage.errors import BudgetError
from storage.tiers.policy import DEFAULT_POLICY, POLICY_NAMES, RAM_HALF_LIFE_TOKENS

# Disk reader threads a store may start (StoreConfig.threads; budget io.threads, --io-threads): an NVMe
# queue is kept busy by a few dozen reads in flight; thousands of threads only cost memory and start-up.
MAX_IO_THREADS = 256


# StoreConfig field metadata: the range or choices a value must be in. Declared here, beside each field's
# default, and nowhere else: the library's settings table (colibri_stream/planning/settings.py) reads both to
# check budget files and flags, naming the key or flag; ``__post_init__`` checks a StoreConfig built directly.
RANGE = "range"  # (low, high): low <= value, and value <= high unless high is None
CHOICES = "choices"  # the values allowed


def default_vram_device() -> str:
    """The VRAM tier's device: cuda where a GPU is, else cpu standing in so the tier logic runs anywhere."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class StoreConfig:
    """How the tiered store is sized and run. These field defaults and ranges are the only ones: the
    library's settings table (budget files, flags, the docs) takes them from here."""

    ram_bytes: int  # RAM for expert slots (the library's Budget says it as a size, a % or auto)
    vram_bytes: int = 0  # VRAM for expert slots; 0: no VRAM tier
    vram_device: str = field(default_factory=default_vram_device)
    # eviction: frequent | lru | hybrid | pinned (lru + learned hot store), storage.tiers.policy
    policy: str = field(default=DEFAULT_POLICY, metadata={CHOICES: POLICY_NAMES})
    prefetch: bool = True  # read the experts the router guesses for the next layers while this one computes
    # reads past the page cache (O_DIRECT, F_NOCACHE on macOS: storage/files/page_cache.py; where the
    # filesystem allows): the RAM slots are the cache; buffered reads would
    # keep the same bytes twice and, under a memory limit, pay page-cache reclaim on every miss
    # (docs/benchmarks.md).
    direct: bool = True
    # disk reader threads (per device of a spread container): parallel reads keep an NVMe queue busy
    threads: int = field(default=4, metadata={RANGE: (1, MAX_IO_THREADS)})
    # how many MoE layers ahead the model guesses and prefetches (engine.mla.model's guesses): 2 gives a
    # read a layer more to land while the disk would otherwise idle between layers' misses
    prefetch_layers: int = field(default=2, metadata={RANGE: (1, None)})
    # when the RAM slots hold every expert: read them all at load (``preload``), in file order, so no
    # prompt waits for a read; the reads fault the slot memory in, instead of a separate pre-fault pass.
    # Code that counts on-demand reads at such a budget (tests, disk benchmarks) turns it off.
    preload: bool = True
    # the frequent policy's counts halve every this many tokens' worth of routed uses (storage.tiers.policy)
    half_life: int = field(default=RAM_HALF_LIFE_TOKENS, metadata={RANGE: (1, None)})
    history_path: Path | None = None  # usage-history file (learned hot store), saved after every turn

    def __post_init__(self) -> None:
        for spec in fields(self):
            problem = out_of_bounds(spec, vars(self)[spec.name])
            if problem is not None:
                raise BudgetError(f"store {spec.name} {problem}")


def out_of_bounds(spec: Field[Any], value: object) -> str | None:
    """Why ``value`` is outside the field's RANGE or CHOICES ("must be 1..256, got 0"); None where it is in."""
    if CHOICES in spec.metadata and value not in spec.metadata[CHOICES]:
        return f"must be one of {', '.join(spec.metadata[CHOICES])}, got {value!r}"
    if RANGE in spec.metadata and isinstance(value, int):
        low, high = spec.metadata[RANGE]
        if value < low or (high is not None and value > high):
            return f"must be {low}..{high}, got {value}" if high is not None else f"must be >= {low}, got {value}"
    return None
