"""Model families, chosen once per config: ``family_of(args)`` is the one place that asks which.

``MLAFamily``: DeepSeek-V3/R1, Kimi-K2, V3.2 and GLM-5 (MLA attention, the DSA indexer on some).
``V4Family``: DeepSeek-V4 (compressed sparse attention, hyper-connections).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.config.args import ModelArgs
from engine.config.v4_args import V4Args
from engine.core.cache import KVCache
from engine.core.interfaces import Cache, Model
from engine.mla.model import Transformer
from engine.v4.cache import V4Cache, entry_series, layer_row_widths, window_series
from engine.v4.model import V4Transformer


class KVLogFormat(Protocol):
    """What storage.kv's logs and a session's log hold per position."""

    def log_record(self) -> tuple[int, dict[str, Any]]:
        """A position's record: (storage.kv.log format version, geometry fields)."""
        ...

    def log_row_widths(self) -> list[int]:
        """A record's row widths (values), in record order."""
        ...

    def log_row_layers(self) -> list[tuple[int, str]]:
        """A record's rows as (layer, row name), in record order: what a refusal names. Layer 0's rows are
        projections of its input, the token's embedding: they depend on the token and position only."""
        ...

    def cache_from_log(self, rows: list[torch.Tensor], dtype: torch.dtype) -> Cache:
        """The one-sequence cache of logged ``rows`` (float32 [1, n, width] each, record order) in ``dtype``."""
        ...

    def session_log_record(self) -> tuple[int, dict[str, Any]]:
        """A session log's record: ``log_record``, or V4's lean one of entries and window snapshots."""
        ...

    def cache_from_snapshot(
        self, entries: list[torch.Tensor], window: list[torch.Tensor], position: int, dtype: torch.dtype
    ) -> Cache:
        """The one-sequence cache at ``position`` from a session log's series (float32 [n, width] each): the
        entries of positions 0..position-1 and the window state at ``position``."""
        ...


@dataclass(frozen=True)
class MLAGeometry:
    """What planning's memory estimates read of an MLA model."""

    args: ModelArgs
    index_layers: tuple[int, ...]  # the layers that run their own DSA indexer (and cache its keys)


@dataclass(frozen=True)
class V4Geometry:
    """What planning's memory estimates read of a DeepSeek-V4 model."""

    args: ModelArgs
    v4: V4Args
    layer_rows: tuple[Mapping[str, int], ...]  # per layer its rows' widths by name (layer_row_widths)


Geometry = MLAGeometry | V4Geometry


class Family(Protocol):
    """What differs between model families outside their forward pass."""

    args: ModelArgs

    @property
    def swiglu_limit(self) -> float | None:
        """The routed experts' clamp (None: none), for a cluster worker's sums."""
        ...

    @property
    def kv_log(self) -> KVLogFormat: ...

    @property
    def geometry(self) -> Geometry: ...

    def model(self) -> Model[Any]:
        """The forward pass, parameters uninitialised."""
        ...


def family_of(args: ModelArgs) -> Family:
    """The family of a model config."""
    return MLAFamily(args) if args.v4 is None else V4Family(args, args.v4)


def meta_transformer(args: ModelArgs) -> Model[Any]:
    """The model on torch's meta device: what loaders check names and shapes against before reading."""
    with torch.device("meta"):
        return family_of(args).model()


class MLAFamily:
    """MLA attention; the DSA indexer on the layers that run one."""

    swiglu_limit = None

    def __init__(self, args: ModelArgs):
        self.args = args
        index_layers = tuple(layer for layer in range(args.n_layers) if args.has_indexer(layer))
        self.kv_log = MLALog(args, index_layers)
        self.geometry = MLAGeometry(args, index_layers)

    def model(self) -> Transformer:
        return Transformer(self.args)


