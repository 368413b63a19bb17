"""The routing trace, streamed: one JSON line per acquire, {"layer": L, "experts": [...]}.

A long-running server acquires experts millions of times, so the trace never accumulates in memory:
lines are buffered up to ``buffer_lines`` and written out, and each turn's end flushes the rest.
storage.simulate reads these files back (policies vs Belady).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


class TraceWriter:
    def __init__(self, path: str | Path, buffer_lines: int = 1024):
        self.path = Path(path)
        self.buffer_lines = buffer_lines
        self.pending: list[str] = []
        self.written = 0  # lines handed to the file so far
        self._file = open(self.path, "w")  # noqa: SIM115 - open for the writer's lifetime, closed by close()

    def write(self, layer: int, expert_ids: Sequence[int]) -> None:
        self.pending.append(json.dumps({"layer": layer, "experts": [int(e) for e in expert_ids]}))
        if len(self.pending) >= self.buffer_lines:
            self._drain()

    def _drain(self) -> None:
        if self.pending:
            self._file.write("\n".join(self.pending) + "\n")
            self.written += len(self.pending)
            self.pending.clear()

    def flush(self) -> None:
        """Everything written so far is in the file (end of a turn)."""
        if not self._file.closed:
            self._drain()
            self._file.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()
