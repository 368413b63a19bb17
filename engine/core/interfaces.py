"""The two interfaces every model family implements: its model (``Model``) and its KV cache (``Cache``).

Generation, sessions, batching and serving drive any family through these alone; what differs between
families beyond them (the log record's layout, memory estimates, the swiglu clamp) is a ``Family``
(engine/families.py), chosen once per config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
from torch import nn

from engine.config.args import ModelArgs
from engine.core.cache import DraftCache
from engine.core.sources import Experts


class CacheLog(Protocol):
    """A cache as a log reads and frees it (``Cache.log_view``; engine/core/cache.py KVCacheLog,
    engine/v4/cache.py V4CacheLog). Per position the cache holds rows a prefix block stores (``rows``, in
    the family's record order; rebuilt by Family.cache_from_log) and what a session's log appends
    (``entries``, plus ``window`` at its snapshots: Family.session_log_record)."""

    # whether the cache frees rows once a log holds them (``release``): a session then logs a long prompt
    # chunk by chunk, so its rows need not all be held to the end of the turn
    frees_rows: ClassVar[bool]

    def rows(self, start: int, end: int) -> list[torch.Tensor]:
        """Positions start..end of batch row 0 as a record holds them: [end - start, width] per row."""
        ...

    def entries(self, start: int, end: int) -> list[torch.Tensor]:
        """What positions start..end of batch row 0 add to a session's log: [n, width] per series. MLA: its
        rows; DeepSeek-V4: the compressed entries of the windows those positions close."""
        ...

    def window(self, position: int) -> list[torch.Tensor]:
        """The fixed-size state at ``position`` a session's log snapshots beside the entries: [n, width] per
        series. MLA: none; DeepSeek-V4: the sliding window's and the open compressor windows' rows
        (RowsReleased if freed: a session asks for them before its log moves past them)."""
        ...

    def release(self, logged: int) -> None:
        """The first ``logged`` positions are in a log as held here (0: none): rows kept only for a log
        may be freed before there."""
        ...

    def round_to(self, dtype: torch.dtype) -> None:
        """Round the held positions in place to what a log of ``dtype`` records holds, so a turn that
        continues from memory computes what one restored from the log would."""
        ...


class Cache(Protocol):
    """A batch of sequences' attention state, ``length`` positions long (engine/core/cache.py KVCache for MLA
    models, engine/v4/cache.py V4Cache for DeepSeek-V4). What a log asks of it is apart: ``log_view``."""

    @property
    def length(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def trim(self, length: int) -> None:
        """Forget every position from ``length`` on (engine.v4.position_rows.RowsReleased if the rows that
        needs were freed)."""
        ...

    def log_view(self) -> CacheLog:
        """This cache as a log reads and frees it (a view: it holds no state of its own)."""
        ...


CacheT = TypeVar("CacheT", bound=Cache)


class Model(nn.Module, ABC, Generic[CacheT]):
    """A family's whole forward pass (engine/mla/model.py Transformer, engine/v4/model.py V4Transformer),
    routed experts coming from an expert source (engine/core/sources.py)."""

    # forward_prompt reads a prompt's chunks layer by layer (engine/mla/model.py); False: chunk by chunk, so a
    # cache that frees rows (DeepSeek-V4's) can release them between chunks
    prompt_in_windows: ClassVar[bool] = False
    args: ModelArgs
    int8_activations: bool  # the kernel matmuls quantise their inputs (engine/kernels/q8.py; lossy, opt-in)
    read_ahead: bool  # decode reads the next weights into the CPU caches (engine/kernels/read_ahead.py)

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def new_cache(self, batch: int = 1) -> CacheT: ...

    @abstractmethod
    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: int,
        cache: CacheT,
        experts: Experts,
        absorb: bool | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """tokens [B, S] at positions start_pos.. -> float32 logits [B, S, vocab] (S=1 if last_only).
        Appends the S positions to ``cache``; ``absorb`` forces MLA's attention path (None: automatic)."""

    def forward_prompt(
        self, tokens: torch.Tensor, start_pos: int, cache: CacheT, experts: Experts, chunk: int, last_only: bool = False
    ) -> torch.Tensor:
        """``forward`` of tokens [B, S] in chunks of ``chunk`` positions, one after another: the same logits
        as those forwards (the last one's only if ``last_only``) and the same cache. Here chunk by chunk; a
        family with ``prompt_in_windows`` reads them layer by layer."""
        logits = [
            self.forward(part, start_pos + i * chunk, cache, experts, last_only=last_only)
            for i, part in enumerate(tokens.split(chunk, dim=1))
        ]
        return logits[-1] if last_only else torch.cat(logits, dim=1)

    def forward_prompts(self, chunks: list[torch.Tensor], caches: list[CacheT], experts: Experts) -> list[torch.Tensor]:
        """Prompt chunks of several sequences, chunks[i] [1, S_i] at the end of caches[i] -> each one's float32
        logits of its last position [1, 1, vocab]: what ``forward(..., last_only=True)`` gives each alone, and
        the same caches. Here one after another; a family may compute them in one pass."""
        return [
            self.forward(chunk, cache.length, cache, experts, last_only=True)
            for chunk, cache in zip(chunks, caches, strict=True)
        ]

    @abstractmethod
    def forward_rows(self, tokens: list[int], caches: list[CacheT], experts: Experts) -> torch.Tensor:
        """Decode one token for each of B independent sequences (tokens[b] at the end of caches[b]) in one
        pass -> float32 logits [B, vocab]; each row computed exactly as ``forward`` computes it alone."""

    @abstractmethod
    def read_ahead_bytes(self, experts_per_token: int, expert_bytes: int) -> int | None:
        """The most bytes one read-ahead request names (kernels/read_ahead.py); None: this model never reads ahead."""

    def drafter(self) -> Drafter | None:
        """The model as a drafter, where it has multi-token-prediction modules loaded; None: it does not draft."""
        return None

    def hold_kv_b_int8(self, codes: Mapping[str, tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """Keep the int8 records (codes [out, in], scales, group size) of the attention modules named in
        ``codes`` beside their float wkv_b, for decode attention. A family without wkv_b gets none."""
        if codes:
            raise ValueError(f"{type(self).__name__} has no wkv_b to hold int8 records of: {sorted(codes)}")


class Drafter(Protocol):
    """A model that drafts tokens with a multi-token-prediction module and verifies them in one pass
    (engine/mla/model.py Transformer, engine/v4/model.py V4Transformer, with their MTP modules loaded)."""

    def forward_rows_hidden(
        self, tokens: list[int], caches: list[Any], experts: Experts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Model.forward_rows -> (logits [B, vocab], hidden states before the head's norm: [B, dim], DeepSeek-V4's
        hyper-connection streams [B, n, dim]); rows on the same cache (consecutive positions of one sequence)
        each get the bits of their own decode step."""
        ...

    def new_draft_cache(self) -> DraftCache[Any]: ...

    def draft(
        self,
        hidden: torch.Tensor,
        tokens: list[int],
        position: int,
        cache: DraftCache[Any],
        experts: Experts,
        depth: int,
    ) -> list[int]:
        """``depth`` drafted tokens after the pairs (hidden [S, ...] = h_i, tokens[s] = t_{i+1}) of positions
        i = position.. ; the first is the token after tokens[-1]."""
        ...


def row_positions(caches: Sequence[Cache]) -> list[int]:
    """Each row's position: its cache's length, plus the earlier rows on the same cache (a verify step)."""
    earlier: dict[int, int] = {}
    positions = []
    for cache in caches:
        before = earlier.get(id(cache), 0)
        positions.append(cache.length + before)
        earlier[id(cache)] = before + 1
    return positions
