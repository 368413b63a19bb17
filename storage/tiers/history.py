"""Usage history: how often each (layer, expert) was routed to, persisted across runs.

It drives the learned hot store (the most-used experts are pinned in RAM) and ``plan``. Written
atomically (temp file + rename) after each turn, so a crash leaves the previous history intact.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path

from storage.errors import DiskFullError, DiskWriteError, FormatError, IncompatibleStateError
from storage.files.atomic import atomic_write_json
from storage.files.safe_read import check_output_path, read_json

logger = logging.getLogger(__name__)
HISTORY_FORMAT = "colibri-stream-usage-history"
HISTORY_VERSION = 1
# The file is read whole, so its size is capped by what a real history of this model can be: one count
# per (layer, expert), at most MAX_LAYERS layers, each count at most COUNT_BYTES of JSON ("12345.678, ").
MAX_LAYERS = 1024
COUNT_BYTES = 32
HEADER_BYTES = 64 << 10  # format, version, fingerprint, layer keys: generous


def max_history_bytes(n_experts: int) -> int:
    return HEADER_BYTES + MAX_LAYERS * max(1, n_experts) * COUNT_BYTES


class UsageHistory:
    def __init__(self, n_experts: int, fingerprint: str = "", counts: dict[int, list[float]] | None = None):
        self.n_experts = n_experts
        self.fingerprint = fingerprint  # the container this history belongs to
        self.counts: dict[int, list[float]] = counts or {}
        self._save_failed = False  # the last save hit a full disk (warned once until one succeeds)

    def record(self, layer: int, experts: Iterable[int]) -> None:
        row = self.counts.setdefault(layer, [0.0] * self.n_experts)
        for expert in experts:
            row[expert] += 1

    def hottest(self, n: int) -> list[tuple[int, int]]:
        """The n most-routed (layer, expert) keys, most used first (ties: lower layer, lower expert)."""
        ranked = sorted(
            ((count, layer, expert) for layer, row in self.counts.items() for expert, count in enumerate(row) if count),
            key=lambda item: (-item[0], item[1], item[2]),
        )
        return [(layer, expert) for _, layer, expert in ranked[:n]]

    def save(self, path: str | Path) -> None:
        atomic_write_json(
            path,
            {
                "format": HISTORY_FORMAT,
                "version": HISTORY_VERSION,
                "fingerprint": self.fingerprint,
                "n_experts": self.n_experts,
                "counts": {str(layer): row for layer, row in sorted(self.counts.items())},
            },
        )

    def save_or_warn(self, path: str | Path) -> bool:
        """``save``, except that a full disk (or a device error) warns once and the run goes on: the
        history only ranks experts for the hot store, so a turn is never lost to it. The file keeps the
        last history that was written; a later save, once there is space, brings it up to date."""
        try:
            self.save(path)
        except (DiskFullError, DiskWriteError) as exc:
            if not self._save_failed:
                logger.warning("%s; usage history not updated, the run goes on", exc)
            self._save_failed = True
            return False
        self._save_failed = False
        return True

    @classmethod
    def load(cls, path: str | Path, n_experts: int, fingerprint: str = "") -> UsageHistory:
        """Read a history file; a missing file is an empty history, a foreign one an error, and one that
        is not a regular file (a directory, a FIFO, /dev/zero) or too large for the model is refused."""
        path = Path(path)
        if not path.exists():
            check_output_path(path, "usage history")  # saved after every turn: its directory must be there
            return cls(n_experts, fingerprint)
        data = read_json(path, max_history_bytes(n_experts), "usage history")
        try:
            if data.get("format") != HISTORY_FORMAT or data.get("version") != HISTORY_VERSION:
                raise FormatError(f"{path}: not a usage history (format {data.get('format')!r} v{data.get('version')})")
            counts = {_layer(layer, path): [_count(c, path) for c in row] for layer, row in data["counts"].items()}
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise FormatError(f"{path}: unreadable usage history ({exc!r})") from None
        if data.get("fingerprint") != fingerprint or data.get("n_experts") != n_experts:
            raise IncompatibleStateError(f"{path}: usage history of another model; delete it or pick another path")
        if any(len(row) != n_experts for row in counts.values()):
            raise FormatError(f"{path}: a layer's counts do not list {n_experts} experts")
        return cls(n_experts, fingerprint, counts)


def _layer(key: str, path: Path) -> int:
    layer = int(key)
    if not 0 <= layer < MAX_LAYERS:
        raise FormatError(f"{path}: usage history layer {key!r} is outside 0..{MAX_LAYERS - 1}")
    return layer


def _count(value: object, path: Path) -> float:
    """A routing count: a finite number >= 0 (JSON reads NaN and Infinity too; booleans are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise FormatError(f"{path}: usage history count {value!r} is not a finite number >= 0")
    return float(value)
