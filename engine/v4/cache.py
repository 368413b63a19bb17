"""DeepSeek-V4's attention state per layer: per-position rows plus what was compressed from them.

- ``kv``: K=V rows [B, *, D]; a query attends to the last sliding_window of them.
- ``compressor`` (CSA and HCA layers): compressor projections and the entries of closed windows.
- ``indexer`` (CSA layers): the same for the lightning indexer's compressor.

All state is a function of the rows (what a prefix block stores; ``from_rows`` rebuilds it). Once logged,
rows attention no longer needs are released, leaving per position the compressed entries (D / m per
compressed layer) plus the sliding and open windows' rows. The lean session log stores that split:
entries per position (``entry_series``) and window state at a few positions (``window_series``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from engine.config.args import ModelArgs
from engine.config.v4_args import V4Args
from engine.v4.compressor import CompressorState
from engine.v4.position_rows import PositionRows, RowsReleased

# a layer's rows in a log record (those it has)
ROW_ORDER = ("kv", "compressor.kv", "compressor.gate", "indexer.kv", "indexer.gate")


def layer_row_widths(v4: V4Args, layer: int) -> dict[str, int]:
    """Name -> width of ``layer``'s rows per position, in ROW_ORDER: kv [D]; compressed layers' kv and gate
    [c * D] (c = 2 where windows overlap, CSA; 1, HCA); CSA's indexer kv and gate [2 * index_head_dim]."""
    rows = {"kv": v4.head_dim}
    if v4.rate(layer):
        series = 2 if v4.is_csa(layer) else 1
        rows |= {"compressor.kv": series * v4.head_dim, "compressor.gate": series * v4.head_dim}
    if v4.is_csa(layer):
        rows |= {"indexer.kv": 2 * v4.index_head_dim, "indexer.gate": 2 * v4.index_head_dim}
    return rows


def entry_series(v4: V4Args, layer: int) -> list[tuple[int, int]]:
    """(width, rate) of each compressor's entries ``layer`` keeps, in log order: the compressor's [D], then
    on CSA layers the indexer's [index_head_dim]."""
    series = [(v4.head_dim, v4.rate(layer))] if v4.rate(layer) else []
    return series + ([(v4.index_head_dim, v4.csa_rate)] if v4.is_csa(layer) else [])


def window_series(v4: V4Args, layer: int) -> list[tuple[int, int, int]]:
    """(width, period, keep) of the rows ``layer`` holds at any position, in ROW_ORDER: K=V rows of the last
    window - 1 positions; each compressor's open window (keep 0) plus, if overlapping, the one before (1)."""
    widths = layer_row_widths(v4, layer)
    periods = {"kv": (1, v4.sliding_window - 1)}
    if v4.rate(layer):
        periods |= dict.fromkeys(("compressor.kv", "compressor.gate"), (v4.rate(layer), int(v4.is_csa(layer))))
    if v4.is_csa(layer):
        periods |= dict.fromkeys(("indexer.kv", "indexer.gate"), (v4.csa_rate, 1))
    return [(width, *periods[name]) for name, width in widths.items()]


