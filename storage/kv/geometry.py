"""What a KV log's records hold, by format version (the header's "format_version" and "geometry"):

    2 KVGeometry    (MLA models): one fixed-size record per position: per layer latent + roped key,
                    then per DSA full layer the indexer key (storage/kv/log.py);
    3 RowsGeometry  per-layer rows, one fixed-size record per position (storage/kv/log.py; DeepSeek-V4's
                    full rows: what a prefix-cache block stores, no longer a session's log);
    4 LeanGeometry  DeepSeek-V4's lean session log (storage/kv/lean_log.py): per position its token and the
                    compressed entries of the windows it closes, plus snapshots of the fixed-size window
                    state every ``snapshot_every`` positions and at the log's end.

Storage sees values as widths and counts in a record dtype; which floats go where is the app's business.
"""

from __future__ import annotations

import math
import struct
from abc import abstractmethod
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from storage.container.layout import DTYPES
from storage.errors import FormatError

_TOKEN = struct.Struct("<I")
_CRC = struct.Struct("<I")
# A format-4 frame's header: tag, reserved zero, first position, positions it covers (storage/kv/lean_log.py).
FRAME_HEADER = struct.Struct("<4sIQQ")
FRAME_OVERHEAD = FRAME_HEADER.size + _CRC.size
# Record dtypes (float32 is exact; bfloat16 halves the file); sizes from the one table, storage.container.layout.DTYPES.
RECORD_DTYPES = ("float32", "bfloat16")
MAX_ROW_WIDTH = 1 << 24  # values in one row: far above any model's, far below an absurd record
MAX_PERIOD = 1 << 20  # positions per window or between snapshots: far above any model's
# Positions between snapshots when entries leave no room for them (a model of sliding layers only).
FALLBACK_SNAPSHOT_EVERY = 4096


def _is_width(value: Any, limit: int = MAX_ROW_WIDTH, least: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= limit


def _check_dtype(dtype: str) -> None:
    if dtype not in RECORD_DTYPES:
        raise FormatError(f"KV record dtype {dtype!r} is not one of {sorted(RECORD_DTYPES)}")


def item_bytes(dtype: str) -> int:
    return np.dtype(DTYPES[dtype]).itemsize


class _RecordSizes:
    """Sizes of a record from its geometry's ``values_per_token`` and ``dtype``."""

    dtype: str

    @property
    @abstractmethod
    def values_per_token(self) -> int:
        """Values one record holds per token (each geometry sums its own)."""

    @property
    def payload_bytes(self) -> int:
        return self.values_per_token * item_bytes(self.dtype)

    @property
    def record_bytes(self) -> int:
        return _TOKEN.size + self.payload_bytes + _CRC.size


@dataclass(frozen=True)
class KVGeometry(_RecordSizes):
    """What one record holds: per layer (kv_lora + qk_rope) values, plus index_dim per DSA full layer."""

    n_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_layers: tuple[int, ...]
    index_head_dim: int
    dtype: str  # "float32" | "bfloat16"

    FORMAT_VERSION: ClassVar[int] = 2

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)

    @property
    def values_per_token(self) -> int:
        return (
            self.n_layers * (self.kv_lora_rank + self.qk_rope_head_dim) + len(self.index_layers) * self.index_head_dim
        )


@dataclass(frozen=True)
class RowsGeometry(_RecordSizes):
    """What one record holds as per-layer rows: ``layer_rows[i]`` are the widths (values) of layer i's
    rows, stored one after another, layer after layer. Which row is which is the app's business."""

    layer_rows: tuple[tuple[int, ...], ...]
    dtype: str  # "float32" | "bfloat16"

    FORMAT_VERSION: ClassVar[int] = 3

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        if not self.layer_rows or not all(
            isinstance(layer, tuple) and layer and all(_is_width(w) for w in layer) for layer in self.layer_rows
        ):
            raise FormatError(f"KV layer_rows {self.layer_rows!r} must list, per layer, positive row widths")

    @property
    def values_per_token(self) -> int:
        return sum(sum(layer) for layer in self.layer_rows)


