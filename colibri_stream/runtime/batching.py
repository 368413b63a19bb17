"""Continuous batching: several generations advance together, one step at a time.

A step runs at most one prefill chunk's worth of prompt positions (PREFILL_CHUNK_TOKENS: the next
chunk of the oldest sequences still reading their prompts, as many as fit; a sequence alone in the batch
reads a window of chunks layer by layer, Model.forward_prompt) and then a decode pass
over every sequence that has a token to feed (``Model.forward_rows``: each weight read once,
each MoE layer's experts acquired once for the union of the rows). Several short prompts are read in
one step; a long prompt costs the others one chunk per step, never the whole prompt, and a step that read
prompt chunks makes more decode passes until the decoding rows had DECODE_SHARE of the chunks' time. Sequences join
between steps and leave the step they finish, are cancelled or fail.

Every sequence is computed exactly as if it ran alone (its prompt in the same chunks, its decode rows
batch-invariant, its own sampling generator): at temperature 0 its tokens are those of its solo run,
and ``generate`` is this loop with one sequence.

A request may ask for log-probabilities (runtime/sampling.py ``token_logprobs``): of each sampled token
(computed from the logits it was sampled from: the tokens do not change), and of every prompt token but
the first, for which its prompt chunks compute the logits of every position instead of only the last
(only such a request pays for that). A prompt-logprobs request may stop after its prompt (no tokens).

A request may carry a ``TokenConstraint`` (runtime/constraint.py: a grammar its answer must follow): its
logits are masked before every sample and the constraint follows each token taken; such a sequence is
never drafted for (its next mask depends on the token before), and the others are untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch

from colibri_stream.errors import RequestError
from colibri_stream.planning.activations import PREFILL_CHUNK_TOKENS, PREFILL_WINDOW_CHUNKS
from colibri_stream.runtime.constraint import TokenConstraint, masked
from colibri_stream.runtime.sampling import SamplingParams, TokenLogprob, sample, sample_against, token_logprobs
from colibri_stream.runtime.speculation import DraftedSequence, DraftState, Speculation
from engine.core.interfaces import Cache, Model
from engine.core.sources import Experts

# While prompts are read, the rows decoding beside them get this much of the prompt chunks' time again in
# extra decode passes (1.0: half the step's time each): a 10k-token prefill no longer slows them to one
# token per 256-position chunk.
DECODE_SHARE = 1.0


@dataclass
class GenerationStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0  # decode forwards (with MTP drafts, one may yield several tokens)
    drafted: int = 0  # tokens drafted by the MTP module and verified
    accepted: int = 0  # drafted tokens the model chose too

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
            "decode_steps": self.decode_steps,
        }


@dataclass
class GenerationResult:
    ids: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    stopped_on: int | None = None  # the stop id that ended generation, if any
    cancelled: bool = False  # should_stop() returned True before max_new_tokens or a stop id
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per id, when the request asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., when asked


@dataclass
class GenerationRequest:
    """One generation: continue ``prompt_ids`` by up to ``max_new_tokens`` (``cache`` may already hold a
    prefix of the prompt). ``on_token`` sees each id as it is sampled; ``should_stop`` is polled after
    every token (a client gone, Ctrl-C, a stop string). ``logprobs`` / ``prompt_logprobs`` (None: not
    asked) record each sampled / prompt token's log-probability with that many alternatives; prompt
    logprobs need every prompt position computed, so ``cache`` must then be empty."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: Iterable[int] = ()
    cache: Cache | None = None
    on_token: Callable[[int], None] | None = None
    should_stop: Callable[[], bool] | None = None
    on_prompt_chunk: Callable[[], object] | None = None  # after each prompt chunk but the last (a session logs it)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: TokenConstraint | None = None  # what the answer may be (a grammar); None: anything


