"""The front door of KV persistence: a turn hands its prompt's ids to ``KVState.restore`` and gets a
``RestoredPrefix`` back, and hands the cache with every position's id to ``KVState.commit``; nothing else
of colibri_stream/runtime/kv/ is the turn's business (the words: __init__.py).

    Persistence (one per model)      where its sessions live, the prefix cache, what values depend on
      .open(session, reset, pool,    -> KVState: the session locked (taken from the pool, or its log opened),
            tenant)                     and whose prefixes the turn sees (None: no API key's, or shared)
    KVState (one per turn)
      .restore(prompt_ids)           the longest reusable prefix: the session's (pool memory or log), else
                                     the prefix cache's blocks when they hold more of the prompt
      .prompt_chunk_hook(cache, ids) what runs between prompt chunks of a cache that frees logged rows
      .sync(cache, ids)              the session's log appended so far (``sync_every``)
      .commit(cache, ids, pool)      blocks remembered, log appended (fsynced), session kept in the pool
      .abort()                       nothing persisted, the session closed

Only this room asks both sources; the session's log and the prefix cache never see each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# ``X as X``: names a caller of the door needs, re-exported so the turn imports this module only
from colibri_stream.runtime.kv.pool import HeldSession
from colibri_stream.runtime.kv.pool import SessionPool as SessionPool
from colibri_stream.runtime.kv.prefix_cache import BLOCK_TOKENS
from colibri_stream.runtime.kv.prefix_cache import PrefixCache as PrefixCache
from colibri_stream.runtime.kv.records import RestoredPrefix as RestoredPrefix
from colibri_stream.runtime.kv.sessions import DEFAULT_ACTIVATIONS, Session, session_state
from colibri_stream.runtime.kv.sessions import default_kv_dir as default_kv_dir
from engine.config.args import ModelArgs
from engine.core.interfaces import Cache
from storage.kv.prefix_store import PrefixConfig

# activation paths whose prompts compute a position otherwise than decoding it (a prompt's rows as tile GEMMs,
# engine/csrc/q8_tiles.h): their prefix blocks hold prompt positions only
PROMPTS_COMPUTE_OTHERWISE = frozenset({"int8-tiles"})


@dataclass
class Persistence:
    """One model's KV persistence: its sessions' logs under ``kv_dir`` and the shared prefix cache (None: off).
    ``compute_dtype`` and ``activations`` are what the stored values depend on beyond the model (a log or
    block of another one is refused or another block)."""

    kv_dir: Path
    fingerprint: str
    args: ModelArgs
    new_cache: Callable[[], Cache]
    dtype: torch.dtype  # the compute dtype a restored cache computes in
    record_dtype: str = "float32"
    activations: str = DEFAULT_ACTIVATIONS
    prefix: PrefixCache | None = None
    shared_prefix: bool = False  # every tenant's turns see one namespace of prefixes (PrefixConfig.shared)

    @property
    def compute_dtype(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @classmethod
    def of(
        cls,
        kv_dir: Path,
        fingerprint: str,
        args: ModelArgs,
        new_cache: Callable[[], Cache],
        dtype: torch.dtype,
        record_dtype: str,
        activations: str,
        prefix: PrefixConfig,
    ) -> Persistence:
        """With the prefix cache opened when ``prefix`` enables it (blocks computed in another dtype or on
        another activation path are other blocks)."""
        made = cls(kv_dir, fingerprint, args, new_cache, dtype, record_dtype, activations, shared_prefix=prefix.shared)
        if prefix.enabled:
            state = session_state(made.compute_dtype, activations)
            made.prefix = PrefixCache.open(kv_dir, fingerprint, args, record_dtype, state, prefix)
        return made

    def open(
        self,
        session: str | None,
        reset: bool = False,
        pool: SessionPool | None = None,
        reuse_prefix: bool = True,
        tenant: str | None = None,
    ) -> KVState:
        """A turn's KVState: ``session`` taken from ``pool`` (its KV still in memory: nothing read) or its log
        opened and locked (``reset``: started over, a damaged header included); None: no session.
        ``reuse_prefix`` False: a turn without a session restores nothing from the prefix cache (prompt
        logprobs: every position computed). ``tenant``: whose prefixes it restores and remembers (an id
        derived from the request's API key; None without keys), unless the prefix cache is shared."""
        tenant = None if self.shared_prefix else tenant
        if session is None:
            return KVState(self, None, reuse_prefix=reuse_prefix, tenant=tenant)
        held = pool.take(session) if pool is not None else None
        if held is not None:
            if reset:
                held.session.reset()
                held.cache.trim(0)
                held.ids.clear()
            return KVState(self, held.session, held, tenant=tenant)
        opened = Session(
            self.kv_dir,
            session,
            self.fingerprint,
            self.args,
            self.record_dtype,
            compute_dtype=self.compute_dtype,  # recorded: another one is refused
            reset=reset,
            activations=self.activations,
        )
        return KVState(self, opened, tenant=tenant)


@dataclass
class KVState:
    """One turn's persistence, between ``Persistence.open`` and ``commit`` / ``abort``: its session (locked;
    ``held``: taken from the pool with its cache) and the model's prefix cache, of which it sees ``tenant``'s
    blocks only."""

    door: Persistence
    session: Session | None
    held: HeldSession | None = None
    reuse_prefix: bool = True
    tenant: str | None = None

    @property
    def prefix(self) -> PrefixCache | None:
        return self.door.prefix

    def restore(self, prompt_ids: list[int]) -> RestoredPrefix:
        """The cache holding the longest reusable prefix of ``prompt_ids`` (at least one token left to run):
        a held session's memory; else the session's log, or the prefix cache's run of blocks when that holds
        more of the prompt (the log is then started over: at the end of the turn, or of each prompt chunk,
        it is written from the restored cache, and what it held is in the prefix cache's blocks)."""
        if self.held is not None:
            return self.held.session.continue_turn(self.held.cache, self.held.ids, prompt_ids)
        logged = self.session.start_turn(prompt_ids, self.door.dtype) if self.session is not None else None
        reused = logged.reused_tokens if logged is not None else 0
        prefix = self.prefix if self.reuse_prefix else None
        hit = prefix.lookup(prompt_ids, more_than=reused, tenant=self.tenant) if prefix is not None else None
        if prefix is None or hit is None:
            return logged if logged is not None else RestoredPrefix(self.door.new_cache(), 0)
        if self.session is not None:
            self.session.reset()
        cache = prefix.restore(hit, self.door.dtype)
        cache.log_view().release(0)  # nothing of it is logged yet: the rows stay until the log (or we) take them
        load_s = hit.load_s + (logged.kv_load_s if logged is not None else 0.0)
        return RestoredPrefix(cache, hit.tokens, load_s, hit.ram_tokens, hit.disk_tokens)

    def prompt_chunk_hook(self, cache: Cache, prompt_ids: Sequence[int]) -> Callable[[], object] | None:
        return prompt_chunk_hook(self.prefix, self.session, cache, prompt_ids, self.tenant)

    def sync(self, cache: Cache, ids: list[int]) -> None:
        """Append the positions computed so far (``ids[i]``: the token at position i) to the session's log."""
        if self.session is not None:
            self.session.end_turn(cache, ids)

    def commit(self, cache: Cache, ids: list[int], pool: SessionPool | None = None, prompt: int | None = None) -> None:
        """Remember the cache's whole blocks in the prefix cache (before the log takes the rows a cache then
        frees), append the positions the log lacks (fsynced), then keep the session with its KV in ``pool``
        for the next turn, or close it. ``prompt``: how many of ``ids`` the turn read as its prompt; on an
        activation path whose prompts compute a position otherwise than decoding does, only those are
        remembered, so a later hit gives what recomputing them as a prompt gives."""
        if self.prefix is not None:
            decoded_differ = prompt is not None and self.door.activations in PROMPTS_COMPUTE_OTHERWISE
            self.prefix.remember(cache, ids[:prompt] if decoded_differ else ids, self.tenant)
        if self.session is None:
            return
        try:
            self.session.end_turn(cache, ids)
        except BaseException:
            self.session.close()
            raise
        if pool is not None:
            pool.put(self.session, cache, ids[: cache.length])
        else:
            self.session.close()

    def abort(self) -> None:
        """A turn that failed: nothing of it is persisted (its cache may be half-appended)."""
        if self.session is not None:
            self.session.close()


def prompt_chunk_hook(
    prefix: PrefixCache | None,
    session: Session | None,
    cache: Cache,
    prompt_ids: Sequence[int],
    tenant: str | None = None,
) -> Callable[[], object] | None:
    """What runs after each prompt chunk but the last, for a cache that frees rows once they are kept
    elsewhere (DeepSeek-V4's, engine/v4/position_rows.py): the chunk's whole blocks are remembered and its
    positions logged, so the cache releases their rows instead of holding a long prompt's rows to the end
    of the turn. None for other caches (or with nothing to keep the rows)."""
    log = cache.log_view()
    if not log.frees_rows or (session is None and prefix is None):
        return None
    if session is None:
        assert prefix is not None
        log.release(0)  # keep every row until its block is remembered

        def remember_then_release() -> None:
            prefix.remember(cache, prompt_ids, tenant)
            log.release(cache.length // BLOCK_TOKENS * BLOCK_TOKENS)

        return remember_then_release

    def remember_then_log() -> None:
        if prefix is not None:
            prefix.remember(cache, prompt_ids, tenant)
        session.end_turn(cache, list(prompt_ids))

    return remember_then_log
