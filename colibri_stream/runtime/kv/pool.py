"""Sessions kept open between turns with their KV in memory (the server's): a conversation's next
request continues from memory, reading nothing; its log stays the durable copy (every turn's positions
are appended and fsynced) for restarts. At most ``capacity`` are held; the least recently used is
closed first (its next turn reads the log again, as after a restart)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from colibri_stream.runtime.kv.sessions import Session
from engine.core.interfaces import Cache


@dataclass
class HeldSession:
    session: Session  # open: its log's lock is held
    cache: Cache  # the log's positions, as logged (as_logged)
    ids: list[int]  # the token at each of those positions


class SessionPool:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"a session pool holds >= 0 sessions, not {capacity}")
        self.capacity = capacity
        self._held: OrderedDict[str, HeldSession] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def take(self, name: str) -> HeldSession | None:
        """The session named ``name`` if held (it leaves the pool while its turn runs)."""
        return self._held.pop(name, None)

    def put(self, session: Session, cache: Cache, ids: list[int]) -> None:
        """Hold a session after its turn (its log already has every position of ``cache``)."""
        if self.capacity == 0:
            session.close()
            return
        as_logged(cache, session.geometry.dtype)
        self._held[session.name] = HeldSession(session, cache, list(ids))
        while len(self._held) > self.capacity:
            _, oldest = self._held.popitem(last=False)
            oldest.session.close()

    def close(self) -> None:
        while self._held:
            _, held = self._held.popitem()
            held.session.close()


def as_logged(cache: Cache, record_dtype: str) -> None:
    """Round the cache's valid positions in place to what its log holds (bf16 records), so a turn that
    continues from memory computes what one restored from the log would."""
    if record_dtype != "bfloat16":
        return
    with torch.inference_mode():  # the cache's buffers were made by the forward pass, in inference mode
        cache.log_view().round_to(torch.bfloat16)
