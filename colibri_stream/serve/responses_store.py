"""Stored responses (the Responses API's ``store``, ``previous_response_id`` and ``GET /v1/responses/{id}``),
kept in memory and bounded: at most MAX_STORED_RESPONSES responses and MAX_STORED_BYTES of their JSON
(the response object plus its conversation), the oldest evicted first. A response is visible only to
the API key that made it (another key, or none, gets "not found"). Nothing survives a restart: a
client continuing a conversation after one resends it whole (as Codex does with ``store: false``), and
the prefix cache still finds its prompt.

Used on the event loop only (the routes), so no lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 256
MAX_STORED_BYTES = 64 * 2**20  # UTF-8 JSON bytes of the stored responses and their conversations


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]  # the Response object as it was returned
    items: list[dict[str, Any]]  # the conversation as input items: earlier ones, this input, this output
    owner: bytes | None  # the API key that made it
    size: int  # bytes counted against MAX_STORED_BYTES


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._stored: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, rid: str, response: dict[str, Any], items: list[dict[str, Any]], owner: bytes | None) -> bool:
        """Store a response (evicting the oldest to make room); False when it alone is over the byte bound."""
        size = _json_bytes(response) + _json_bytes(items)
        if size > self.max_bytes:
            return False
        self._drop(rid)
        while self._stored and (len(self._stored) >= self.max_responses or self.bytes + size > self.max_bytes):
            self._drop(next(iter(self._stored)))
            self.evicted += 1
        self._stored[rid] = Stored(response, items, owner, size)
        self.bytes += size
        return True

    def get(self, rid: str, owner: bytes | None) -> Stored | None:
        stored = self._stored.get(rid)
        return stored if stored is not None and stored.owner == owner else None

    def delete(self, rid: str, owner: bytes | None) -> bool:
        if self.get(rid, owner) is None:
            return False
        self._drop(rid)
        return True

    def _drop(self, rid: str) -> None:
        stored = self._stored.pop(rid, None)
        if stored is not None:
            self.bytes -= stored.size


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