class MLALog:
    """The KV-log format of MLA models."""

    def __init__(self, args: ModelArgs, index_layers: tuple[int, ...]):
        self.args, self.index_layers = args, index_layers

    def log_record(self) -> tuple[int, dict[str, Any]]:
        """Format 2 (storage.kv.log KVGeometry): per layer latent + roped key, then per DSA full layer
        the indexer key."""
        args = self.args
        fields = {"n_layers": args.n_layers, "kv_lora_rank": args.kv_lora_rank, "index_layers": self.index_layers}
        return 2, fields | {"qk_rope_head_dim": args.qk_rope_head_dim, "index_head_dim": args.index_head_dim}

    def log_row_widths(self) -> list[int]:
        args = self.args
        latent = [args.kv_lora_rank, args.qk_rope_head_dim] * args.n_layers
        return latent + [args.index_head_dim] * len(self.index_layers)

    def log_row_layers(self) -> list[tuple[int, str]]:
        latent = [(i, row) for i in range(self.args.n_layers) for row in ("latent", "rope key")]
        return latent + [(i, "indexer key") for i in self.index_layers]

    def cache_from_log(self, rows: list[torch.Tensor], dtype: torch.dtype) -> KVCache:
        """Latent and roped key in ``dtype``; the indexer keys stay float32 (as KVCache holds them)."""
        if rows[0].shape[1] == 0:
            return KVCache.empty(self.args, 1, dtype)
        n = self.args.n_layers
        state = [{"latent": rows[2 * i].to(dtype), "rope_key": rows[2 * i + 1].to(dtype)} for i in range(n)]
        for layer, index_key in zip(self.index_layers, rows[2 * n :], strict=True):
            state[layer]["index_key"] = index_key
        return KVCache.from_state(state)

    def session_log_record(self) -> tuple[int, dict[str, Any]]:
        """The per-position record (format 2)."""
        return self.log_record()

    def cache_from_snapshot(
        self, entries: list[torch.Tensor], window: list[torch.Tensor], position: int, dtype: torch.dtype
    ) -> KVCache:
        """The entries are the positions' rows; there is no window state."""
        return self.cache_from_log([rows[None] for rows in entries], dtype)


class V4Family:
    """DeepSeek-V4."""

    def __init__(self, args: ModelArgs, v4: V4Args):
        self.args, self.v4 = args, v4
        self.kv_log = V4Log(args, v4)
        self.geometry = V4Geometry(args, v4, tuple(layer_row_widths(v4, layer) for layer in range(args.n_layers)))

    @property
    def swiglu_limit(self) -> float | None:
        return self.v4.swiglu_limit

    def model(self) -> V4Transformer:
        return V4Transformer(self.args)


class V4Log:
    """DeepSeek-V4's KV-log format: a prefix block's record holds every cached row; the session log is lean."""

    def __init__(self, args: ModelArgs, v4: V4Args):
        self.args, self.v4 = args, v4

    def _layer_rows(self) -> list[dict[str, int]]:
        return [layer_row_widths(self.v4, layer) for layer in range(self.args.n_layers)]

    def log_record(self) -> tuple[int, dict[str, Any]]:
        """Format 3 (storage.kv.log RowsGeometry): per layer, that layer's rows (layer_row_widths)."""
        return 3, {"layer_rows": tuple(tuple(rows.values()) for rows in self._layer_rows())}

    def log_row_widths(self) -> list[int]:
        return [width for rows in self._layer_rows() for width in rows.values()]

    def log_row_layers(self) -> list[tuple[int, str]]:
        return [(i, name) for i, rows in enumerate(self._layer_rows()) for name in rows]

    def cache_from_log(self, rows: list[torch.Tensor], dtype: torch.dtype) -> V4Cache:
        """Its compressed entries are rebuilt by the next forward call."""
        if rows[0].shape[1] == 0:
            return V4Cache.empty(self.args, 1, dtype)
        logged = iter(rows)
        layers = [{name: next(logged).to(dtype) for name in names} for names in self._layer_rows()]
        return V4Cache.from_rows(self.args, layers)

    def session_log_record(self) -> tuple[int, dict[str, Any]]:
        """Format 4 (storage.kv.geometry LeanGeometry): each layer's entry_series and window_series; the
        snapshot interval follows from their sizes."""
        layers = range(self.args.n_layers)
        entries = tuple(series for layer in layers for series in entry_series(self.v4, layer))
        return 4, {"entries": entries, "windows": tuple(s for layer in layers for s in window_series(self.v4, layer))}

    def cache_from_snapshot(
        self, entries: list[torch.Tensor], window: list[torch.Tensor], position: int, dtype: torch.dtype
    ) -> V4Cache:
        return V4Cache.from_snapshot(
            self.args, [e.to(dtype) for e in entries], [rows.to(dtype) for rows in window], position
        )