class Generation:
    """One sequence in the batch: its cache, the prompt positions still to prefill, its result so far."""

    def __init__(self, request: GenerationRequest, cache: Cache):
        self.request, self.cache = request, cache
        self.pending = list(request.prompt_ids[cache.length :])  # prompt positions not yet in the cache
        self.stop = set(request.stop_ids)
        seed = request.sampling.seed
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.result = GenerationResult(ids=[])
        self.result.stats.prefill_tokens = len(self.pending)
        self.next_token: int | None = None  # sampled, not yet fed to the model
        self.done = False
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.drafting: DraftState | None = None  # with a Speculation: made at the first decode step

    def choose(self, logits: torch.Tensor, draft: int | None = None) -> int:
        """The token this sequence samples from logits [vocab]; with a drafted token proposed, by the
        rejection rule (``sample_against``: the same distribution). A constrained sequence samples from
        the logits its constraint masks (and is never drafted for)."""
        sampling = self.request.sampling
        if self.request.constraint is not None:
            logits = masked(logits, self.request.constraint)
        if draft is None:
            return sample(logits, sampling, self.generator)
        return sample_against(logits, sampling, self.generator, draft)

    def take(self, logits: torch.Tensor, token: int | None = None) -> int:
        """Take ``token`` (default: one sampled from logits [vocab], the distribution it was drawn from);
        finish on a stop id, max tokens or should_stop. Returns the token."""
        if token is None:
            token = self.choose(logits)
        if self.request.constraint is not None:
            self.request.constraint.advance(token)
        if self.request.logprobs is not None:  # before on_token, which may pass it on
            self.result.logprobs += token_logprobs(logits[None], [token], self.request.logprobs)
        now = time.perf_counter()
        stats = self.result.stats
        if self.first_token_at is None:
            self.first_token_at = now
            stats.prefill_s = now - self.started
        else:
            stats.decode_tokens += 1
        stats.decode_s = now - self.first_token_at
        self.result.ids.append(token)
        if self.request.on_token is not None:
            self.request.on_token(token)
        if token in self.stop:
            self.result.stopped_on = token
        elif len(self.result.ids) < self.request.max_new_tokens and not self.poll_cancel():
            self.next_token = token
            return token
        self.done = True
        return token

    @property
    def room(self) -> int:
        """Tokens it may still take."""
        return self.request.max_new_tokens - len(self.result.ids)

    def end_at_prompt(self) -> None:
        """A request for no tokens (only its prompt's logprobs) ends when its prompt is read."""
        self.result.stats.prefill_s = time.perf_counter() - self.started
        self.done = True

    def poll_cancel(self) -> bool:
        if self.request.should_stop is not None and self.request.should_stop():
            self.result.cancelled = self.done = True
        return self.done


