"""The generation loop: prefill -> decode_one_token -> generate.

Greedy (temperature 0) or temperature/top-p sampling with a seeded generator. Timing stats are
measured around the real forward calls.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from colibri_stream.errors import RequestError
from engine.cache import KVCache
from engine.experts import ExpertProvider
from engine.model import Transformer


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # "not (x >= 0)" rather than "x < 0": NaN fails every comparison and must be refused too
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def decode_tok_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "ttft_s": round(self.prefill_s, 6),
            "decode_tok_per_s": round(self.decode_tok_per_s, 3),
        }


@dataclass
class GenerationResult:
    ids: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    stopped_on: int | None = None  # the stop id that ended generation, if any
    cancelled: bool = False  # should_stop() returned True before max_new_tokens or a stop id


GREEDY_BELOW = float(torch.finfo(torch.float32).tiny)  # temperatures under this (0 included) are greedy


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one id from logits [vocab] (float32). The logits are shifted so the best is 0 before the
    division: every scaled value is then <= 0, so a tiny temperature cannot overflow to inf (inf - inf
    made NaN probabilities); other tokens underflow to probability 0, which is greedy, as it should
    be. Below float32's smallest normal the temperature itself would round to 0: greedy outright."""
    if params.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    shifted = logits.float() - logits.max().float()
    probs = (shifted / params.temperature).softmax(dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the best token)
        outside = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        outside[0] = False  # a top_p that rounds to 0 in float32 must not remove the best one too
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


# Prefill runs the prompt this many positions at a time, appending each chunk to the cache: activation
# memory then depends on the chunk and the context, never on the prompt's length, and placement counts
# it (colibri_stream/activations.py). A fixed number, never derived from a budget, so the positions each
# forward sees (and the tokens) are the same under any budget.
PREFILL_CHUNK_TOKENS = 256


def prefill(
    model: Transformer,
    ids: Sequence[int],
    cache: KVCache,
    experts: ExpertProvider,
    chunk: int = PREFILL_CHUNK_TOKENS,
) -> torch.Tensor:
    """Run the prompt from the cache's end, ``chunk`` positions per forward; return the last position's
    logits [vocab]. A chunk attends to the cache the earlier ones filled: the same logits as one forward."""
    if not ids:
        raise RequestError("the prompt is empty (0 tokens)")
    ids = list(ids)
    for start in range(0, len(ids), chunk):
        tokens = torch.tensor([ids[start : start + chunk]], dtype=torch.long, device=model.device)
        logits = model(tokens, cache.length, cache, experts, last_only=True)
    return logits[0, -1]


def decode_one_token(model: Transformer, token: int, cache: KVCache, experts: ExpertProvider) -> torch.Tensor:
    tokens = torch.tensor([[token]], dtype=torch.long, device=model.device)
    return model(tokens, cache.length, cache, experts)[0, -1]


def generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    experts: ExpertProvider,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: Iterable[int] = (),
    cache: KVCache | None = None,
    on_token: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    prefill_chunk: int = PREFILL_CHUNK_TOKENS,
) -> GenerationResult:
    """Continue ``prompt_ids`` by up to ``max_new_tokens``; stops early on any of ``stop_ids``
    (the stop id is included in ``ids``). ``cache`` may already hold a prefix of the prompt.

    ``should_stop`` is polled after every token (a client gone, Ctrl-C, a stop string): a cancelled
    generation costs at most the decode step already running, and the cache stays consistent.
    ``prefill_chunk``: prompt positions per prefill forward (see PREFILL_CHUNK_TOKENS)."""
    if not prompt_ids:
        raise RequestError("the prompt is empty (0 tokens)")
    cache = model.new_cache() if cache is None else cache
    if cache.length >= len(prompt_ids):
        raise ValueError(f"cache holds {cache.length} positions; the prompt must extend it (has {len(prompt_ids)})")
    stop = set(stop_ids)
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    result = GenerationResult(ids=[])
    stats = result.stats
    if max_new_tokens <= 0:
        return result
    start = time.perf_counter()
    stats.prefill_tokens = len(prompt_ids) - cache.length
    logits = prefill(model, prompt_ids[cache.length :], cache, experts, prefill_chunk)
    stats.prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    while True:
        token = sample(logits, sampling, generator)
        result.ids.append(token)
        if on_token is not None:
            on_token(token)
        if token in stop:
            result.stopped_on = token
            break
        if len(result.ids) >= max_new_tokens:
            break
        if should_stop is not None and should_stop():
            result.cancelled = True
            break
        logits = decode_one_token(model, token, cache, experts)
        stats.decode_tokens += 1
    stats.decode_s = time.perf_counter() - start
    return result
