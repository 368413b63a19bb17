"""A session's log as the session drives it: restore the cache at a position, append what a cache adds.

Two kinds, chosen once by the family's session record (engine/families.py Family.kv_log.session_log_record):
    RecordLog  one fixed-size record per position (storage/kv/log.py; MLA models, format 2): every position
               is a restore point, the cache is rebuilt from the records' rows;
    LeanLog    DeepSeek-V4's lean log (storage/kv/lean_log.py, format 4): the entries per position and snapshots
               of the window state; the restore points are the snapshots (every ``snapshot_every``
               positions and the log's end), and the caller re-prefills from there.
"""

from __future__ import annotations

from typing import Protocol, Self

import numpy as np
import torch

from colibri_stream.runtime.kv.records import as_bytes, cache_from_payloads, cache_payloads, from_bytes
from engine.config.args import ModelArgs
from engine.core.interfaces import Cache
from engine.families import family_of
from storage.kv.geometry import AnyGeometry, LeanGeometry
from storage.kv.lean_log import LeanLog
from storage.kv.log import KVLog


class SessionLog(Protocol):
    """What a Session asks of its log; ``length``: the positions it holds."""

    @property
    def length(self) -> int: ...

    def common_prefix(self, token_ids: list[int]) -> int:
        """How many leading positions hold exactly ``token_ids``' first tokens."""
        ...

    def restore_point(self, limit: int) -> int:
        """The last position at or before ``limit`` whose state the log restores exactly."""
        ...

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on (a restore point)."""
        ...

    def restore(self, position: int, dtype: torch.dtype) -> Cache:
        """The cache of positions 0..position-1 (a restore point), computing in ``dtype``."""
        ...

    def append_from(self, cache: Cache, token_ids: list[int], bookmark: int | None = None) -> None:
        """Log the cache's positions length..cache.length, those whose token is known (token_ids[i]: the token
        at position i; a drafting step's cache may hold rows ahead of the tokens taken so far); fsync.
        ``bookmark``: a position (the turn's last prompt position) whose state a lean log keeps too, so
        the turn's answer can be regenerated or edited from there."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


class RecordLog:
    """A log of one record per position (storage/kv/log.py KVLog)."""

    def __init__(self, log: KVLog, args: ModelArgs):
        self.file, self.args = log, args

    @property
    def length(self) -> int:
        return self.file.length

    def common_prefix(self, token_ids: list[int]) -> int:
        return self.file.common_prefix(token_ids)

    def restore_point(self, limit: int) -> int:
        return min(limit, self.file.length)

    def truncate(self, length: int) -> None:
        self.file.truncate(length)

    def restore(self, position: int, dtype: torch.dtype) -> Cache:
        _, payloads = self.file.read(position)
        return cache_from_payloads(payloads, self.file.geometry, self.args, dtype)

    def append_from(self, cache: Cache, token_ids: list[int], bookmark: int | None = None) -> None:
        start, end = self.file.length, min(cache.length, len(token_ids))
        tokens = np.asarray(token_ids[start:end], dtype=np.uint32)
        self.file.append(tokens, cache_payloads(cache, start, end, self.file.geometry))

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LeanSessionLog:
    """DeepSeek-V4's lean log (storage/kv/lean_log.py LeanLog): CacheLog.entries per position, CacheLog.window
    at the snapshots; restored with Family.kv_log.cache_from_snapshot."""

    def __init__(self, log: LeanLog, args: ModelArgs):
        self.file, self.args = log, args

    @property
    def length(self) -> int:
        return self.file.length

    def common_prefix(self, token_ids: list[int]) -> int:
        return self.file.common_prefix(token_ids)

    def restore_point(self, limit: int) -> int:
        return self.file.restore_point(limit)

    def truncate(self, length: int) -> None:
        self.file.truncate(length)

    def restore(self, position: int, dtype: torch.dtype) -> Cache:
        geometry = self.file.geometry
        entries = [
            from_bytes(rows, geometry.dtype, width)
            for rows, (width, _) in zip(self.file.read_entries(position), geometry.entries, strict=True)
        ]
        window = [
            from_bytes(rows, geometry.dtype, width)
            for rows, (width, _, _) in zip(self.file.read_snapshot(position), geometry.windows, strict=True)
        ]
        return family_of(self.args).kv_log.cache_from_snapshot(entries, window, position, dtype)

    def append_from(self, cache: Cache, token_ids: list[int], bookmark: int | None = None) -> None:
        start, end, dtype = self.file.length, min(cache.length, len(token_ids)), self.file.geometry.dtype
        tokens = np.asarray(token_ids[start:end], dtype=np.uint32)
        entries = [as_bytes(rows, dtype) for rows in cache.log_view().entries(start, end)]
        due = self.file.snapshots_due(end)
        marked = [bookmark] if bookmark is not None and start < bookmark < end and bookmark not in due else []
        windows = {at: [as_bytes(rows, dtype) for rows in cache.log_view().window(at)] for at in [*due, *marked]}
        self.file.append(tokens, entries, windows, bookmark)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_log(
    path: str, fingerprint: str, geometry: AnyGeometry, args: ModelArgs, state: dict[str, str], fresh: bool
) -> SessionLog:
    """The log of the kind ``geometry`` is written in (storage's errors pass through)."""
    if isinstance(geometry, LeanGeometry):
        return LeanSessionLog(LeanLog(path, fingerprint, geometry, state=state, fresh=fresh), args)
    return RecordLog(KVLog(path, fingerprint, geometry, state=state, fresh=fresh), args)