@dataclass
class V4LayerCache:
    """One layer's state for a batch of B sequences of equal length."""

    kv: PositionRows  # [B, *, D]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    @property
    def length(self) -> int:
        return self.kv.length

    def append(self, kv: torch.Tensor, window: int) -> tuple[torch.Tensor, int]:
        """kv [B, S, D] appended -> (rows any of them may see [B, R + S, D], position of the first)."""
        first = max(0, self.length - (window - 1))
        self.kv.append(kv)
        return self.kv.between(first, self.length), first

    def states(self, rates: tuple[int, int]) -> list[tuple[CompressorState, int]]:
        return [(state, rate) for state, rate in ((self.compressor, rates[0]), (self.indexer, rates[1])) if state]

    def trim(self, length: int, window: int, rates: tuple[int, int]) -> None:
        """Forget positions from ``length`` on and the entries they closed (RowsReleased if rows are gone)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} positions to {length}")
        if max(0, length - (window - 1)) < self.kv.base:
            raise RowsReleased(f"the sliding window at {length} needs rows released before {self.kv.base}")
        for state, rate in self.states(rates):
            state.trim(length, rate)
        self.kv.trim(length)

    def release_before(self, position: int, window: int, rates: tuple[int, int]) -> None:
        """Free the rows neither attention, the open windows nor the state at ``position`` or later need."""
        self.kv.release_before(min(position, self.length) - (window - 1))
        for state, rate in self.states(rates):
            state.release_before(position, rate)

    def rows(self) -> dict[str, PositionRows]:
        """Each position's rows by name (what a log holds)."""
        rows = {"kv": self.kv}
        for name, state in (("compressor", self.compressor), ("indexer", self.indexer)):
            if state is not None:
                rows[f"{name}.kv"], rows[f"{name}.gate"] = state.kv, state.gate
        return rows

    def round_held(self, dtype: torch.dtype) -> None:
        """Round held rows and entries in place to ``dtype``."""
        for state in (self.compressor, self.indexer):
            if state is not None:
                state.entries.copy_(state.entries.to(dtype))
        for rows in self.rows().values():
            held = rows.all()
            held.copy_(held.to(dtype))

    def window(self, position: int, window: int, rates: tuple[int, int]) -> list[torch.Tensor]:
        """window_series' rows at ``position`` (batch row 0), [n, width] each (RowsReleased if gone)."""
        rows = [self.kv.between(max(0, position - (window - 1)), position)[0]]
        for state, rate in self.states(rates):
            start = state.window_start(position, rate)
            rows += [state.kv.between(start, position)[0], state.gate.between(start, position)[0]]
        return rows

    def closed_entries(self, start: int, end: int, rates: tuple[int, int]) -> list[torch.Tensor]:
        """The entries [n, width] of the windows positions start..end-1 close, per entry_series (batch row 0)."""
        return [state.entries[0, start // rate : end // rate] for state, rate in self.states(rates)]

    @classmethod
    def from_snapshot(cls, entries: list[torch.Tensor], window: list[torch.Tensor], position: int) -> V4LayerCache:
        """One sequence's layer at ``position`` from its entry_series and window_series, [n, width] each."""
        states: list[CompressorState | None] = []
        for kv, gate, closed in zip(window[1::2], window[2::2], entries, strict=True):
            base = position - kv.shape[0]
            states.append(CompressorState(PositionRows(kv[None], base), PositionRows(gate[None], base), closed[None]))
        compressor, indexer = (*states, None, None)[:2]  # CSA: both; HCA: a compressor
        return cls(PositionRows(window[0][None], position - window[0].shape[0]), compressor, indexer)


def empty_layer(v4: V4Args, layer: int, batch: int, dtype: torch.dtype, device: str | torch.device) -> V4LayerCache:
    """An empty layer state (an MTP block's too: its id is past the last layer's)."""
    device = torch.device(device)

    def state(width: int, overlap: bool) -> CompressorState:
        return CompressorState.empty(batch, width, overlap, dtype, device)

    return V4LayerCache(
        kv=PositionRows(torch.empty((batch, 0, v4.head_dim), dtype=dtype, device=device)),
        compressor=state(v4.head_dim, v4.is_csa(layer)) if v4.rate(layer) else None,
        indexer=state(v4.index_head_dim, True) if v4.is_csa(layer) else None,
    )


@dataclass
class V4DraftLayer:
    """An MTP block's state for one sequence: nothing is kept that attention will not see again."""

    cache: V4LayerCache
    window: int
    rates: tuple[int, int]

    @classmethod
    def empty(cls, v4: V4Args, layer: int, dtype: torch.dtype, device: str | torch.device) -> V4DraftLayer:
        return cls(empty_layer(v4, layer, 1, dtype, device), v4.sliding_window, (v4.rate(layer), v4.csa_rate))

    @property
    def length(self) -> int:
        return self.cache.length

    def trim(self, length: int) -> None:
        self.cache.trim(length, self.window, self.rates)

    def release_before(self, position: int) -> None:
        """Free what the state at ``position`` and later does not need (a trim goes back no further)."""
        self.cache.release_before(position, self.window, self.rates)


@dataclass
class V4Cache:
    """All layers' state, ``length`` positions long. ``keep_rows_from``: the first position a log lacks; rows
    and window states from there stay (None: no log, keep only what attention needs)."""

    layers: list[V4LayerCache] = field(default_factory=list)
    rates: list[tuple[int, int]] = field(default_factory=list)  # per layer (compressor, indexer) window
    window: int = 1
    keep_rows_from: int | None = None

    @classmethod
    def empty(
        cls, args: ModelArgs, batch: int = 1, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> V4Cache:
        v4 = args.v4
        assert v4 is not None
        layers = [empty_layer(v4, i, batch, dtype, device) for i in range(args.n_layers)]
        return cls(layers, _rates(args), v4.sliding_window)

    @classmethod
    def from_rows(cls, args: ModelArgs, rows: list[dict[str, torch.Tensor]]) -> V4Cache:
        """A cache of per-layer ``rows`` ([B, T, *] by name); the next forward call recompresses the entries."""
        v4 = args.v4
        assert v4 is not None
        layers = []
        for layer_rows in rows:
            states = {}
            for name, width in (("compressor", v4.head_dim), ("indexer", v4.index_head_dim)):
                if f"{name}.kv" in layer_rows:
                    kv_rows, gate_rows = layer_rows[f"{name}.kv"], layer_rows[f"{name}.gate"]
                    states[name] = CompressorState.from_rows(kv_rows, gate_rows, width)
            layers.append(V4LayerCache(PositionRows(layer_rows["kv"]), states.get("compressor"), states.get("indexer")))
        if len({layer.length for layer in layers}) > 1:
            raise ValueError("layers disagree on the number of cached positions")
        return cls(layers, _rates(args), v4.sliding_window)

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].kv.buffer.dtype

    def trim(self, length: int) -> None:
        for layer, rates in zip(self.layers, self.rates, strict=True):
            layer.trim(length, self.window, rates)

    def release(self, keep_from: int | None = None) -> None:
        """Free rows before ``keep_rows_from`` and before ``keep_from`` (a verify step's first row: its drafts
        may be trimmed back to it)."""
        keep = self.length if self.keep_rows_from is None else self.keep_rows_from
        keep = keep if keep_from is None else min(keep, keep_from)
        for layer, rates in zip(self.layers, self.rates, strict=True):
            layer.release_before(keep, self.window, rates)

    def log_view(self) -> V4CacheLog:
        return V4CacheLog(self)

    @classmethod
    def from_snapshot(
        cls, args: ModelArgs, entries: list[torch.Tensor], window: list[torch.Tensor], position: int
    ) -> V4Cache:
        """The one-sequence state at ``position`` from every layer's entry_series and window_series."""
        v4 = args.v4
        assert v4 is not None
        rates, entry_it, window_it, layers = _rates(args), iter(entries), iter(window), []
        for layer in range(args.n_layers):
            own_entries = [next(entry_it) for _ in entry_series(v4, layer)]
            own_window = [next(window_it) for _ in window_series(v4, layer)]
            layers.append(V4LayerCache.from_snapshot(own_entries, own_window, position))
        return cls(layers, rates, v4.sliding_window)


@dataclass(frozen=True)
class V4CacheLog:
    """A V4Cache as a log reads and frees it."""

    cache: V4Cache
    frees_rows: ClassVar[bool] = True

    def rows(self, start: int, end: int) -> list[torch.Tensor]:
        """Every layer's rows in ROW_ORDER, positions start..end of batch row 0."""
        rows = []
        for layer in self.cache.layers:
            held = layer.rows()
            rows += [held[name].between(start, end)[0] for name in ROW_ORDER if name in held]
        return rows

    def entries(self, start: int, end: int) -> list[torch.Tensor]:
        """Every layer's entry_series of the windows positions start..end-1 close."""
        layers = zip(self.cache.layers, self.cache.rates, strict=True)
        return [e for layer, rates in layers for e in layer.closed_entries(start, end, rates)]

    def window(self, position: int) -> list[torch.Tensor]:
        """Every layer's window_series at ``position`` (RowsReleased if freed)."""
        layers = zip(self.cache.layers, self.cache.rates, strict=True)
        return [rows for layer, rates in layers for rows in layer.window(position, self.cache.window, rates)]

    def release(self, logged: int) -> None:
        """Keep what a log lacks (from ``logged`` on), release the rest."""
        self.cache.keep_rows_from = logged
        self.cache.release()

    def round_to(self, dtype: torch.dtype) -> None:
        """Round in place to what a cache restored from a ``dtype`` lean log holds (the log stores the entries,
        not the rows they were compressed from)."""
        if self.cache.dtype != dtype:
            for layer in self.cache.layers:
                layer.round_held(dtype)


def _rates(args: ModelArgs) -> list[tuple[int, int]]:
    v4 = args.v4
    assert v4 is not None
    return [(v4.rate(i), v4.csa_rate) for i in range(args.n_layers)]
