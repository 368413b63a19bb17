"""DeepSeek-V4's attention state per layer, kept as per-position rows plus what was compressed from them.

- ``kv``: the positions' K=V rows [B, *, D]; a query attends to the last sliding_window of them.
- ``compressor`` (CSA and HCA layers): the positions' compressor projections and the entries of the
  windows closed so far (engine/v4/compressor.py).
- ``indexer`` (CSA layers): the same for the lightning indexer's own compressor.

Per position the rows are what a prefix block stores (``V4CacheLog.rows``, widths ``layer_row_widths``), and all
the state is a function of them: ``from_rows`` rebuilds it (the entries are recompressed on the next
forward call), ``trim`` cuts it back. Once logged (or with no log) the rows attention no longer needs are
released (engine/v4/position_rows.py), and what stays per position is the compressed entries: D / m per
compressed layer (colibri_stream/planning/family_memory.py V4Memory counts them), plus the sliding
window's and the open windows' rows.

A session's lean log (storage/kv/lean_log.py) stores exactly that split: per position the entries of the
windows it closes (``V4CacheLog.entries``, series ``entry_series``) and, at a few positions, the window state
(``V4CacheLog.window``, series ``window_series``); ``from_snapshot`` rebuilds the state at such a position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from engine.config.args import ModelArgs
from engine.config.v4_args import V4Args
from engine.v4.compressor import CompressorState
from engine.v4.position_rows import PositionRows, RowsReleased

# The order of a layer's rows in a log record (those the layer has; V4LayerCache.rows names).
ROW_ORDER = ("kv", "compressor.kv", "compressor.gate", "indexer.kv", "indexer.gate")


def layer_row_widths(v4: V4Args, layer: int) -> dict[str, int]:
    """Name -> width of the rows ``layer`` keeps per position, in record order (ROW_ORDER):
    kv [D] on every layer; on compressed layers the compressor's kv and gate [c * D] (c = 2: CSA's
    windows overlap, 1: HCA's do not); on CSA layers the indexer's kv and gate [2 * index_head_dim]."""
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
    """(width, period, keep) of the rows ``layer`` holds at any position, in ROW_ORDER: the K=V rows of the
    last window - 1 positions, and each compressor's kv and gate rows of its open window (keep 0) plus,
    if it overlaps, the closed window before it (keep 1): CompressorState.needed_from."""
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

    kv: PositionRows  # [B, *, D]: the K=V rows of the positions still held
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    @property
    def length(self) -> int:
        return self.kv.length

    def append(self, kv: torch.Tensor, window: int) -> tuple[torch.Tensor, int]:
        """Add the S new positions' rows kv [B, S, D]; return (the rows any of them may see, i.e. from
        window - 1 positions before the first, [B, R + S, D]; the position of the first of those rows)."""
        first = max(0, self.length - (window - 1))
        self.kv.append(kv)
        return self.kv.between(first, self.length), first

    def states(self, rates: tuple[int, int]) -> list[tuple[CompressorState, int]]:
        return [(state, rate) for state, rate in ((self.compressor, rates[0]), (self.indexer, rates[1])) if state]

    def trim(self, length: int, window: int, rates: tuple[int, int]) -> None:
        """Forget every position from ``length`` on (and the entries of windows they closed); RowsReleased
        if the rows that state needs were released."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} positions to {length}")
        if max(0, length - (window - 1)) < self.kv.base:
            raise RowsReleased(f"the sliding window at {length} needs rows released before {self.kv.base}")
        for state, rate in self.states(rates):
            state.trim(length, rate)
        self.kv.trim(length)

    def release_before(self, position: int, window: int, rates: tuple[int, int]) -> None:
        """Free the rows that neither attention, the open windows nor the state at ``position`` or later
        (what a log may still record: its rows, its window) need."""
        self.kv.release_before(min(position, self.length) - (window - 1))
        for state, rate in self.states(rates):
            state.release_before(position, rate)

    def rows(self) -> dict[str, PositionRows]:
        """Each position's rows by name: kv, and the compressors' kv/gate projections (what a log holds)."""
        rows = {"kv": self.kv}
        for name, state in (("compressor", self.compressor), ("indexer", self.indexer)):
            if state is not None:
                rows[f"{name}.kv"], rows[f"{name}.gate"] = state.kv, state.gate
        return rows

    def round_held(self, dtype: torch.dtype) -> None:
        """Round every held row and entry in place to ``dtype`` (what a bf16 lean log holds of them)."""
        for state in (self.compressor, self.indexer):
            if state is not None:
                state.entries.copy_(state.entries.to(dtype))
        for rows in self.rows().values():
            held = rows.all()
            held.copy_(held.to(dtype))

    def window(self, position: int, window: int, rates: tuple[int, int]) -> list[torch.Tensor]:
        """The rows window_series names at ``position`` (batch row 0), [n, width] each, in ROW_ORDER
        (RowsReleased if they are gone)."""
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
        """The layer at ``position`` from its entry_series' entries [n, width] (every window closed before
        it) and its window_series' rows [n, width], one sequence."""
        states: list[CompressorState | None] = []
        for kv, gate, closed in zip(window[1::2], window[2::2], entries, strict=True):
            base = position - kv.shape[0]
            states.append(CompressorState(PositionRows(kv[None], base), PositionRows(gate[None], base), closed[None]))
        compressor, indexer = (*states, None, None)[:2]  # HCA: a compressor; CSA: and an indexer
        return cls(PositionRows(window[0][None], position - window[0].shape[0]), compressor, indexer)


