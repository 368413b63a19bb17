"""The prefix cache: the KV of token prefixes, shared by every request and every session of one model,
in RAM and in the KV directory (storage/kv/prefix_store.py), across restarts.

A prompt is cut into blocks of ``BLOCK_TOKENS`` positions. Block k's key is a hash chain over the
namespace (model fingerprint, record geometry, and the state the values depend on: compute dtype and
activation path) and every token up to the block's end, so a key names one whole prefix of one model
computed one way: a block of another model, dtype or activation path has another key, and its header
is checked on top (storage/kv/prefix_blocks.py). A turn restores the longest run of blocks the prompt
starts with (at least one position is left to compute: it gives the first token's logits), and after
it the positions it computed are remembered as whole blocks. The records are the session log's
(records.py cache_payloads / cache_from_payloads), so a restored prefix computes what a restored session
would. It never sees a session: the front door (front.py) chooses between the two.

Tenants: with API keys, each key's prefixes are its own. A ``tenant`` (an id the server derives from the
key, never the key: serve/auth.py) is folded into the root of the hash chain, so another key's blocks have
other keys: they are simply not found (no cached tokens, and nothing read that takes longer), and the
tenant is recorded in the block's header. Tenant None is the one namespace of a server without keys (or one
that shares on purpose, ``PrefixConfig.shared``: the front door then passes None for every key).

An agent's stateless requests each resend the whole conversation: the next request starts with the
last one's prompt and answer, so all of it but the new message (and the block it ends in) is restored.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from colibri_stream.planning.kv_bytes import kv_geometry
from colibri_stream.runtime.kv.records import cache_from_payloads, cache_payloads
from engine.config.args import ModelArgs
from engine.core.interfaces import Cache
from engine.v4.position_rows import RowsReleased
from storage.kv.prefix_blocks import Block, Namespace
from storage.kv.prefix_store import PrefixConfig, PrefixStore, PrefixUsage

# Positions per block: the most a request recomputes past its last cached block. Small enough that a
# new message costs little, large enough that a 30k-token prompt is a few hundred files.
BLOCK_TOKENS = 64
PREFIX_DIR = "prefix"  # under the model's KV directory
TENANT_DOMAIN = b"colibri-stream prefix tenant\x00"  # a key's tenant id is no other digest of it


@dataclass(frozen=True)
class PrefixHit:
    """The restored run of blocks: ``tokens`` positions (``ram_tokens`` of them found in RAM, the rest on
    disk) as record payloads [tokens, payload_bytes] uint8."""

    tokens: int
    ram_tokens: int
    disk_tokens: int
    payloads: np.ndarray
    load_s: float


class PrefixCache:
    """One model's prefix cache for one state (the compute dtype and activation path of this runtime)."""

    def __init__(self, store: PrefixStore, args: ModelArgs):
        self.store = store
        self.args = args
        self.geometry = store.namespace.geometry
        self._root = _namespace_digest(store.namespace)

    @classmethod
    def open(
        cls,
        kv_dir: Path,
        fingerprint: str,
        args: ModelArgs,
        record_dtype: str,
        state: dict[str, str],
        config: PrefixConfig,
    ) -> PrefixCache:
        namespace = Namespace.of(fingerprint, kv_geometry(args, record_dtype), state)
        return cls(PrefixStore(namespace, kv_dir / PREFIX_DIR, config.ram_bytes, config.disk_bytes), args)

    def block_keys(self, ids: Sequence[int], positions: int, tenant: str | None = None) -> list[str]:
        """The keys of ``tenant``'s whole blocks within ids[:positions]."""
        keys, digest = [], tenant_root(self._root, tenant)
        for end in range(BLOCK_TOKENS, min(positions, len(ids)) + 1, BLOCK_TOKENS):
            block = np.asarray(ids[end - BLOCK_TOKENS : end], dtype="<u4").tobytes()
            digest = hashlib.sha256(digest + block).digest()
            keys.append(digest.hex())
        return keys

    def lookup(self, prompt_ids: Sequence[int], more_than: int = 0, tenant: str | None = None) -> PrefixHit | None:
        """The longest run of ``tenant``'s cached blocks ``prompt_ids`` starts with, leaving at least its last
        token to compute; None unless it holds more than ``more_than`` positions (what a session's log already
        has)."""
        start = time.perf_counter()
        keys = self.block_keys(prompt_ids, len(prompt_ids) - 1, tenant)
        if len(keys) * BLOCK_TOKENS <= more_than:
            return None
        found: list[Block] = []
        ram = 0
        for index, key in enumerate(keys):
            got = self.store.get(key)
            if got is None or not _holds(got[0], prompt_ids, index * BLOCK_TOKENS, tenant):
                break
            found.append(got[0])
            ram += BLOCK_TOKENS if got[1] == "ram" else 0
        tokens = len(found) * BLOCK_TOKENS
        if tokens <= more_than:
            return None
        payloads = np.concatenate([block.payloads for block in found])
        return PrefixHit(tokens, ram, tokens - ram, payloads, time.perf_counter() - start)

    def restore(self, hit: PrefixHit, dtype: torch.dtype) -> Cache:
        return cache_from_payloads(hit.payloads, self.geometry, self.args, dtype)

    def remember(self, cache: Cache, ids: Sequence[int], tenant: str | None = None) -> int:
        """Keep the whole blocks of the cache's positions (``ids[i]``: the token at position i) that are
        not held yet, as ``tenant``'s; returns how many were added. Rows a cache already released
        (DeepSeek-V4's, once logged) are skipped: their blocks were remembered before the release."""
        added = 0
        for index, key in enumerate(self.block_keys(ids, cache.length, tenant)):
            if self.store.contains(key):
                continue
            first = index * BLOCK_TOKENS
            try:
                payloads = cache_payloads(cache, first, first + BLOCK_TOKENS, self.geometry)
            except RowsReleased:
                continue
            tokens = np.asarray(ids[first : first + BLOCK_TOKENS], dtype=np.uint32)
            self.store.put(key, Block(first, tokens, payloads, tenant or ""))
            added += 1
        return added

    def usage(self) -> PrefixUsage:
        return self.store.usage()


def tenant_of_key(key: bytes) -> str:
    """The tenant of API key ``key``: 32 hex digits of a domain-separated SHA-256 of it (what block headers
    record: never the key itself). ``serve`` derives each request's from its key, ``kv import --key-file``
    the namespace a pack goes into."""
    return hashlib.sha256(TENANT_DOMAIN + key).hexdigest()[:32]


def tenant_root(root: bytes, tenant: str | None) -> bytes:
    """The root of ``tenant``'s hash chain: the namespace's own for None (a server without keys), else one
    no other tenant's chain starts from."""
    if tenant is None:
        return root
    return hashlib.sha256(root + b"\x00tenant\x00" + tenant.encode()).digest()


def _holds(block: Block, ids: Sequence[int], first: int, tenant: str | None) -> bool:
    """Whether ``block`` is ``tenant``'s positions first.. of ``ids`` (the key already says so; this makes a
    hash collision a miss, not another prompt's or tenant's KV)."""
    wanted = np.asarray(ids[first : first + block.length], dtype=np.int64)
    same = block.first == first and block.tenant == (tenant or "")
    return same and np.array_equal(block.tokens.astype(np.int64), wanted)


def _namespace_digest(namespace: Namespace) -> bytes:
    described = {
        "fingerprint": namespace.fingerprint,
        "geometry": asdict(namespace.geometry),
        "geometry_version": namespace.geometry.FORMAT_VERSION,
        "state": dict(namespace.state),
        "block_tokens": BLOCK_TOKENS,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).digest()