class ContinuousBatch:
    """Sequences decoded together; ``step`` advances all of them and returns those that finished."""

    def __init__(
        self,
        model: Model[Any],
        experts: Experts,
        prefill_chunk: int = PREFILL_CHUNK_TOKENS,
        speculation: Speculation | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.model, self.experts, self.prefill_chunk = model, experts, prefill_chunk
        self.clock = clock  # times the decode rows' share of a step that reads prompts
        self.speculation = speculation  # decode drafts with the model's MTP module (runtime/speculation.py)
        self.active: list[Generation] = []

    def __len__(self) -> int:
        return len(self.active)

    def add(self, request: GenerationRequest) -> Generation:
        """Start a generation (it joins at the next step). Refuses an empty prompt, a cache that
        already holds the whole prompt (at least one position must run to give logits), and a cache
        holding any of it when the prompt's logprobs are asked (those positions' logits are gone)."""
        if not request.prompt_ids:
            raise RequestError("the prompt is empty (0 tokens)")
        cache = self.model.new_cache() if request.cache is None else request.cache
        if cache.length >= len(request.prompt_ids):
            raise ValueError(
                f"cache holds {cache.length} positions; the prompt must extend it (has {len(request.prompt_ids)})"
            )
        if request.prompt_logprobs is not None and cache.length:
            raise RequestError(
                f"the prompt's logprobs need every position computed, but {cache.length} were reused from a cache"
            )
        generation = Generation(request, cache)
        generation.done = request.max_new_tokens <= 0 and request.prompt_logprobs is None
        if not generation.done:
            self.active.append(generation)
        return generation

    def step(self) -> list[Generation]:
        """Prompt chunks (up to one chunk's positions) and one decode pass; the generations that finished.
        A generation whose forward fails ends with ``error`` set; the others go on."""
        for generation in self.active:
            if generation.pending:  # a client gone while its prompt waits or is read
                generation.poll_cancel()
        reading = self._readers()
        started = self.clock()
        together = [g for g in reading if g.request.prompt_logprobs is None]  # logprobs need every position's logits
        together = together if len(together) > 1 else []
        if together:
            self._guarded(together, self._prefill_together)
        for generation in reading:
            if generation not in together:
                self._guarded([generation], self._prefill_chunk)
        self._decode_passes(reading, started)
        finished = [g for g in self.active if g.done]
        self.active = [g for g in self.active if not g.done]
        return finished

    def _decode_passes(self, reading: list[Generation], started: float) -> None:
        """One decode pass over the rows with a token to feed; when prompt chunks ran this step (since
        ``started``), more passes until the rows have had DECODE_SHARE of the chunks' time: a long prompt
        costs the rows beside it a share of their rate, not all but one token per chunk. The rows' tokens
        do not depend on how many passes a step makes (decode rows are batch-invariant)."""
        prefill_s = self.clock() - started if reading else 0.0
        decode_started = self.clock()
        while feeding := [g for g in self.active if g.next_token is not None and not g.done and g not in reading]:
            self._guarded(feeding, self._decode)
            if self.clock() - decode_started >= DECODE_SHARE * prefill_s:
                return

    def _readers(self) -> list[Generation]:
        """The generations whose next prompt chunk runs this step: oldest first, as long as their chunks
        fit in one chunk's worth of positions (several short prompts share a step, a long one has it to
        itself). Each chunk is its own forward, cut where a solo run cuts it."""
        budget, readers = self.prefill_chunk, []
        for generation in self.active:
            if not generation.pending or generation.done:
                continue
            size = min(len(generation.pending), self.prefill_chunk)
            if size > budget:
                break
            readers.append(generation)
            budget -= size
        return readers

    def _prompt_step(self) -> int:
        """Prompt positions a reader takes this step: one chunk; a window of PREFILL_WINDOW_CHUNKS chunks when
        it is alone in the batch (no one waits for the step) and the model reads prompts layer by layer."""
        alone = len(self.active) == 1 and self.model.prompt_in_windows
        return self.prefill_chunk * (PREFILL_WINDOW_CHUNKS if alone else 1)

    def _prefill_chunk(self, generations: list[Generation]) -> None:
        (generation,) = generations
        size = self._prompt_step()
        chunk, generation.pending = generation.pending[:size], generation.pending[size:]
        tokens = torch.tensor([chunk], dtype=torch.long, device=self.model.device)
        start, top_n = generation.cache.length, generation.request.prompt_logprobs
        logits = self.model.forward_prompt(
            tokens, start, generation.cache, self.experts, self.prefill_chunk, last_only=top_n is None
        )
        if top_n is not None:  # logits [1, len(chunk), vocab]: row i predicts prompt token start + i + 1
            targets = generation.request.prompt_ids[start + 1 : start + 1 + len(chunk)]
            generation.result.prompt_logprobs += token_logprobs(logits[0, : len(targets)], targets, top_n)
        self._chunk_read(generation, logits[0, -1])

    def _prefill_together(self, generations: list[Generation]) -> None:
        """Several generations' next prompt chunks (one chunk each: others are in the batch) in one forward
        (``Model.forward_prompts``), each with the bits of its own."""
        chunks = []
        for generation in generations:
            chunk = generation.pending[: self.prefill_chunk]
            generation.pending = generation.pending[self.prefill_chunk :]
            chunks.append(torch.tensor([chunk], dtype=torch.long, device=self.model.device))
        logits = self.model.forward_prompts(chunks, [g.cache for g in generations], self.experts)
        for generation, last in zip(generations, logits, strict=True):
            self._chunk_read(generation, last[0, -1])

    @staticmethod
    def _chunk_read(generation: Generation, last: torch.Tensor) -> None:
        """After a prompt chunk whose last position's logits are ``last`` [vocab]: the first token once the
        prompt is read (or the end of a prompt-only request), else the request's per-chunk hook."""
        if not generation.pending and generation.request.max_new_tokens <= 0:
            generation.end_at_prompt()
        elif not generation.pending:
            generation.take(last)
        elif generation.request.on_prompt_chunk is not None:
            generation.request.on_prompt_chunk()

    def _decode(self, generations: list[Generation]) -> None:
        # a generation being decoded has its next token (None only before its prompt is done)
        tokens = [cast(int, g.next_token) for g in generations]
        for g in generations:
            g.next_token = None
            g.result.stats.decode_steps += 1
        if self.speculation is not None:
            self._speculate(self.speculation, generations, tokens)
            return
        logits = self.model.forward_rows(tokens, [g.cache for g in generations], self.experts)
        for generation, row in zip(generations, logits, strict=True):
            generation.take(row)

    def _speculate(self, speculation: Speculation, generations: list[Generation], tokens: list[int]) -> None:
        """The decode pass with drafts (runtime/speculation.py): a generation may take several tokens."""
        states = []
        for g in generations:
            g.drafting = g.drafting or speculation.new_state()
            states.append(g.drafting)

        def take(index: int, logits: torch.Tensor, token: int) -> bool:
            generations[index].take(logits, token)  # sets next_token to it while going on
            return not generations[index].done

        sequences = [
            DraftedSequence(
                g.cache, token, state, g.choose, partial(take, i), g.room, g.stop, g.request.constraint is None
            )
            for i, (g, token, state) in enumerate(zip(generations, tokens, states, strict=True))
        ]
        for g, (drafted, accepted) in zip(generations, speculation.step(sequences, self.experts), strict=True):
            g.result.stats.drafted += drafted
            g.result.stats.accepted += accepted

    @staticmethod
    def _guarded(generations: list[Generation], work: Callable[[list[Generation]], None]) -> None:
        try:
            work(generations)
        except Exception as exc:  # one failed forward ends the generations in it, not the batch
            for generation in generations:
                generation.error, generation.done = exc, True
