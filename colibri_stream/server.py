"""The OpenAI-compatible HTTP server: /v1/models, /v1/chat/completions, /v1/completions (JSON or SSE).

One worker thread owns the model and runs one generation at a time, FIFO. ``slots`` requests may be
admitted at once (submitted to the worker); up to ``max_queue`` more wait for a slot; beyond that a
request gets 503 at once, so a flood never grows memory or latency without bound. A request's
``user`` field names its KV session (prefix reuse across requests and restarts). A client that goes
away sets its job's cancel flag, which generation polls after every token, so the model and the
slot are free again within one decode step.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from colibri_stream.conversation import Runtime, TurnResult, run_turn
from colibri_stream.generate import SamplingParams
from colibri_stream.server_schemas import ChatRequest, CompletionRequest, describe_validation_error
from colibri_stream.sessions import check_session_name
from colibri_stream.text import ChatTemplateError, IncrementalDecoder
from storage.errors import StorageError

MAX_BODY_BYTES = 4 * 2**20


class ApiError(Exception):
    """An error with an OpenAI-shaped body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


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
    """One admitted request; events flow from the worker thread to the request's event loop."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    session: str | None
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    on_done: Callable[[], None]
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


@dataclass
class Counters:
    served: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0


class Worker:
    """The one thread that runs the model."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.counters = Counters()
        self.thread = threading.Thread(target=self._loop, name="colibri-model", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=60)

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                if job.cancel.is_set():  # its client left while it waited
                    self.counters.cancelled += 1
                    job.emit("error", ApiError(499, "request cancelled", "cancelled"))
                else:
                    self._run(job)
            finally:
                job.loop.call_soon_threadsafe(job.on_done)

    def _run(self, job: Job) -> None:
        stream = TextStream(IncrementalDecoder(self.runtime.tokenizer, self.runtime.chat.stop_ids), job.stops)

        def on_token(token: int) -> None:
            if delta := stream.push(token):
                job.emit("text", delta)

        try:
            turn = run_turn(
                self.runtime,
                job.prompt_ids,
                job.max_tokens,
                job.sampling,
                job.session,
                on_token,
                lambda: job.cancel.is_set() or stream.stopped,
            )
        except StorageError as exc:  # e.g. the session is open in another process
            self.counters.failed += 1
            job.emit("error", ApiError(409, str(exc), "session_unavailable"))
            return
        except Exception as exc:  # the worker must survive anything one request does
            self.counters.failed += 1
            job.emit("error", ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", "internal_error"))
            return
        if tail := stream.finish():
            job.emit("text", tail)
        if stream.stopped:
            turn.finish_reason = "stop"
        if job.cancel.is_set():
            self.counters.cancelled += 1
        else:
            self.counters.served += 1
        job.emit("done", turn)


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


class Server:
    """Request validation, prompt building and response shaping around a Worker."""

    def __init__(self, runtime: Runtime, slots: int = 4, max_queue: int = 16, default_max_tokens: int | None = None):
        if slots < 1 or max_queue < 0:
            raise ValueError(f"--slots must be >= 1 and --max-queue >= 0, got {slots} and {max_queue}")
        self.runtime = runtime
        self.worker = Worker(runtime)
        self.slots, self.max_queue = slots, max_queue
        self.default_max_tokens = default_max_tokens
        self.admission: Admission | None = None  # made on the server's event loop

    # ------------------------------------------------------------------------------------ prompts
    def chat_prompt(self, body: ChatRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            return self.runtime.encode(self.runtime.chat.render(messages, add_generation_prompt=True))
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), "chat_template_error", "messages") from None

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, str):
            return self.runtime.encode(body.prompt)
        vocab = self.runtime.vocab_size
        if bad := [i for i in body.prompt if not 0 <= i < vocab]:
            raise ApiError(
                400, f"prompt: token ids {bad[:5]} are outside the vocabulary (size {vocab})", "invalid_token", "prompt"
            )
        return list(body.prompt)

    def check_fields(self, body: ChatRequest | CompletionRequest) -> None:
        """Checks before any prompt work: 404 for another model, 400 for a bad session name or stop."""
        if body.model != self.runtime.model_id:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; this server serves {self.runtime.model_id!r}",
                "model_not_found",
                "model",
            )
        if body.user is not None:
            try:
                check_session_name(body.user)
            except ValueError as exc:
                raise ApiError(400, f"user: {exc}", "invalid_session", "user") from None
        try:
            body.stop_strings()
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_stop", "stop") from None

    def token_limit(self, body: ChatRequest | CompletionRequest, prompt: list[int]) -> int:
        """The answer's token budget; 400 when the prompt is empty or prompt + limit overflow the context."""
        context = self.runtime.context_size
        if not prompt:
            raise ApiError(400, "the prompt is empty (0 tokens)", "empty_prompt")
        if len(prompt) >= context:
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens; this model's context is {context} tokens",
                "context_length_exceeded",
                "messages",
            )
        room = context - len(prompt)
        limit = body.token_limit()
        if limit is None:
            return min(room, self.default_max_tokens) if self.default_max_tokens else room
        if limit > room:
            raise ApiError(
                400,
                f"this model's context is {context} tokens; the prompt has {len(prompt)} and "
                f"{limit} more were requested ({len(prompt) + limit} > {context})",
                "context_length_exceeded",
                "max_tokens",
            )
        return limit

    # ------------------------------------------------------------------------------------ jobs
    async def submit(self, body: ChatRequest | CompletionRequest, prompt: list[int], limit: int) -> Job:
        assert self.admission is not None
        try:
            await self.admission.acquire()
        except ApiError:
            self.worker.counters.rejected += 1
            raise
        sampling = SamplingParams(body.temperature, body.top_p, body.seed)
        job = Job(
            prompt, limit, sampling, body.user, body.stop_strings(), asyncio.get_running_loop(), self.admission.release
        )
        self.worker.jobs.put(job)
        return job

    def status(self) -> dict[str, Any]:
        admission = self.admission
        return {
            "status": "ok",
            "model": self.runtime.model_id,
            "slots": self.slots,
            "max_queue": self.max_queue,
            "slots_busy": admission.busy if admission else 0,
            "queued": admission.waiting if admission else 0,
            **vars(self.worker.counters),
        }


