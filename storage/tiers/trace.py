"""The routing trace, streamed: one JSON line per acquire, {"layer": L, "experts": [...]}.

A long-running server acquires experts millions of times, so the trace never accumulates in memory:
lines are buffered up to ``buffer_lines`` and written out, and each turn's end flushes the rest.
``read_acquires`` streams a file back the same way (storage.tiers.simulate: policies vs Belady): one line at
a time, each at most ``MAX_LINE_BYTES``, so a trace that is one endless line (a sparse file, /dev/zero)
fails at its first line instead of filling memory; a bad line is a FormatError naming file and line.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeGuard

from storage.errors import FormatError, disk_error
from storage.files.safe_read import decode_utf8, open_for_writing, open_regular, parse_json

logger = logging.getLogger(__name__)
# One acquire: a layer and the experts routed to (top-k of at most a few hundred): ~2 KB; 64 KiB is ample.
MAX_LINE_BYTES = 64 << 10


class TraceWriter:
    def __init__(self, path: str | Path, buffer_lines: int = 1024):
        self.path = Path(path)
        self.buffer_lines = buffer_lines
        self.pending: list[str] = []
        self.written = 0  # lines handed to the file so far
        self.stopped: str | None = None  # why tracing stopped (a full disk), if it did
        # a FIFO, directory or device (/dev/full) is refused in one line, before it can block or fail a turn
        self._file = os.fdopen(open_for_writing(self.path, "routing trace"), "w")  # closed by close()

    def write(self, layer: int, expert_ids: Sequence[int]) -> None:
        if self.stopped is not None:
            return
        self.pending.append(json.dumps({"layer": layer, "experts": [int(e) for e in expert_ids]}))
        if len(self.pending) >= self.buffer_lines:
            self._drain()

    def _drain(self) -> None:
        if self.pending:
            with self._stopping_on_disk_errors():
                self._file.write("\n".join(self.pending) + "\n")
                self.written += len(self.pending)
            self.pending.clear()

    def flush(self) -> None:
        """Everything written so far is in the file (end of a turn)."""
        if not self._file.closed:
            self._drain()
            with self._stopping_on_disk_errors():
                self._file.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()

    @contextmanager
    def _stopping_on_disk_errors(self) -> Iterator[None]:
        """A trace is a diagnostic: a full disk, a device error or a file that refuses lines stops tracing
        with one warning and the run goes on; the file keeps the lines written before (the last may be torn)."""
        try:
            yield
        except OSError as exc:  # a full or failing disk, or a file that takes no lines (/proc, EINVAL)
            error = disk_error(self.path, exc, "the routing trace")
            self.stopped = str(error or f"{self.path}: cannot write the routing trace ({exc.strerror})")
            logger.warning("%s; tracing stopped, the run goes on", self.stopped)
            self.pending.clear()
            with suppress(OSError):  # the buffered tail cannot be written either
                self._file.close()


def read_acquires(path: str | Path) -> Iterator[tuple[int, list[int]]]:
    """The (layer, experts) acquires of a trace file, in order, one line read at a time."""
    path = Path(path)
    with os.fdopen(open_regular(path, "routing trace"), "rb") as f:
        for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(raw) > MAX_LINE_BYTES:
                raise FormatError(f"{path}:{number}: trace line longer than {MAX_LINE_BYTES} bytes")
            text = decode_utf8(raw, path, "trace line", number)
            yield _acquire(parse_json(text, path, "trace line", number), text, path, number)


def _acquire(record: Any, text: str, path: Path, number: int) -> tuple[int, list[int]]:
    """A decoded line as (layer, expert ids): non-negative integers only (JSON also reads 1e300, NaN, true)."""
    experts = record.get("experts") if isinstance(record, dict) else None
    layer = record.get("layer") if isinstance(record, dict) else None
    if not _is_index(layer) or not isinstance(experts, list) or not all(_is_index(e) for e in experts):
        raise FormatError(
            f"{path}:{number}: not a trace line ({text.strip()[:60]!r}); "
            'expected {"layer": L, "experts": [ids]} of integers >= 0'
        )
    return layer, experts


def _is_index(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
