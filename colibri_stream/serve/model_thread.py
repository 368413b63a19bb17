"""The one thread that runs the model, and admission in front of it.

One model thread owns the model and decodes every admitted request together (continuous batching,
colibri_stream/runtime/batching.py): ``slots`` requests at once, joining and leaving between steps; up to
``max_queue`` more wait for a slot; beyond that a request gets 503 at once, so a flood never grows
memory or latency without bound. A client that goes away sets its job's cancel flag, which the batch
polls after every token (and before every prompt chunk), so its place is free within one step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from colibri_stream.errors import ColibriError
from colibri_stream.experts.cluster.wire import WorkerError
from colibri_stream.runtime.batching import ContinuousBatch, Generation, GenerationResult
from colibri_stream.runtime.constraint import TokenConstraint
from colibri_stream.runtime.kv.pool import SessionPool
from colibri_stream.runtime.sampling import SamplingParams
from colibri_stream.runtime.turn import OpenTurn, Runtime, TurnOptions, abort_turn, begin_turn, finish_turn
from colibri_stream.serve.auth import tenant_id
from colibri_stream.serve.schemas import ApiError
from colibri_stream.text.chat_format import IncrementalDecoder
from storage.errors import DiskFullError, DiskWriteError, StorageError


class TextStream:
    """Token ids -> text deltas, cut at the first stop string. Text that could still turn into a stop
    string (its last len(longest stop) - 1 characters) is held back until it cannot."""

    def __init__(self, decoder: IncrementalDecoder, stops: list[str]):
        self.decoder, self.stops = decoder, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, token: int) -> str:
        self.text += self.decoder.push(token)
        return self._emit(self._cut())

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.decoder.flush()
            self._cut()
        return self._emit(final=True)

    def _cut(self) -> bool:
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
        return self.stopped

    def _emit(self, final: bool) -> str:
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent : end], end
        return delta


@dataclass
class Job:
    """One admitted request; events flow from the model thread to the request's event loop."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    session: str | None
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    on_done: Callable[[], None]
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    generated: int = 0  # tokens sampled so far (written by the model thread)
    first_token_at: float | None = None  # perf_counter() when the first token was sampled
    owner: bytes | None = None  # the API key that sent it (None without keys): /api/stats names only its own
    logprobs: int | None = None  # each token's logprob with this many alternatives: ("token", TokenLogprob) events
    prompt_logprobs: int | None = None  # the prompt's too: one ("prompt", [TokenLogprob]) event before any token
    prompt_sent: bool = False
    constraint: TokenConstraint | None = None  # what the answer may be (serve/constrained.py); this job's own

    def count_token(self) -> None:
        self.generated += 1
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def progress(self) -> dict[str, Any]:
        """Prompt tokens, tokens so far and the decode rate since the first token."""
        elapsed = time.perf_counter() - self.first_token_at if self.first_token_at is not None else 0.0
        rate = (self.generated - 1) / elapsed if elapsed > 0 else 0.0
        return {
            "prompt_tokens": len(self.prompt_ids),
            "generated_tokens": self.generated,
            "max_tokens": self.max_tokens,
            "session": self.session,
            "decode_tok_per_s": round(rate, 3),
        }

    def emit(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def emit_prompt_logprobs(self, result: GenerationResult) -> None:
        """The prompt's logprobs, once, when they were asked (before the first token, or at the end of a
        request for no tokens)."""
        if self.prompt_logprobs is not None and not self.prompt_sent:
            self.prompt_sent = True
            self.emit("prompt", list(result.prompt_logprobs))


@dataclass
class Counters:
    served: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0


@dataclass
class Running:
    """A job in the batch: its turn (session, stats) and its text stream."""

    job: Job
    turn: OpenTurn
    stream: TextStream


class ModelThread:
    """The one thread that runs the model: admitted jobs decode together in a ContinuousBatch.

    Between steps new jobs join (a job whose session is already in the batch waits for that turn to
    end: one conversation, one turn at a time) and finished ones leave. Sessions stay open with their
    KV in memory between requests (``SessionPool``, ``held_sessions`` of them); every turn's positions
    are still appended to the session's log, for restarts."""

    def __init__(self, runtime: Runtime, sync_every: int = 0, held_sessions: int = 4):
        self.runtime = runtime
        self.sync_every = sync_every  # also persist each session every N generated tokens (0: at the end)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.counters = Counters()
        self.batch = ContinuousBatch(runtime.loaded.model, runtime.loaded.experts, speculation=runtime.speculation)
        self.pool = SessionPool(held_sessions)
        self.running: dict[Generation, Running] = {}
        self.deferred: list[Job] = []  # admitted, waiting for their session's turn to end
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="colibri-model", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=60)

    def activity(self) -> dict[str, Any]:
        """What the model is doing now, for /api/stats and the dashboard: the requests being generated
        (prompt tokens, tokens so far, their decode tok/s) and the sum of their decode rates."""
        active = [running.job.progress() for running in list(self.running.values())]
        return {"active": active, "decode_tok_per_s": round(sum(a["decode_tok_per_s"] for a in active), 3)}

    def _loop(self) -> None:
        try:
            while not (self.stopping and not self.running):
                self._admit(block=not self.running)
                for generation in self.batch.step() if self.running else []:
                    self._finish(generation)
        finally:
            self.pool.close()

    def _admit(self, block: bool) -> None:
        """Take queued jobs into the batch (waiting for one when the batch is idle)."""
        while True:
            try:
                job = self.jobs.get(block=block and not self.stopping)
            except queue.Empty:
                return
            block = False
            if job is None:  # stop: the running turns end as cancelled (their positions are kept)
                self.stopping = True
                for pending in [*self.deferred, *(r.job for r in self.running.values())]:
                    pending.cancel.set()
                continue
            self._start(job)

    def _start(self, job: Job) -> None:
        if job.cancel.is_set():  # its client left while it waited
            self.counters.cancelled += 1
            self._done(job, "error", ApiError(499, "request cancelled", "cancelled"))
            return
        if job.session is not None and any(r.job.session == job.session for r in self.running.values()):
            self.deferred.append(job)
            return
        tokenizer, chat = self.runtime.text_side()
        stream = TextStream(IncrementalDecoder(tokenizer, chat.stop_ids), job.stops)
        result = GenerationResult(ids=[])  # the generation's, once it is added (its logprobs are read here)

        def on_token(token: int) -> None:
            job.count_token()
            job.emit_prompt_logprobs(result)
            if job.logprobs is not None:
                job.emit("token", result.logprobs[-1])
            if delta := stream.push(token):
                job.emit("text", delta)

        options = TurnOptions(
            job.max_tokens,
            job.sampling,
            job.session,
            tenant=tenant_id(job.owner),  # each API key's prefix-cache blocks are its own
            stop_ids=self.runtime.stop_ids,
            sync_every=self.sync_every,
            on_token=on_token,
            should_stop=lambda: job.cancel.is_set() or stream.stopped,
            logprobs=job.logprobs,
            prompt_logprobs=job.prompt_logprobs,
            constraint=job.constraint,
        )
        try:
            turn = begin_turn(self.runtime, job.prompt_ids, options, self.pool)
        except Exception as exc:
            self._fail(job, exc)
            return
        try:
            generation = self.batch.add(turn.request)
        except Exception as exc:
            abort_turn(turn)
            self._fail(job, exc)
            return
        result = generation.result
        job.emit("started", turn.restored.reused_tokens)  # what a streamed answer's first event reports
        self.running[generation] = Running(job, turn, stream)
        if generation.done:  # asked for nothing to compute (the batch never steps it)
            self._finish(generation)

    def _finish(self, generation: Generation) -> None:
        running = self.running.pop(generation)
        job, stream = running.job, running.stream
        try:
            if generation.error is not None:
                abort_turn(running.turn)
                self._fail(job, generation.error)
                return
            try:
                turn = finish_turn(running.turn, generation.result, self.pool)
            except Exception as exc:
                self._fail(job, exc)
                return
            job.emit_prompt_logprobs(generation.result)
            if tail := stream.finish():
                job.emit("text", tail)
            if stream.stopped:
                turn.finish_reason = "stop"
            if job.cancel.is_set():
                self.counters.cancelled += 1
            else:
                self.counters.served += 1
            self._done(job, "done", turn)
        finally:
            self._release_deferred(job.session)

    def _release_deferred(self, session: str | None) -> None:
        """Start the next job that waited for ``session``'s turn to end."""
        for job in self.deferred:
            if session is not None and job.session == session:
                self.deferred.remove(job)
                self._start(job)
                return

    def _fail(self, job: Job, exc: BaseException) -> None:
        self.counters.failed += 1
        self._done(job, "error", api_error(exc))

    @staticmethod
    def _done(job: Job, kind: str, value: Any) -> None:
        job.emit(kind, value)
        job.loop.call_soon_threadsafe(job.on_done)