def now() -> int:
    return int(time.time())


def usage(turn: TurnResult) -> dict[str, int]:
    return {
        "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": len(turn.ids),
        "total_tokens": turn.prompt_tokens + len(turn.ids),
    }


def finish_reason(turn: TurnResult) -> str:
    return "stop" if turn.finish_reason in ("stop", "cancelled") else "length"


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def parse_body(request: Request, schema: type[ChatRequest] | type[CompletionRequest]):
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {len(raw)} bytes exceeds {MAX_BODY_BYTES}", "body_too_large")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, absurd nesting
        raise ApiError(400, "the request body is not valid JSON", "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise ApiError(400, message, "invalid_value", param) from None


async def collect(request: Request, job: Job) -> tuple[str, TurnResult]:
    """The whole answer; a client that disconnects meanwhile cancels the job."""
    parts: list[str] = []
    while True:
        try:
            kind, value = await asyncio.wait_for(job.events.get(), timeout=0.5)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel.set()
                raise ApiError(499, "client disconnected", "cancelled") from None
            continue
        if kind == "text":
            parts.append(value)
        elif kind == "error":
            raise value
        else:
            return "".join(parts), value


async def stream(job: Job, chunk: Callable[[str | None, str | None], dict[str, Any]]) -> AsyncIterator[bytes]:
    """SSE: one chunk per text delta, a final chunk with finish_reason, then ``data: [DONE]``. However
    the stream ends — finished, failed, or the client gone — the job's cancel flag is set on the way
    out, which is a no-op for a finished job and stops a running one after its current token."""
    try:
        yield sse(chunk(None, None))
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield sse(chunk(value, None))
            elif kind == "error":
                yield sse(value.body())
                break
            else:
                yield sse({**chunk(None, finish_reason(value)), "usage": usage(value), "colibri": value.stats})
                yield b"data: [DONE]\n\n"
                break
    finally:
        job.cancel.set()


def _chat_chunk(cid: str, model: str) -> Callable[[str | None, str | None], dict[str, Any]]:
    def chunk(text: str | None, reason: str | None) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""} if text is None and reason is None else {}
        if text is not None:
            delta = {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        return {"id": cid, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": [choice]}

    return chunk


def _completion_chunk(cid: str, model: str) -> Callable[[str | None, str | None], dict[str, Any]]:
    def chunk(text: str | None, reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        return {"id": cid, "object": "text_completion", "created": now(), "model": model, "choices": [choice]}

    return chunk


def create_app(server: Server) -> FastAPI:
    async def lifespan(app: FastAPI):
        server.admission = Admission(server.slots, server.max_queue)
        server.worker.start()
        yield
        server.worker.stop()

    app = FastAPI(title="colibri-stream", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    model = server.runtime.model_id

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else None).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return ApiError(400, str(exc), "invalid_value").response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return server.status()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {
            "id": model,
            "object": "model",
            "created": now(),
            "owned_by": "colibri-stream",
            "context_length": server.runtime.context_size,
        }
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatRequest)
        server.check_fields(body)
        prompt = server.chat_prompt(body)
        job = await server.submit(body, prompt, server.token_limit(body, prompt))
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if body.stream:
            return StreamingResponse(stream(job, _chat_chunk(cid, model)), media_type="text/event-stream")
        text, turn = await collect(request, job)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason(turn),
            "logprobs": None,
        }
        return {
            "id": cid,
            "object": "chat.completion",
            "created": now(),
            "model": model,
            "choices": [choice],
            "usage": usage(turn),
            "colibri": turn.stats,
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        server.check_fields(body)
        prompt = server.completion_prompt(body)
        job = await server.submit(body, prompt, server.token_limit(body, prompt))
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        if body.stream:
            return StreamingResponse(stream(job, _completion_chunk(cid, model)), media_type="text/event-stream")
        text, turn = await collect(request, job)
        choice = {"index": 0, "text": text, "finish_reason": finish_reason(turn), "logprobs": None}
        return {
            "id": cid,
            "object": "text_completion",
            "created": now(),
            "model": model,
            "choices": [choice],
            "usage": usage(turn),
            "colibri": turn.stats,
        }

    return app
