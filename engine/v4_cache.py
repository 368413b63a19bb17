"""DeepSeek-V4's attention state per layer, kept as per-position rows plus what was compressed from them.

- ``kv``: every position's K=V row [B, T, D]; a query attends to the last sliding_window of them.
- ``compressor`` (CSA and HCA layers): every position's compressor projections and the entries of the
  windows closed so far (engine/compressor.py).
- ``indexer`` (CSA layers): the same for the lightning indexer's own compressor.

Per position the rows are what a conversation's KV log stores (``rows``), and all the state is a
function of them: ``from_rows`` rebuilds it (the entries are recompressed on the next forward call),
``trim`` cuts it back to any length. What attention reads per position is far less: D / m per
compressed layer once the window has passed (``colibri_stream.kv_geometry``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.args import ModelArgs
from engine.cache import grow
from engine.compressor import CompressorState


@dataclass
class V4LayerCache:
    """One layer's state for a batch of B sequences of equal length."""

    kv: torch.Tensor  # [B, capacity, D]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    length: int = 0

    def append(self, kv: torch.Tensor, window: int) -> tuple[torch.Tensor, int]:
        """Add the S new positions' rows kv [B, S, D]; return (the rows any of them may see, i.e. from
        window - 1 positions before the first, [B, R + S, D]; the position of the first of those rows)."""
        end = self.length + kv.shape[1]
        self.kv = grow(self.kv, end)
        self.kv[:, self.length : end] = kv
        first = max(0, self.length - (window - 1))
        self.length = end
        return self.kv[:, first:end], first

    def trim(self, length: int, rates: tuple[int, int]) -> None:
        """Forget every position from ``length`` on (and the entries of windows they closed)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} positions to {length}")
        self.length = length
        for state, rate in ((self.compressor, rates[0]), (self.indexer, rates[1])):
            if state is not None:
                state.trim(length, rate)

    def rows(self) -> dict[str, torch.Tensor]:
        """Every position's rows [B, T, *] by name: kv, and the compressors' kv/gate projections."""
        rows = {"kv": self.kv[:, : self.length]}
        for name, state in (("compressor", self.compressor), ("indexer", self.indexer)):
            if state is not None:
                rows[f"{name}.kv"], rows[f"{name}.gate"] = state.rows()
        return rows

    def round_rows(self, dtype: torch.dtype) -> None:
        """Round every row in place to ``dtype`` (what a bf16 KV log holds) and recompress from them."""
        for rows in self.rows().values():
            rows.copy_(rows.to(dtype))
        for state in (self.compressor, self.indexer):
            if state is not None:
                state.forget_entries()


@dataclass
class V4Cache:
    """All layers' state; ``length`` positions have been fed to every layer."""

    layers: list[V4LayerCache] = field(default_factory=list)
    rates: list[tuple[int, int]] = field(default_factory=list)  # per layer (compressor, indexer) window

    @classmethod
    def empty(
        cls, args: ModelArgs, batch: int = 1, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> V4Cache:
        v4, device = args.v4, torch.device(device)

        def layer(i: int) -> V4LayerCache:
            return V4LayerCache(
                kv=torch.empty((batch, 0, v4.head_dim), dtype=dtype, device=device),
                compressor=CompressorState.empty(batch, v4.head_dim, v4.is_csa(i), dtype, device)
                if v4.rate(i)
                else None,
                indexer=CompressorState.empty(batch, v4.index_head_dim, True, dtype, device) if v4.is_csa(i) else None,
            )

        return cls([layer(i) for i in range(args.n_layers)], _rates(args))

    @classmethod
    def from_rows(cls, args: ModelArgs, rows: list[dict[str, torch.Tensor]]) -> V4Cache:
        """A cache holding the positions whose per-layer rows (as ``V4LayerCache.rows`` gives them) are
        ``rows``; the compressed entries are rebuilt by the next forward call."""
        v4 = args.v4
        layers = []
        for layer_rows in rows:
            kv = layer_rows["kv"]
            states = {}
            for name, width in (("compressor", v4.head_dim), ("indexer", v4.index_head_dim)):
                if f"{name}.kv" in layer_rows:
                    states[name] = CompressorState.from_rows(
                        layer_rows[f"{name}.kv"], layer_rows[f"{name}.gate"], width
                    )
            layers.append(V4LayerCache(kv, states.get("compressor"), states.get("indexer"), kv.shape[1]))
        cache = cls(layers, _rates(args))
        if len({layer.length for layer in layers}) > 1:
            raise ValueError("layers disagree on the number of cached positions")
        return cache

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def trim(self, length: int) -> None:
        for layer, rates in zip(self.layers, self.rates, strict=True):
            layer.trim(length, rates)


def _rates(args: ModelArgs) -> list[tuple[int, int]]:
    v4 = args.v4
    return [(v4.rate(i), v4.csa_rate) for i in range(args.n_layers)]