def api_error(exc: BaseException) -> ApiError:
    """The HTTP answer for a failed turn: the model thread survives anything one request does."""
    if isinstance(exc, DiskFullError | DiskWriteError):  # the session's log could not be written; nothing lost
        return ApiError(507, str(exc), "insufficient_storage")
    if isinstance(exc, StorageError):  # e.g. the session is open in another process
        return ApiError(409, str(exc), "session_unavailable")
    if isinstance(exc, WorkerError):  # a worker holding experts died or stalled: restart the server with it
        return ApiError(503, str(exc), "worker_unavailable")
    if isinstance(exc, ColibriError):  # a request the library refuses (prompt, sampling)
        return ApiError(400, str(exc), "invalid_request")
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", "internal_error")


class Admission:
    """``slots`` admitted at once, ``max_queue`` waiting; anything more is refused (503)."""

    def __init__(self, slots: int, max_queue: int):
        self.slots, self.max_queue = slots, max_queue
        self.free = asyncio.Semaphore(slots)
        self.busy = 0
        self.waiting = 0

    async def acquire(self) -> None:
        if self.free.locked() and self.waiting >= self.max_queue:
            raise ApiError(503, f"server busy: {self.slots} slots and {self.max_queue} queue places taken", "busy")
        self.waiting += 1
        try:
            await self.free.acquire()
        finally:
            self.waiting -= 1
        self.busy += 1

    def release(self) -> None:
        self.busy -= 1
        self.free.release()