@dataclass(frozen=True)
class LeanGeometry:
    """A lean log's series (storage/kv/lean_log.py):

    ``entries``: per entry series (width, period): one row of ``width`` values each time a window of
        ``period`` positions closes (position p closes one when (p + 1) % period == 0); a positions frame
        holds, after its tokens, the rows of the windows its positions close, series after series.
    ``windows``: per window series (width, period, keep): a snapshot at position S holds the rows of
        positions max(0, (S // period - keep) * period) .. S-1 (period 1, keep W-1: the last W-1 rows;
        a compressor of rate m: its open window, and with keep 1 the closed window before it).
    ``snapshot_every``: snapshots at every multiple of it are kept for good (a cut-back restores the
        nearest one at or before it and re-prefills the rest); the one at the log's end is replaced by
        the next append's."""

    entries: tuple[tuple[int, int], ...]
    windows: tuple[tuple[int, int, int], ...]
    snapshot_every: int
    dtype: str

    FORMAT_VERSION: ClassVar[int] = 4

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        entries_ok = all(
            isinstance(s, tuple) and len(s) == 2 and _is_width(s[0]) and _is_width(s[1], MAX_PERIOD)
            for s in self.entries
        )
        windows_ok = all(
            isinstance(s, tuple)
            and len(s) == 3
            and _is_width(s[0])
            and _is_width(s[1], MAX_PERIOD)
            and _is_width(s[2], MAX_PERIOD, 0)
            for s in self.windows
        )
        if not (entries_ok and windows_ok and self.windows and _is_width(self.snapshot_every, MAX_PERIOD)):
            raise FormatError(
                f"KV lean geometry is malformed: entries {self.entries!r} (width, period), windows "
                f"{self.windows!r} (width, period, keep), snapshot_every {self.snapshot_every!r}"
            )

    @classmethod
    def sized(
        cls, entries: tuple[tuple[int, int], ...], windows: tuple[tuple[int, int, int], ...], dtype: str
    ) -> LeanGeometry:
        """The geometry with the shortest snapshot interval that keeps a long log's bytes per token (an
        append per position, the worst case) within twice the entries' (the in-memory state per token):
        a multiple of every period, so a snapshot never lands inside a window."""
        probe = cls(entries, windows, 1, dtype)
        step = math.lcm(*(period for _, period in entries), *(period for _, period, _ in windows))
        room = probe.entry_bytes_per_token - _TOKEN.size - FRAME_OVERHEAD  # what snapshots may cost per token
        if room <= 0:
            return cls(entries, windows, step * math.ceil(FALLBACK_SNAPSHOT_EVERY / step), dtype)
        every = step * max(1, math.ceil(probe.kept_snapshot_bytes / (room * step)))
        return cls(entries, windows, every, dtype)

    @property
    def item(self) -> int:
        return item_bytes(self.dtype)

    def entry_counts(self, first: int, count: int) -> list[int]:
        """Per entry series, the windows positions first..first+count-1 close."""
        return [(first + count) // period - first // period for _, period in self.entries]

    def window_rows(self, position: int) -> list[int]:
        """Per window series, the rows a snapshot at ``position`` holds."""
        return [position - max(0, (position // period - keep) * period) for _, period, keep in self.windows]

    def positions_payload_bytes(self, first: int, count: int) -> int:
        widths = (width for width, _ in self.entries)
        values = sum(n * w for n, w in zip(self.entry_counts(first, count), widths, strict=True))
        return count * _TOKEN.size + values * self.item

    def snapshot_payload_bytes(self, position: int) -> int:
        widths = (width for width, _, _ in self.windows)
        return sum(n * w for n, w in zip(self.window_rows(position), widths, strict=True)) * self.item

    @property
    def entry_bytes_per_token(self) -> Fraction:
        return sum((Fraction(width, period) for width, period in self.entries), Fraction(0)) * self.item

    @property
    def kept_snapshot_bytes(self) -> int:
        """A kept snapshot frame (at a multiple of the interval, past the first windows)."""
        values = sum(width * keep * period for width, period, keep in self.windows)
        return FRAME_OVERHEAD + values * self.item

    @property
    def end_snapshot_bytes(self) -> int:
        """The largest snapshot frame (the log's end may be inside every window): a fixed cost per log."""
        values = sum(width * (keep * period + period - 1) for width, period, keep in self.windows)
        return FRAME_OVERHEAD + values * self.item

    @property
    def bytes_per_token(self) -> float:
        """A long log's bytes per position, at most: its token, a frame per position (an append per
        token), the entries it closes and its share of the kept snapshots."""
        per_token = _TOKEN.size + FRAME_OVERHEAD + self.entry_bytes_per_token
        return float(per_token + Fraction(self.kept_snapshot_bytes, self.snapshot_every))


Geometry = KVGeometry | RowsGeometry  # one fixed-size record per position (storage/kv/log.py)
AnyGeometry = KVGeometry | RowsGeometry | LeanGeometry
# The format versions this build reads and writes, by the geometry each holds. 2: the header records
# "state" (the compute dtype; a version-1 log cannot say what it was computed in). 3: per-layer rows.
# 4: DeepSeek-V4's lean session log.
RECORD_GEOMETRY_OF_VERSION: dict[int, type[KVGeometry] | type[RowsGeometry]] = {2: KVGeometry, 3: RowsGeometry}
GEOMETRY_OF_VERSION: dict[int, type[KVGeometry] | type[RowsGeometry] | type[LeanGeometry]] = {
    **RECORD_GEOMETRY_OF_VERSION,
    4: LeanGeometry,
}


def make_geometry(version: int, fields: dict[str, Any], dtype: str) -> AnyGeometry:
    """The geometry of ``version`` from a family's record fields (engine/families.py) and a record dtype;
    a lean one gets its snapshot interval from its sizes (LeanGeometry.sized)."""
    if version == LeanGeometry.FORMAT_VERSION:
        return LeanGeometry.sized(dtype=dtype, **fields)
    return RECORD_GEOMETRY_OF_VERSION[version](**fields, dtype=dtype)


def geometry_of_header(header: dict[str, Any], path: Path) -> Geometry:
    """The record geometry a decoded header describes (a file of one record per position), or FormatError."""
    geometry = log_geometry_of_header(header, path)
    if isinstance(geometry, LeanGeometry):
        raise FormatError(f"{path}: a lean session log (format 4), not a file of one record per position")
    return geometry


def log_geometry_of_header(header: dict[str, Any], path: Path) -> AnyGeometry:
    """The geometry a decoded header describes (its kind from the format version), or FormatError."""
    fields: Any = header.get("geometry")  # JSON; a malformed value raises KeyError/TypeError below
    try:
        if header["format_version"] == LeanGeometry.FORMAT_VERSION:
            entries = tuple(tuple(series) for series in fields["entries"])
            windows = tuple(tuple(series) for series in fields["windows"])
            return LeanGeometry(**{**fields, "entries": entries, "windows": windows})
        if header["format_version"] == RowsGeometry.FORMAT_VERSION:
            layers = tuple(tuple(layer) for layer in fields["layer_rows"])
            return RowsGeometry(**{**fields, "layer_rows": layers})
        return KVGeometry(**{**fields, "index_layers": tuple(fields["index_layers"])})
    except (KeyError, TypeError) as exc:
        raise FormatError(f"{path}: KV log geometry is malformed ({exc!r})") from None
