"""DeepSeek-V4's attention state per layer, kept as per-position rows plus what was compressed from them.

- ``kv``: the positions' K=V rows [B, *, D]; a query attends to the last sliding_window of them.
- ``compressor`` (CSA and HCA layers): the positions' compressor projections and the entries of the
  windows closed so far (engine/compressor.py).
- ``indexer`` (CSA layers): the same for the lightning indexer's own compressor.

Per position the rows are what a conversation's KV log stores (``rows``, widths ``layer_row_widths``),
and all the state is a function of them: ``from_rows`` rebuilds it (the entries are recompressed on the
next forward call), ``trim`` cuts it back. Once logged (or with no log) the rows attention no longer
needs are released (engine/position_rows.py), and what stays per position is the compressed entries: D / m
per compressed layer (engine/families.py V4Family), plus the sliding window's and the open windows' rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from engine.args import ModelArgs
from engine.compressor import CompressorState
from engine.position_rows import PositionRows, RowsReleased
from engine.v4_args import V4Args

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
        """Free the rows before ``position`` that attention and the open windows no longer need."""
        self.kv.release_before(min(position, self.length - (window - 1)))
        for state, rate in self.states(rates):
            state.release_before(position, rate)

    def rows(self) -> dict[str, PositionRows]:
        """Each position's rows by name: kv, and the compressors' kv/gate projections (what a log holds)."""
        rows = {"kv": self.kv}
        for name, state in (("compressor", self.compressor), ("indexer", self.indexer)):
            if state is not None:
                rows[f"{name}.kv"], rows[f"{name}.gate"] = state.kv, state.gate
        return rows

    def round_rows(self, dtype: torch.dtype) -> None:
        """Round every held row in place to ``dtype`` (what a bf16 KV log holds) and recompress from them
        (RowsReleased if the first rows are gone)."""
        for state in (self.compressor, self.indexer):
            if state is not None:
                state.forget_entries()
        for rows in self.rows().values():
            held = rows.all()
            held.copy_(held.to(dtype))


@dataclass
class V4Cache:
    """All layers' state; ``length`` positions have been fed to every layer.

    ``keep_rows_from``: the first position whose rows must stay (a session's log does not have them
    yet); None: no log, keep only what attention needs. ``release`` frees the rest. A position's log
    record: every layer's rows (``rows``), layer after layer, each layer's in ROW_ORDER."""

    layers: list[V4LayerCache] = field(default_factory=list)
    rates: list[tuple[int, int]] = field(default_factory=list)  # per layer (compressor, indexer) window
    window: int = 1
    keep_rows_from: int | None = None
    frees_logged_rows: ClassVar[bool] = True

    @classmethod
    def empty(
        cls, args: ModelArgs, batch: int = 1, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> V4Cache:
        v4, device = args.v4, torch.device(device)
        assert v4 is not None  # a V4 cache is built from deepseek_v4 args (engine/families.py)

        def state(width: int, overlap: bool) -> CompressorState:
            return CompressorState.empty(batch, width, overlap, dtype, device)

        def layer(i: int) -> V4LayerCache:
            return V4LayerCache(
                kv=PositionRows(torch.empty((batch, 0, v4.head_dim), dtype=dtype, device=device)),
                compressor=state(v4.head_dim, v4.is_csa(i)) if v4.rate(i) else None,
                indexer=state(v4.index_head_dim, True) if v4.is_csa(i) else None,
            )

        return cls([layer(i) for i in range(args.n_layers)], _rates(args), v4.sliding_window)

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

    def release(self) -> None:
        """Free the rows no one needs: before ``keep_rows_from`` (all but attention's when None)."""
        keep = self.length if self.keep_rows_from is None else self.keep_rows_from
        for layer, rates in zip(self.layers, self.rates, strict=True):
            layer.release_before(keep, self.window, rates)

    def log_rows(self, start: int, end: int) -> list[torch.Tensor]:
        """Every layer's rows in record order (ROW_ORDER), positions start..end of batch row 0."""
        rows = []
        for layer in self.layers:
            held = layer.rows()
            rows += [held[name].between(start, end)[0] for name in ROW_ORDER if name in held]
        return rows

    def release_logged(self, logged: int) -> None:
        """Keep the rows the log lacks (from ``logged`` on) and release the others: what stays per
        position is the compressed entries."""
        self.keep_rows_from = logged
        self.release()

    def round_as_logged(self, dtype: torch.dtype) -> None:
        """Rows rounded, compressed entries dropped: the next call rebuilds them from the rounded rows, as
        it does for a cache restored from the log. Rows already in ``dtype`` are what the log holds."""
        if self.dtype != dtype:
            for layer in self.layers:
                layer.round_rows(dtype)


def _rates(args: ModelArgs) -> list[tuple[int, int]]:
    v4 = args.v4
    assert v4 is not None  # a V4 cache is built from deepseek_v4 args (engine/families.py)
    return [(v4.rate(i), v4.csa_rate) for i in range(args.n_layers)]
