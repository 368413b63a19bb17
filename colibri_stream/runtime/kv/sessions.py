"""Conversation sessions: the engine's compressed KV cache persisted in a per-session KV log.

The log's kind is the model family's (runtime/kv/logs.py): MLA models log per position the rows
their cache holds (the latent, roped key and indexer keys; format 2); DeepSeek-V4 logs per position the
compressed entries of the windows it closes, and snapshots of its fixed-size window state every
``snapshot_every`` positions and at the log's end (format 4, storage/kv/lean_log.py).

A turn restores the longest stored prefix of the new prompt that the log can restore (all of it for
MLA; for V4 up to the last snapshot at or before it: the log's end after a restart, so zero
re-prefill; after an edit, fewer than ``snapshot_every`` positions re-prefilled, and none before the
last turn's answer: the state at its last prompt position is kept as a bookmark), cuts the log there,
prefills the rest and appends the turn's new positions at the end (fsynced). One file and one exclusive
lock per session, so many sessions can be open at once (the server's slots) and a second process gets
a clear error. A DeepSeek-V4 log of format 3 (every row per position, builds before the lean log) is
refused in one line saying to --reset.
"""

from __future__ import annotations

import re
import stat
import time
from pathlib import Path
from typing import Any

import torch

from colibri_stream.checkpoint.dtypes import dtype_bytes
from colibri_stream.errors import SessionError
from colibri_stream.paths import user_cache_dir
from colibri_stream.planning.family_memory import family_memory
from colibri_stream.planning.kv_bytes import (
    cache_bytes_per_token,
    naive_kv_bytes_per_token,
    naive_kv_kind,
    session_geometry,
)
from colibri_stream.runtime.kv.lock import SessionLease
from colibri_stream.runtime.kv.logs import SessionLog, open_log
from colibri_stream.runtime.kv.records import RestoredPrefix
from engine.config.args import ModelArgs
from engine.core.interfaces import Cache
from engine.v4.position_rows import RowsReleased
from storage.errors import CorruptDataError, FormatError
from storage.files.safe_read import NotRegularFileError, file_kind
from storage.kv.geometry import AnyGeometry, LeanGeometry
from storage.kv.lean_log import count_positions
from storage.kv.log import HEADER_BYTES, NotALogError, StateMismatchError, read_header_state

SESSION_SUFFIX = ".kvlog"
# Session names become file names: a conservative alphabet, no leading dot, no separators. Matched
# with fullmatch: "$" would also accept a trailing newline ("chat\n" -> a file named "chat\n.kvlog").
SESSION_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
TRANSCRIPT_SUFFIX = ".chat.json"  # `chat`'s messages beside the log: the text the template renders


def check_session_name(name: str) -> str:
    """The name unchanged, or SessionError: names are file names under the KV directory, so anything
    that could leave it ("../x", "a/b", ".hidden") is refused."""
    if not isinstance(name, str) or not SESSION_NAME.fullmatch(name) or ".." in name:
        text = str(name)  # a huge name is cut in the message: the error stays one short line
        shown = repr(text) if len(text) <= 64 else f"{text[:64]!r}... ({len(text)} characters)"
        raise SessionError(f"session name {shown} must be 1-128 of A-Z a-z 0-9 _ - . (no leading dot, no '..')")
    return name


def session_path(kv_dir: str | Path, name: str, suffix: str = SESSION_SUFFIX) -> Path:
    """The file of session ``name`` (its log, or with ``suffix`` its transcript) inside ``kv_dir``: where
    every session name becomes a path, so the name is checked here and no file outside the directory
    can be named."""
    return Path(kv_dir) / f"{check_session_name(name)}{suffix}"


def default_kv_dir(fingerprint: str) -> Path:
    return user_cache_dir("kv", fingerprint[:16])


# What a state mismatch means, in the words of the flags that set it.
_FIELD_WORDS = {
    "geometry.dtype": ("KV record dtype", "--kv-dtype"),
    "state.compute_dtype": ("compute dtype", "--dtype"),
    "state.activations": ("activations", "--activations"),
}
_FIX = "use --reset (chat: :reset) to start it over, or another --session"
DEFAULT_ACTIVATIONS = "float32"
# State fields left out of a header when at their default (a log written before the field was recorded
# has none): a missing one reads as this.
_STATE_DEFAULTS = {"activations": DEFAULT_ACTIVATIONS}


def session_state(compute_dtype: str, activations: str = DEFAULT_ACTIVATIONS) -> dict[str, str]:
    """What a session's stored values depend on beyond the model (the fingerprint) and the KV record dtype
    (the geometry): the compute dtype and the activation path (int8 activations quantise every matmul
    input). Nothing else a run chooses changes a stored value or what a position means: the budget, tiers,
    prefetch, threads and workers decide where an expert is read from, never what it computes, and
    positions are matched by token id, whatever template, text or sampling produced the tokens.
    A field at its default is left out, so logs written before it was recorded open as before."""
    state = {"compute_dtype": compute_dtype}
    if activations != DEFAULT_ACTIVATIONS:
        state["activations"] = activations
    return state


