"""Typed, range-checked reads of config.json values, and the relations between them.

A config is hostile input: a bad value is refused with its key before anything is sized from it. The
bounds are far above every real model and only stop sizes nothing could hold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

MAX_LAYERS = 1024
MAX_HEADS = 4096
MAX_EXPERTS = 1 << 16
MAX_SIZE = 1 << 24  # any width, rank or vocabulary


class ConfigError(ValueError):
    """A config.json the engine cannot run faithfully; the message names the field."""


def brief(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, so an error never echoes a huge hostile value."""
    try:
        text = repr(value)
    except RecursionError:  # a list nested nearly as deep as the JSON reader allows
        return f"<{type(value).__name__} nested too deeply>"
    return text if len(text) <= limit else text[:limit] + "..."


def _refuse(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"config.json: {key}={brief(value)}, expected {expected}")


def as_int(key: str, value: Any, minimum: int, maximum: int) -> int:
    """``value`` as an int in [minimum, maximum]; a bool, a string or a fractional float is refused."""
    integral = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if isinstance(value, bool) or not integral or not minimum <= int(value) <= maximum:
        raise _refuse(key, value, f"an integer in [{minimum}, {maximum}]")
    return int(value)


def as_float(key: str, value: Any, positive: bool = True) -> float:
    """``value`` as a finite float (> 0 when ``positive``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise _refuse(key, value, "a finite number > 0" if positive else "a finite number")
    return float(value)


def as_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _refuse(key, value, "true or false")
    return value


def required(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ConfigError(f"config.json: missing required field {key!r}")
    return config[key]


def size(config: Mapping[str, Any], key: str, minimum: int = 1, maximum: int = MAX_SIZE) -> int:
    """A required integer size, in range."""
    return as_int(key, required(config, key), minimum, maximum)


def optional_int(config: Mapping[str, Any], key: str, default: int, minimum: int, maximum: int) -> int:
    """An optional integer: absent or null means ``default``; 0 is a value, never "absent"."""
    value = config.get(key)
    return default if value is None else as_int(key, value, minimum, maximum)


def optional_float(config: Mapping[str, Any], key: str, default: float, positive: bool = True) -> float:
    value = config.get(key)
    return default if value is None else as_float(key, value, positive)


def optional_bool(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key)
    return default if value is None else as_bool(key, value)


def check_routing(n_routed: int, top_k: int, n_groups: int, topk_groups: int) -> None:
    """The router's relations: top-k experts out of the ``topk_groups`` best of ``n_groups`` equal groups,
    groups ranked by the sum of their two best scores (so a grouped router needs 2 experts per group)."""
    if top_k > n_routed:
        raise _refuse("num_experts_per_tok", top_k, f"at most n_routed_experts={n_routed}")
    if n_routed % n_groups:
        raise ConfigError(f"config.json: n_routed_experts={n_routed} is not divisible by n_group={n_groups}")
    if topk_groups > n_groups:
        raise _refuse("topk_group", topk_groups, f"at most n_group={n_groups}")
    per_group = n_routed // n_groups
    if n_groups > 1 and per_group < 2:
        raise _refuse("n_group", n_groups, f"at most n_routed_experts/2={n_routed // 2} (groups rank by their top 2)")
    if top_k > topk_groups * per_group:
        raise _refuse(
            "num_experts_per_tok", top_k, f"at most topk_group x experts per group = {topk_groups * per_group}"
        )
