"""The generation loop of one sequence: ``generate``.

``generate`` is a ContinuousBatch (colibri_stream/runtime/batching.py) with one sequence: the CLI's run and
chat, the demo, bench and the server's batch all compute a request the same way. Timing stats are
measured around the real forward calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from colibri_stream.planning.activations import PREFILL_CHUNK_TOKENS
from colibri_stream.runtime.batching import (
    ContinuousBatch,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
)
from colibri_stream.runtime.sampling import GREEDY_BELOW, SamplingParams, sample
from engine.core.interfaces import Cache, Model
from engine.core.sources import Experts

__all__ = [
    "GREEDY_BELOW",
    "PREFILL_CHUNK_TOKENS",
    "GenerationResult",
    "GenerationStats",
    "SamplingParams",
    "generate",
    "sample",
]


def generate(
    model: Model[Any],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    experts: Experts,
    sampling: SamplingParams | None = None,
    stop_ids: Iterable[int] = (),
    cache: Cache | None = None,
    on_token: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    prefill_chunk: int = PREFILL_CHUNK_TOKENS,
) -> GenerationResult:
    """Continue ``prompt_ids`` by up to ``max_new_tokens``; stops early on any of ``stop_ids``
    (the stop id is included in ``ids``). ``cache`` may already hold a prefix of the prompt.

    ``should_stop`` is polled after every token (a client gone, Ctrl-C, a stop string): a cancelled
    generation costs at most the decode step already running, and the cache stays consistent.
    ``prefill_chunk``: prompt positions per prefill forward (see PREFILL_CHUNK_TOKENS)."""
    sampling = sampling or SamplingParams()
    request = GenerationRequest(prompt_ids, max_new_tokens, sampling, stop_ids, cache, on_token, should_stop)
    batch = ContinuousBatch(model, experts, prefill_chunk)
    generation = batch.add(request)
    while batch:
        batch.step()
    if generation.error is not None:
        raise generation.error
    return generation.result
