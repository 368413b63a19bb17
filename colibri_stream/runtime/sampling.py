"""Sampling parameters and the sampler: greedy (temperature 0) or temperature/top-p with a seeded
generator, numerically safe at any finite temperature; and the log-probabilities a request may ask for
(``token_logprobs``): those of the model's own distribution, log_softmax of its float32 logits before
temperature and top-p (as OpenAI reports them), so they do not depend on how the token was drawn."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from colibri_stream.errors import RequestError


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


GREEDY_BELOW = float(torch.finfo(torch.float32).tiny)  # temperatures under this (0 included) are greedy


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one id from logits [vocab] (float32): greedy, or drawn from ``distribution``."""
    if params.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    return int(torch.multinomial(distribution(logits, params), 1, generator=generator))


def sample_against(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, draft: int) -> int:
    """``sample`` where a drafted token is proposed (speculative decoding): greedy returns the best id (the
    draft is accepted when that is it); otherwise the standard rejection rule for a draft proposed with
    certainty: keep it with probability p(draft), else draw from p with the draft removed. The id
    returned has exactly ``sample``'s distribution, and equals ``draft`` iff the draft was accepted."""
    if params.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    probs = distribution(logits, params)
    if float(torch.rand((), generator=generator)) < float(probs[draft] / probs.sum()):  # top-p's mass is < 1
        return draft
    probs[draft] = 0  # p(draft) < 1 here (else the draw above kept it): some other id has mass
    return int(torch.multinomial(probs, 1, generator=generator))


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The weights [vocab] a non-greedy ``sample`` draws from: temperature, then top-p (the tail zeroed, the
    rest not renormalised: they sum to the kept mass, multinomial draws in proportion). The logits
    are shifted so the best is 0 before the division: every scaled value is then <= 0, so a tiny
    temperature cannot overflow to inf (inf - inf made NaN probabilities); other tokens underflow to
    probability 0, which is greedy, as it should be. Below float32's smallest normal the temperature
    itself would round to 0: ``sample`` is greedy outright there."""
    shifted = logits.float() - logits.max().float()
    probs = (shifted / params.temperature).softmax(dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the best token)
        outside = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        outside[0] = False  # a top_p that rounds to 0 in float32 must not remove the best one too
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


@dataclass(frozen=True)
class TokenLogprob:
    """A token with its log-probability and the ``top`` most likely ids with theirs, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """logits [S, vocab] where row i is the distribution ``tokens[i]`` was drawn from -> one entry per
    row, with the ``top_n`` most likely ids of that row."""
    logp = logits.float().log_softmax(dim=-1)  # [S, vocab]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    k = min(top_n, logp.shape[-1])
    best, best_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], ids[:, None][:, :0])
    tops = [tuple(zip(i, v, strict=True)) for i, v in zip(best_ids.tolist(), best.tolist(), strict=True)]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(ids.tolist(), chosen, tops, strict=True)]