def empty_layer(v4: V4Args, layer: int, batch: int, dtype: torch.dtype, device: str | torch.device) -> V4LayerCache:
    """Layer ``layer``'s state holding no position (an MTP block's too: its id is past the last layer's)."""
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
    """An MTP block's state for one sequence (engine/core/cache.py DraftCache): its layer cache, trimmed back as a
    draft chain is forgotten, and nothing kept that attention will not see again."""

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
    """All layers' state; ``length`` positions have been fed to every layer.

    ``keep_rows_from``: the first position a log has not recorded yet: its rows and the window state at
    it or any later position stay (``V4CacheLog.rows``, ``.window``); None: no log, keep only what attention
    needs. ``release`` frees the rest. A position's full record (a prefix block's): every layer's rows
    (``rows``), layer after layer, each layer's in ROW_ORDER."""

    layers: list[V4LayerCache] = field(default_factory=list)
    rates: list[tuple[int, int]] = field(default_factory=list)  # per layer (compressor, indexer) window
    window: int = 1
    keep_rows_from: int | None = None

    @classmethod
    def empty(
        cls, args: ModelArgs, batch: int = 1, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> V4Cache:
        v4 = args.v4
        assert v4 is not None  # a V4 cache is built from deepseek_v4 args (engine/families.py)
        layers = [empty_layer(v4, i, batch, dtype, device) for i in range(args.n_layers)]
        return cls(layers, _rates(args), v4.sliding_window)

    @classmethod
    def from_rows(cls, args: ModelArgs, rows: list[dict[str, torch.Tensor]]) -> V4Cache:
        """A cache holding the positions whose per-layer rows (as ``V4LayerCache.rows`` names them,
        [B, T, *] each) are ``rows``; the compressed entries are rebuilt by the next forward call."""
        v4 = args.v4
        assert v4 is not None  # a V4 cache is built from deepseek_v4 args (engine/families.py)
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
        """Free the rows no one needs: before ``keep_rows_from`` (all but attention's when None), and before
        ``keep_from`` when given (a verify step's first row: its drafts may be trimmed back to it)."""
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
        """The one-sequence state at ``position`` from every layer's entry_series (the entries [n, width] of
        the windows closed before it) and window_series (rows [n, width]), in the compute dtype."""
        v4 = args.v4
        assert v4 is not None  # a V4 cache is built from deepseek_v4 args (engine/families.py)
        rates, entry_it, window_it, layers = _rates(args), iter(entries), iter(window), []
        for layer in range(args.n_layers):
            own_entries = [next(entry_it) for _ in entry_series(v4, layer)]
            own_window = [next(window_it) for _ in window_series(v4, layer)]
            layers.append(V4LayerCache.from_snapshot(own_entries, own_window, position))
        return cls(layers, rates, v4.sliding_window)


@dataclass(frozen=True)
class V4CacheLog:
    """A V4Cache as a log reads and frees it (engine/core/interfaces.py CacheLog): a prefix block's record is
    every layer's rows; the lean log's, the entries per position and the window state at its snapshots."""

    cache: V4Cache
    frees_rows: ClassVar[bool] = True

    def rows(self, start: int, end: int) -> list[torch.Tensor]:
        """Every layer's rows in record order (ROW_ORDER), positions start..end of batch row 0."""
        rows = []
        for layer in self.cache.layers:
            held = layer.rows()
            rows += [held[name].between(start, end)[0] for name in ROW_ORDER if name in held]
        return rows

    def entries(self, start: int, end: int) -> list[torch.Tensor]:
        """Every layer's entry_series: the entries [n, width] of the windows positions start..end-1 close."""
        layers = zip(self.cache.layers, self.cache.rates, strict=True)
        return [e for layer, rates in layers for e in layer.closed_entries(start, end, rates)]

    def window(self, position: int) -> list[torch.Tensor]:
        """Every layer's window_series: the rows [n, width] the state at ``position`` holds (RowsReleased if
        they were freed: a session's end_turn asks before its log's length moves on)."""
        layers = zip(self.cache.layers, self.cache.rates, strict=True)
        return [rows for layer, rates in layers for rows in layer.window(position, self.cache.window, rates)]

    def release(self, logged: int) -> None:
        """Keep what a log lacks (from ``logged`` on: rows, window states) and release the rest: what
        stays per position is the compressed entries."""
        self.cache.keep_rows_from = logged
        self.cache.release()

    def round_to(self, dtype: torch.dtype) -> None:
        """Held rows and entries rounded in place: what a cache restored from a lean log of ``dtype``
        records holds (the log stores the entries, not the rows they were compressed from)."""
        if self.cache.dtype != dtype:
            for layer in self.cache.layers:
                layer.round_held(dtype)


def _rates(args: ModelArgs) -> list[tuple[int, int]]:
    v4 = args.v4
    assert v4 is not None  # a V4 cache is built from deepseek_v4 args (engine/families.py)
    return [(v4.rate(i), v4.csa_rate) for i in range(args.n_layers)]