def state_mismatch_message(name: str, error: StateMismatchError) -> str:
    """One line naming what differs between the session's log and this run (the flag that sets it), and
    the way out."""
    if error.field == "format_version":  # a DeepSeek-V4 log of every row per position (format 3)
        return (
            f"session {name!r} is a KV log of format {error.stored}, which this build no longer keeps for this "
            f"model (it writes format {error.current}): {_FIX}"
        )
    if error.field == "fingerprint":
        return (
            f"session {name!r} was made by another model (fingerprint mismatch: the log's {error.stored}, "
            f"this model's {error.current}): {_FIX}"
        )
    if error.field not in _FIELD_WORDS:
        return f"session {name!r} was made with {error.field} {error.stored}; this run's is {error.current}: {_FIX}"
    what, flag = _FIELD_WORDS[error.field]
    key = error.field.removeprefix("state.")
    stored, current = (_STATE_DEFAULTS.get(key) if v is None else v for v in (error.stored, error.current))
    return (
        f"session {name!r} was made with {what} ({flag}) {stored}; this run uses {current}: "
        f"rerun with {flag} {stored}, or {_FIX}"
    )


def open_session_log(
    path: Path,
    name: str,
    fingerprint: str,
    geometry: AnyGeometry,
    state: dict[str, str],
    fresh: bool,
    args: ModelArgs,
) -> SessionLog:
    """The session's log, or a SessionError that says what is wrong with it and how to get out."""
    try:
        return open_log(str(path), fingerprint, geometry, args, state, fresh)
    except StateMismatchError as exc:
        raise SessionError(state_mismatch_message(name, exc)) from None
    except NotALogError as exc:  # a file of something else under the log's name
        raise SessionError(
            f"session {name!r}: {exc} (not even by --reset); move it away or use another --session"
        ) from None
    except NotRegularFileError as exc:  # nothing of ours: never truncated, not even by --reset
        raise SessionError(f"session {name!r}: {exc}; remove it or use another --session") from None
    except (FormatError, CorruptDataError) as exc:  # records are recovered, so this is the header
        raise SessionError(
            f"session {name!r}: corrupt or unreadable KV log header ({exc}): "
            f"{_FIX}, or delete it with `colibri-stream kv rm MODEL {name}`"
        ) from None


