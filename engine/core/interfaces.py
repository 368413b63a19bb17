"""What every model family implements: its model (``Model``) and its KV cache (``Cache``); generation,
sessions, batching and serving use only these. Other per-family differences: ``Family`` (engine/families.py).
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
from engine.kernels.modes import prompt_rows


class CacheLog(Protocol):
    """A cache as a log reads and frees it (``Cache.log_view``): prefix-block rows (``rows``) and a
    session log's appends (``entries``, plus ``window`` at snapshots)."""

    # the cache frees rows a log holds (``release``), so a session logs a long prompt chunk by chunk
    frees_rows: ClassVar[bool]

    def rows(self, start: int, end: int) -> list[torch.Tensor]:
        """Positions start..end of batch row 0 as a record holds them: [end - start, width] per row."""
        ...

    def entries(self, start: int, end: int) -> list[torch.Tensor]:
        """What positions start..end of batch row 0 add to a session's log: [n, width] per series (V4: the
        compressed entries of the windows they close)."""
        ...

    def window(self, position: int) -> list[torch.Tensor]:
        """The fixed-size state at ``position`` a log snapshots: [n, width] per series (MLA: none; V4: the
        sliding and open compressor windows' rows, RowsReleased once freed)."""
        ...

    def release(self, logged: int) -> None:
        """The first ``logged`` positions are in a log: rows kept only for a log may be freed before there."""
        ...

    def round_to(self, dtype: torch.dtype) -> None:
        """Round held positions in place to ``dtype``, so continuing from memory matches restoring from the log."""
        ...


class Cache(Protocol):
    """A batch of sequences' attention state, ``length`` positions long; what a log asks is ``log_view``."""

    @property
    def length(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def trim(self, length: int) -> None:
        """Forget positions from ``length`` on (RowsReleased if the rows that needs were freed)."""
        ...

    def log_view(self) -> CacheLog:
        """This cache as a log reads and frees it (a stateless view)."""
        ...


CacheT = TypeVar("CacheT", bound=Cache)


class Model(nn.Module, ABC, Generic[CacheT]):
    """A family's whole forward pass; routed experts come from an expert source (engine/core/sources.py)."""

    # forward_prompt goes layer by layer; False: chunk by chunk, so a cache that frees rows (V4) frees between
    prompt_in_windows: ClassVar[bool] = False
    args: ModelArgs
    int8_activations: bool  # kernel matmuls quantise their inputs (lossy, opt-in)
    prompt_tiles: bool  # with int8_activations: forward_prompt(s) compute a prompt's rows as tile GEMMs
    read_ahead: bool  # decode prefetches the next weights into CPU caches

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
        """tokens [B, S] at start_pos.. -> float32 logits [B, S, vocab] (S=1 if last_only), appended to ``cache``;
        ``absorb`` forces MLA's attention path (None: automatic)."""

    def forward_prompt(
        self, tokens: torch.Tensor, start_pos: int, cache: CacheT, experts: Experts, chunk: int, last_only: bool = False
    ) -> torch.Tensor:
        """``forward`` over tokens [B, S] in chunks of ``chunk`` in ``prompt_rows(prompt_tiles)``: the same logits
        and cache as those forwards."""
        with prompt_rows(self.prompt_tiles):
            logits = [
                self.forward(part, start_pos + i * chunk, cache, experts, last_only=last_only)
                for i, part in enumerate(tokens.split(chunk, dim=1))
            ]
        return logits[-1] if last_only else torch.cat(logits, dim=1)

    def forward_prompts(self, chunks: list[torch.Tensor], caches: list[CacheT], experts: Experts) -> list[torch.Tensor]:
        """chunks[i] [1, S_i] at the end of caches[i] -> each one's last-position logits [1, 1, vocab], as
        ``forward(..., last_only=True)`` alone in ``prompt_rows(prompt_tiles)``; a family may compute them in one
        pass."""
        with prompt_rows(self.prompt_tiles):
            return [
                self.forward(chunk, cache.length, cache, experts, last_only=True)
                for chunk, cache in zip(chunks, caches, strict=True)
            ]

    @abstractmethod
    def forward_rows(self, tokens: list[int], caches: list[CacheT], experts: Experts) -> torch.Tensor:
        """tokens[b] at the end of caches[b] -> float32 logits [B, vocab], each row bit-equal to ``forward`` alone."""

    @abstractmethod
    def read_ahead_bytes(self, experts_per_token: int, expert_bytes: int) -> int | None:
        """The most bytes one read-ahead request names; None: this model never reads ahead."""

    def drafter(self) -> Drafter | None:
        """The model as a drafter where its MTP modules are loaded, else None."""
        return None

    def hold_kv_b_int8(self, codes: Mapping[str, tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """Keep int8 records (codes [out, in], scales, group size) beside the named modules' wkv_b for decode."""
        if codes:
            raise ValueError(f"{type(self).__name__} has no wkv_b to hold int8 records of: {sorted(codes)}")


class Drafter(Protocol):
    """A model that drafts with its multi-token-prediction module and verifies the drafts in one pass."""

    def forward_rows_hidden(
        self, tokens: list[int], caches: list[Any], experts: Experts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_rows -> (logits [B, vocab], pre-norm hidden [B, dim] or V4's streams [B, n, dim]); rows on
        one cache (consecutive positions) each get the bits of their own decode step."""
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
        """``depth`` tokens after the pairs (hidden[s] = h_i, tokens[s] = t_{i+1}), i = position..; the first follows
        tokens[-1]."""
        ...


def row_positions(caches: Sequence[Cache]) -> list[int]:
    """Each row's position: its cache's length plus the earlier rows on the same cache (a verify step)."""
    earlier: dict[int, int] = {}
    positions = []
    for cache in caches:
        before = earlier.get(id(cache), 0)
        positions.append(cache.length + before)
        earlier[id(cache)] = before + 1
    return positions
