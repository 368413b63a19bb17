"""One model with its text side, and one turn of a named conversation: what `chat` and `serve` share.

A turn opens the session's KV log (restoring the longest stored prefix of the prompt), generates,
appends the new positions and closes the log again, so the log's lock is held only while the turn
runs and a session is never open twice in one process.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from colibri_stream.checkpoint import LoadedModel
from colibri_stream.generate import SamplingParams, generate
from colibri_stream.sessions import Session, default_kv_dir, model_fingerprint
from colibri_stream.text import ChatFormat, load_chat_format, load_tokenizer


@dataclass
class Runtime:
    """A loaded model, its tokenizer, chat format and where its sessions live."""

    loaded: LoadedModel
    tokenizer: Tokenizer
    chat: ChatFormat
    kv_dir: Path
    fingerprint: str
    kv_dtype: str = "float32"
    model_id: str = "model"

    @property
    def context_size(self) -> int:
        return self.loaded.args.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.loaded.args.vocab_size

    def encode(self, text: str) -> list[int]:
        """Special tokens written in the text (the template's <bos>, <|im_start|>, ...) become their ids."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def expert_report(self) -> dict[str, Any] | None:
        experts = self.loaded.experts
        return experts.report() if hasattr(experts, "report") else None

    def close(self) -> None:
        if hasattr(self.loaded.experts, "close"):
            self.loaded.experts.close()


def load_runtime(args: argparse.Namespace) -> Runtime:
    """From parsed `run`-style flags (path, dtype, budget/store flags, kv_dir, kv_dtype)."""
    from colibri_stream.cli_run import load_for_run

    tokenizer = load_tokenizer(args.path)
    chat = load_chat_format(args.path)
    loaded = load_for_run(args)
    fingerprint = model_fingerprint(args.path)
    kv_dir = Path(args.kv_dir) if args.kv_dir else default_kv_dir(fingerprint)
    model_id = getattr(args, "model_name", None) or Path(args.path).resolve().name
    return Runtime(loaded, tokenizer, chat, kv_dir, fingerprint, args.kv_dtype, model_id)


@dataclass
class TurnResult:
    ids: list[int]
    finish_reason: str  # "stop" (a stop id), "length" (max tokens) or "cancelled"
    prompt_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)


def _expert_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """Per-turn expert traffic from the store's cumulative counters."""
    if before is None or after is None:
        return {}
    requests = after["expert_requests"] - before["expert_requests"]
    hits = sum(after["hits"].values()) - sum(before["hits"].values())
    return {
        "expert_requests": requests,
        "expert_hits": hits,
        "hit_rate": round(hits / requests, 4) if requests else None,
        "expert_bytes_read": after["expert_bytes_read"] - before["expert_bytes_read"],
    }


def run_turn(
    runtime: Runtime,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    session_name: str | None = None,
    on_token: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    reset: bool = False,
) -> TurnResult:
    """Generate one answer, continuing ``session_name``'s stored KV when given (prefix reuse)."""
    model = runtime.loaded.model
    session = None
    if session_name is not None:
        session = Session(runtime.kv_dir, session_name, runtime.fingerprint, runtime.loaded.args, runtime.kv_dtype)
    try:
        if session is not None and reset:
            session.reset()
        turn = session.start_turn(prompt_ids, model.dtype) if session is not None else None
        cache = turn.cache if turn is not None else model.new_cache()
        before = runtime.expert_report()
        start = time.perf_counter()
        result = generate(
            model,
            prompt_ids,
            max_new_tokens,
            runtime.loaded.experts,
            sampling or SamplingParams(),
            runtime.chat.stop_ids,
            cache,
            on_token,
            should_stop,
        )
        wall = time.perf_counter() - start
        if session is not None:
            session.end_turn(cache, prompt_ids + result.ids)
    finally:
        if session is not None:
            session.close()
    stats = result.stats.as_dict()
    stats.update(reused_tokens=turn.reused_tokens if turn else 0, wall_s=round(wall, 6))
    stats.update(_expert_delta(before, runtime.expert_report()))
    reason = "stop" if result.stopped_on is not None else "cancelled" if result.cancelled else "length"
    return TurnResult(result.ids, reason, len(prompt_ids), stats)