class Session:
    """One named conversation of one model; while the Session is open its lock (lock.py: no
    other process may use the session) and its log's are held.

    The log's header records what the values depend on (``session_state``: the compute dtype and the
    activation path) beside the model fingerprint and geometry (the KV record dtype): values computed
    one way continued another would silently drift from a fresh run, so such a turn is refused naming
    the flag. ``reset`` starts the log over whatever it held."""

    def __init__(
        self,
        kv_dir: str | Path,
        name: str,
        fingerprint: str,
        args: ModelArgs,
        record_dtype: str = "float32",
        compute_dtype: str = "float32",
        reset: bool = False,
        activations: str = DEFAULT_ACTIVATIONS,
    ):
        self.name = check_session_name(name)
        self.args = args
        self.geometry = session_geometry(args, record_dtype)
        path = session_path(kv_dir, self.name)
        state = session_state(compute_dtype, activations)
        self.lease = SessionLease(kv_dir, self.name)
        self.bookmark: int | None = None  # the turn's last prompt position: a lean log keeps its state too
        try:
            self.log = open_session_log(path, self.name, fingerprint, self.geometry, state, reset, args)
        except BaseException:
            self.lease.release()
            raise

    def reset(self) -> None:
        self.log.truncate(0)

    def start_turn(self, prompt_ids: list[int], dtype: torch.dtype) -> RestoredPrefix:
        """The cache holding the longest stored prefix of ``prompt_ids`` the log can restore (at least one
        token left to run; a lean log's last snapshot at or before it). Only that prefix is read."""
        start = time.perf_counter()
        self.bookmark = len(prompt_ids) - 1
        reused = self.log.restore_point(min(self.log.common_prefix(prompt_ids), len(prompt_ids) - 1))
        if reused < self.log.length:
            self.log.truncate(reused)  # diverged (or nothing new): forget the rest
        cache = self.log.restore(reused, dtype)
        self._keep_unlogged_rows(cache)
        return RestoredPrefix(cache, reused, time.perf_counter() - start)

    def continue_turn(self, cache: Cache, ids: list[int], prompt_ids: list[int]) -> RestoredPrefix:
        """``start_turn`` for a cache still in memory from this session's last turn (``ids``: the tokens
        of its positions, the log's): the common prefix is kept, nothing is read from the log."""
        start = time.perf_counter()
        self.bookmark = len(prompt_ids) - 1
        reused = min(common_prefix(ids, prompt_ids), len(prompt_ids) - 1)
        if reused < self.log.length:
            self.log.truncate(self.log.restore_point(reused))  # diverged (or nothing new): forget the rest
        try:
            cache.trim(reused)
        except RowsReleased:  # a V4 cache cut back before rows it released: restore from the log
            ids.clear()
            return self.start_turn(prompt_ids, cache.dtype)
        del ids[reused:]
        if self.log.length < reused:  # the log restores an earlier state: log the rest again from memory
            self.end_turn(cache, ids)
        self._keep_unlogged_rows(cache)
        return RestoredPrefix(cache, reused, time.perf_counter() - start)

    def end_turn(self, cache: Cache, token_ids: list[int]) -> int:
        """Append positions the log lacks (token_ids[i] is the token at position i); fsync. Returns count."""
        start, end = self.log.length, min(cache.length, len(token_ids))
        if end > start:
            self.log.append_from(cache, token_ids, self.bookmark)
        self._keep_unlogged_rows(cache)
        return end - start

    def _keep_unlogged_rows(self, cache: Cache) -> None:
        """The cache may free what the log holds (DeepSeek-V4's rows: what stays per position is its
        compressed entries; a bf16 log's rounding is applied to what stays, as_logged)."""
        cache.log_view().release(self.log.length)

    def close(self) -> None:
        self.log.close()
        self.lease.release()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def session_info(path: Path, args: ModelArgs) -> dict[str, Any]:
    """Tokens, bytes per token and the ratio against a naive per-head K/V cache of the same model.
    A log whose header cannot be read is reported ("header" says why), never an error: one damaged
    session must not hide the others from `kv ls`."""
    name = path.name[: -len(SESSION_SUFFIX)]
    try:
        status = path.lstat()  # a symbolic link is reported, never followed out of the directory
    except OSError as exc:  # removed since it was listed
        return {"session": name, "header": f"unreadable: {exc.strerror}", "tokens": None, "file_bytes": None}
    size = status.st_size
    if not stat.S_ISREG(status.st_mode):  # listed, not opened: a FIFO would block, /dev/zero never ends
        return {
            "session": name,
            "header": f"not a regular file ({file_kind(status.st_mode)})",
            "tokens": None,
            "file_bytes": size,
        }
    if size == 0:  # created, killed before its header: opens as a new session, nothing to call corrupt
        return {"session": name, "header": "empty (no header yet)", "tokens": 0, "file_bytes": 0}
    try:
        _, geometry, state = read_header_state(path)
    except (FormatError, CorruptDataError) as exc:
        return {"session": name, "header": f"corrupt header: {exc}", "tokens": None, "file_bytes": size}
    naive = naive_kv_bytes_per_token(args, geometry.dtype)
    tokens, per_token, lean = _log_sizes(path, geometry, size)
    info = {
        "session": name,
        "header": "ok",
        "tokens": tokens,
        "file_bytes": size,
        "compute_dtype": state.get("compute_dtype"),
        "activations": state.get("activations", DEFAULT_ACTIVATIONS),
        "record_dtype": geometry.dtype,
        "bytes_per_token": per_token,
        **lean,
        "naive_kv_bytes_per_token": naive,
        "compression_vs_naive": round(naive / per_token, 2),
    }
    compressed = family_memory(args).compressed_kv_bytes_per_token(dtype_bytes(geometry.dtype))
    if compressed is None:  # no compressed attention: the log's record is what the cache holds
        return info
    return {**info, **_compressed_info(args, state.get("compute_dtype"), compressed, naive)}


def _log_sizes(path: Path, geometry: AnyGeometry, size: int) -> tuple[int, float, dict[str, Any]]:
    """(tokens, bytes per token, the lean log's other sizes). Tokens: the whole records (or in-sequence
    frames) in the file; the valid ones are counted, and a damaged tail cut, at the next turn. A lean log's
    bytes per token: what a long log costs per position at most (an append per token, its share of the
    kept snapshots); its end snapshot and the bookmark of the last turn's prompt are a fixed cost, like
    the windows in memory."""
    if not isinstance(geometry, LeanGeometry):
        return max(0, size - HEADER_BYTES) // geometry.record_bytes, geometry.record_bytes, {}
    tokens, snapshots = count_positions(path, geometry)
    return (
        tokens,
        round(geometry.bytes_per_token, 2),
        {
            "snapshots": snapshots,
            "snapshot_every": geometry.snapshot_every,
            "fixed_bytes_max": 2 * geometry.end_snapshot_bytes,  # the end snapshot and the turn's bookmark
        },
    )


def _compressed_info(args: ModelArgs, compute_dtype: object, compressed: float, naive: int) -> dict[str, Any]:
    """A compressed-attention model's (DeepSeek-V4's) other sizes per token: its cache in memory (the
    compressed entries, in the compute dtype; rows are released once logged), the ``compressed``
    entries and the ``naive`` cache in the record dtype, and what the naive cache counts."""
    in_memory = cache_bytes_per_token(args, compute_dtype) if compute_dtype in ("float32", "bfloat16") else None
    return {
        "naive_kv": naive_kv_kind(args),
        "in_memory_bytes_per_token": in_memory,
        "compressed_kv_bytes_per_token": round(compressed, 2),
        "compressed_vs_naive": round(naive / compressed, 2) if compressed else None,  # None: sliding layers only
    }
