"""The OpenAI-compatible HTTP server: /v1/models, /v1/chat/completions, /v1/completions (JSON or SSE).

Requests are authenticated (serve/auth.py), read and validated (serve/intake.py) and turned into
prompts here, then run by the model thread (serve/model_thread.py). A request names a KV session only with the
``X-Colibri-Session`` header (prefix reuse across requests and restarts), within its API key's namespace
when keys are set; ``user`` is an opaque label. CPU work
(parsing, template rendering, tokenisation) runs in a small thread pool, never on the event loop, so
one huge prompt does not stall /health or other clients. A client that disconnects cancels its job,
streaming or not.

A one-model server answers whatever ``model`` a request names (agents send their usual model names) and
names the served model in its response; ``strict_model_name`` answers 404 for names other than the
model's id and its ``aliases`` (which /v1/models lists). Logprobs and ``echo``: serve/logprobs.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Any, TypeVar, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from colibri_stream.errors import ChatTemplateError, ColibriError, SessionError
from colibri_stream.planning.settings import BY_NAME
from colibri_stream.runtime.constraint import TokenConstraint
from colibri_stream.runtime.generate import SamplingParams
from colibri_stream.runtime.kv.lock import REFUSE, SessionLease, SessionWait
from colibri_stream.runtime.kv.sessions import check_session_name
from colibri_stream.runtime.sampling import TokenLogprob
from colibri_stream.runtime.turn import Runtime, TurnResult
from colibri_stream.serve.answers import AnswerParser, answer_events, collect, tool_parser
from colibri_stream.serve.anthropic_api import add_anthropic_routes
from colibri_stream.serve.auth import SESSION_HEADER, ApiKeys
from colibri_stream.serve.constrained import chat_constraint
from colibri_stream.serve.dashboard import add_dashboard_routes
from colibri_stream.serve.intake import parse_request, read_body
from colibri_stream.serve.logprobs import ChatShape, CompletionShape, TokenTexts, chat_logprobs, joined
from colibri_stream.serve.model_thread import Admission, Job, ModelThread, api_error
from colibri_stream.serve.request_log import RequestLog, RequestLogMiddleware
from colibri_stream.serve.responses_api import add_responses_routes
from colibri_stream.serve.schemas import ApiError, ChatRequest, CompletionRequest
from colibri_stream.serve.sealed import load_key
from colibri_stream.serve.signing import Signer
from colibri_stream.serve.thinking import effort_thinking, reasoning_splitter
from colibri_stream.text.chat_format import PromptTooLong
from colibri_stream.text.reasoning import ReasoningSplitter
from colibri_stream.text.template_traits import TemplateTraits, template_traits
from colibri_stream.text.tool_calls import ToolCall

PROMPT_THREADS = 2  # parsing and tokenising requests; more would only contend for the same cores
SESSION_WAIT_THREADS = 16  # requests waiting (--wait-session) for a session another process holds; more queue
SESSION_PARAM = "X-Colibri-Session"  # the header as errors name it
SAMPLE_CONVERSATION = [{"role": "user", "content": "Hello"}]  # rendered at start-up to try the template
T = TypeVar("T")


class Server:
    """Request validation, prompt building and response shaping around a ModelThread."""

    def __init__(
        self,
        runtime: Runtime,
        slots: int = 4,
        max_queue: int = 16,
        default_max_tokens: int = cast(int, BY_NAME["default_max_tokens"].default),
        sync_every: int = 0,
        api_keys: ApiKeys | None = None,
        strict_model_name: bool = False,
        aliases: Sequence[str] = (),
        session_wait: SessionWait = REFUSE,
        request_log: RequestLog | None = None,
    ):
        if slots < 1 or max_queue < 0:
            raise ColibriError(f"--slots must be >= 1 and --max-queue >= 0, got {slots} and {max_queue}")
        self.runtime = runtime
        self.model_thread = ModelThread(runtime, sync_every, held_sessions=slots)
        self.slots, self.max_queue = slots, max_queue
        self.default_max_tokens = default_max_tokens
        self.api_keys = api_keys or ApiKeys()
        self.admission: Admission | None = None  # made on the server's event loop
        self.cpu = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="colibri-prompt")
        self.strict_model_name = strict_model_name
        self.names = list(dict.fromkeys([runtime.model_id, *aliases]))  # the id first, no repeats
        # --wait-session: a request whose session another process holds waits for it in a thread of its own
        # (before taking a slot), then holds it until the request is done
        self.stopping = threading.Event()  # set at shutdown: ends every wait for a session
        self.session_wait = dataclasses.replace(session_wait, stop=self.stopping)
        self.waiters = ThreadPoolExecutor(SESSION_WAIT_THREADS, thread_name_prefix="colibri-session-wait")
        self.request_log = request_log  # --request-log: one JSON line per request (serve/request_log.py)

    @cached_property
    def traits(self) -> TemplateTraits:
        """What the model's chat template does with thinking and later system messages (probed once)."""
        return template_traits(self.runtime.text_side()[1])

    @cached_property
    def signer(self) -> Signer:
        """Signs what clients send back (Anthropic thinking blocks) with the server's seal key."""
        return Signer(self.seal_key)

    @cached_property
    def seal_key(self) -> bytes:
        """The one secret of every round trip through a client (serve/sealed.py ``load_key``), read once."""
        return load_key(self.runtime.kv_dir)

    def splitter(self, prompt: list[int]) -> ReasoningSplitter | None:
        """The reader of a thinking model's answer to ``prompt`` (None: the model does not think)."""
        return reasoning_splitter(self.traits, self.runtime.text_side()[0], prompt)

    def check_chat_template(self) -> None:
        """Render and encode a one-message conversation: a template that cannot is the model's
        ChatTemplateError at start-up, not a 400 on every chat request later."""
        self.runtime.encode_chat(SAMPLE_CONVERSATION)

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.cpu, work, *args)

    def authenticate(self, request: Request) -> bytes | None:
        return self.api_keys.authenticate(request.headers)

    def session(self, request: Request, key: bytes | None) -> str | None:
        """The KV session the request names explicitly (the X-Colibri-Session header), in its key's
        namespace; None: stateless (the prefix cache still reuses any cached prefix). 400 for a bad name."""
        name = request.headers.get(SESSION_HEADER)
        if name is None:
            return None
        try:
            check_session_name(name)
        except SessionError as exc:
            raise ApiError(400, f"{SESSION_PARAM}: {exc}", "invalid_session", SESSION_PARAM) from None
        return self.api_keys.session_name(key, name)

    # ------------------------------------------------------------------------------------ prompts
    def chat_prompt(self, body: ChatRequest) -> list[int]:
        try:
            messages = [m.for_template() for m in body.messages]
        except ValueError as exc:  # an assistant tool call whose arguments are no JSON object
            raise ApiError(400, f"messages: {exc}", "invalid_value", "messages") from None
        options = self.traits.options(effort_thinking(body.reasoning_effort))
        return self.encode_messages(messages, body.offered_tools(), options)

    def encode_messages(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: dict[str, bool] | None = None,
    ) -> list[int]:
        """The conversation (and the tools offered) through the chat template (``options``: its switches,
        TemplateTraits.options), as prompt ids; a prompt that cannot fit the context is refused before it
        is encoded whole (PromptEncoder's limit)."""
        chat = self.runtime.text_side()[1]
        encoder = self.runtime.prompt_encoder
        try:
            return encoder.encode_chat(chat, messages, True, tools or None, self.prompt_limit, options)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), "chat_template_error", "messages") from None
        except PromptTooLong as exc:
            raise self.too_long(exc.at_least, "messages") from None

    @property
    def prompt_limit(self) -> int:
        return self.runtime.context_size - 1  # an answer needs one more position

    def too_long(self, tokens: int, param: str, at_least: bool = True) -> ApiError:
        """The one refusal of a prompt that fills the context, whenever it is found."""
        count = f"at least {tokens}" if at_least else f"{tokens}"
        context = self.runtime.context_size
        message = f"the prompt has {count} tokens; this model's context is {context} tokens"
        return ApiError(400, message, "context_length_exceeded", param)

    def completion_prompts(self, body: CompletionRequest) -> list[tuple[list[int], str | None]]:
        """Each prompt's ids, and its text when the request echoes it (a prompt of ids: their decoding)."""
        return [self.completion_prompt(prompt, body.echo) for prompt in body.prompts()]

    def completion_prompt(self, prompt: str | list[int], echo: bool) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            try:
                return self.runtime.prompt_encoder.encode(prompt, self.prompt_limit), prompt if echo else None
            except PromptTooLong as exc:
                raise self.too_long(exc.at_least, "prompt") from None
        vocab = self.runtime.vocab_size
        if bad := [i for i in prompt if not 0 <= i < vocab]:
            raise ApiError(
                400, f"prompt: token ids {bad[:5]} are outside the vocabulary (size {vocab})", "invalid_token", "prompt"
            )
        text = self.runtime.text_side()[0].decode(prompt, skip_special_tokens=False) if echo else None
        return list(prompt), text

    def check_fields(self, body: ChatRequest | CompletionRequest) -> None:
        """Checks before any prompt work: 404 for another model (``strict_model_name`` only), 400 for a
        bad stop or logprobs request."""
        if self.strict_model_name and body.model not in self.names:
            served = " or ".join(repr(name) for name in self.names)
            raise ApiError(
                404, f"model {body.model!r} does not exist; this server serves {served}", "model_not_found", "model"
            )
        try:
            body.stop_strings()
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_stop", "stop") from None
        if isinstance(body, ChatRequest):
            try:
                body.offered_tools()
            except ValueError as exc:
                raise ApiError(400, str(exc), "invalid_value", "tool_choice") from None
            try:
                body.logprob_count()
            except ValueError as exc:
                raise ApiError(400, str(exc), "invalid_value", "top_logprobs") from None
        if isinstance(body, CompletionRequest):
            try:
                body.prompts()
            except ValueError as exc:
                param = str(exc).split(":", 1)[0]
                raise ApiError(400, str(exc), "invalid_value", param) from None

    def token_limit(self, body: ChatRequest | CompletionRequest, prompt: list[int]) -> int:
        """The answer's token budget: the request's (else ``default_max_tokens``), cut to the room the context
        leaves (agents ask for their cloud model's output size: Claude Code 64000, OpenCode 32000 of a 32k
        context; a cut answer ends with "length"); 400 when the prompt is empty or fills the context."""
        context = self.runtime.context_size
        if not prompt:
            raise ApiError(400, "the prompt is empty (0 tokens)", "empty_prompt")
        if len(prompt) >= context:
            raise self.too_long(len(prompt), "messages", at_least=False)
        limit = body.token_limit()
        return min(context - len(prompt), self.default_max_tokens if limit is None else limit)

    # ------------------------------------------------------------------------------------ jobs
    async def submit(
        self,
        body: ChatRequest | CompletionRequest,
        prompt: list[int],
        limit: int,
        session: str | None,
        owner: bytes | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        constraint: TokenConstraint | None = None,
    ) -> Job:
        assert self.admission is not None
        lease = await self.wait_for_session(session)
        try:
            await self.admission.acquire()
        except BaseException as exc:  # refused (503), or the client left while queued: the lease goes back
            if isinstance(exc, ApiError):
                self.model_thread.counters.rejected += 1
            if lease is not None:
                lease.release()
            raise
        sampling = SamplingParams(body.temperature, body.top_p, body.seed)
        release = self.admission.release
        job = Job(
            prompt, limit, sampling, session, body.stop_strings(), asyncio.get_running_loop(), _then(lease, release)
        )
        job.owner, job.logprobs, job.prompt_logprobs = owner, logprobs, prompt_logprobs
        job.constraint = constraint
        self.model_thread.jobs.put(job)
        return job

    async def wait_for_session(self, session: str | None) -> SessionLease | None:
        """With --wait-session, the session's lease once no other process holds it (409 if the wait runs
        out); None without the flag (the model thread's turn takes the lock, or answers 409)."""
        if session is None or self.session_wait.seconds == 0:
            return None
        loop = asyncio.get_running_loop()
        waiting = loop.run_in_executor(self.waiters, SessionLease, self.runtime.kv_dir, session, self.session_wait)
        try:
            return await asyncio.shield(waiting)
        except ColibriError as exc:  # still in use after the wait, or a lock file that cannot be used
            raise api_error(exc) from None
        except asyncio.CancelledError:  # the client left: a lease the thread still gets is given back
            waiting.add_done_callback(_release_unused)
            raise

    def status(self) -> dict[str, Any]:
        admission = self.admission
        return {
            "status": "ok",
            "model": self.runtime.model_id,
            "slots": self.slots,
            "max_queue": self.max_queue,
            "slots_busy": admission.busy if admission else 0,
            "queued": admission.waiting if admission else 0,
            "batch": len(self.model_thread.running),  # generations decoding together now
            "sessions_in_memory": len(self.model_thread.pool),
            **vars(self.model_thread.counters),
        }


def _release_unused(waiting: asyncio.Future[SessionLease]) -> None:
    """A lease whose request was cancelled while it waited: released once the wait ends with one."""
    if not waiting.cancelled() and waiting.exception() is None:
        waiting.result().release()


def _then(lease: SessionLease | None, release: Callable[[], None]) -> Callable[[], None]:
    """A job's on_done: the session lease it waited for (if any) given back, then its slot."""
    if lease is None:
        return release

    def done() -> None:
        lease.release()
        release()

    return done


def now() -> int:
    return int(time.time())


def usage(*turns: TurnResult) -> dict[str, Any]:
    """OpenAI's usage of one or more turns; cached_tokens: prompt tokens whose KV was reused, not computed."""
    prompt, completion = sum(t.prompt_tokens for t in turns), sum(len(t.ids) for t in turns)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(t.stats["reused_tokens"] for t in turns)},
    }


def finish_reason(turn: TurnResult, calls: int = 0) -> str:
    if calls:
        return "tool_calls"
    return "stop" if turn.finish_reason in ("stop", "cancelled") else "length"


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


Chunk = Callable[..., dict[str, Any]]  # (text, finish_reason, tool_call delta or None, logprobs) -> one chunk
Shape = ChatShape | CompletionShape


async def stream(
    job: Job,
    chunk: Chunk,
    parser: AnswerParser | None = None,
    shape: Shape | None = None,
    echo: str | None = None,
    splitter: ReasoningSplitter | None = None,
) -> AsyncIterator[bytes]:
    """SSE: one chunk per text delta or tool call, a final chunk with finish_reason, then ``data:
    [DONE]``; with ``echo`` the prompt's text (and logprobs, when asked) comes first. With ``shape`` each
    chunk carries the logprobs of the tokens since the previous one; a thinking model's reasoning (read by
    ``splitter``) comes as ``delta.reasoning_content`` (DeepSeek's convention). However the stream ends — finished,
    failed, or the client gone — the job's cancel flag is set on the way out, which is a no-op for a
    finished job and stops a running one after its current token."""
    calls, tokens = 0, list[TokenLogprob]()

    def logprobs() -> dict[str, Any] | None:
        if shape is None:
            return None
        taken = shape.tokens(tokens)
        tokens.clear()
        return taken

    try:
        yield sse(chunk(None, None))
        if echo is not None and job.prompt_logprobs is None:
            yield sse(chunk(echo, None))
        async for kind, value in answer_events(job, parser, splitter):
            if kind == "token":
                tokens.append(value)
            elif kind == "prompt":
                assert shape is not None and echo is not None  # asked only with both
                yield sse(chunk(echo, None, None, shape.prompt(value)))
            elif kind == "text":
                yield sse(chunk(value, None, None, logprobs()))
            elif kind == "reasoning":
                thought = chunk("", None, None, logprobs())
                thought["choices"][0]["delta"] = {"reasoning_content": value}
                yield sse(thought)
            elif kind == "tool_call":
                yield sse(chunk(None, None, {**openai_tool_call(value), "index": calls}, logprobs()))
                calls += 1
            elif kind == "error":
                yield sse(value.body())
            elif kind == "done":
                last = chunk(None, finish_reason(value, calls), None, logprobs())
                yield sse({**last, "usage": usage(value), "colibri": value.stats})
                yield b"data: [DONE]\n\n"
    finally:
        job.cancel.set()


def openai_tool_call(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments_json()}
    return {"id": call.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def _chat_chunk(cid: str, model: str) -> Chunk:
    def chunk(
        text: str | None,
        reason: str | None,
        tool_call: dict[str, Any] | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if text is None and reason is None else {}
        if text is not None:
            delta = {"content": text}
        if tool_call is not None:
            delta = {"tool_calls": [tool_call]}
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        return {"id": cid, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": [choice]}

    return chunk


def _completion_chunk(cid: str, model: str) -> Chunk:
    def chunk(
        text: str | None, reason: str | None, tool_call: None = None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        return {"id": cid, "object": "text_completion", "created": now(), "model": model, "choices": [choice]}

    return chunk


def create_app(server: Server) -> FastAPI:
    async def lifespan(app: FastAPI):
        server.admission = Admission(server.slots, server.max_queue)
        server.model_thread.start()
        yield
        server.stopping.set()  # requests still waiting for a session (--wait-session) give up now
        server.model_thread.stop()
        server.cpu.shutdown(wait=False, cancel_futures=True)
        server.waiters.shutdown(wait=False, cancel_futures=True)

    async def parse_body(request: Request, schema: type[ChatRequest] | type[CompletionRequest]):
        return await server.off_loop(parse_request, await read_body(request), schema, schema.unimplemented)

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

    @app.head("/", include_in_schema=False)
    async def probe() -> Response:
        """Claude Code probes ``HEAD /`` before its first request (GET / is the dashboard's page)."""
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.authenticate(request)
        entry = {
            "object": "model",
            "created": now(),
            "owned_by": "colibri-stream",
            "root": model,  # an alias names the served model
            "context_length": server.runtime.context_size,
        }
        return {"object": "list", "data": [{"id": name, **entry} for name in server.names]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        key = server.authenticate(request)  # before the body is read: strangers cost nothing
        body = await parse_body(request, ChatRequest)
        server.check_fields(body)
        session = server.session(request, key)
        constrained = await server.off_loop(chat_constraint, server.runtime, body)  # forced call, response_format
        forced = constrained.parser() if constrained is not None else None
        parser = forced or tool_parser(server.runtime, body.offered_tools())
        prompt = await server.off_loop(server.chat_prompt, body)
        top_n, splitter = body.logprob_count(), server.splitter(prompt)
        limit = server.token_limit(body, prompt)
        constraint = constrained.constraint if constrained is not None else None
        job = await server.submit(body, prompt, limit, session, key, logprobs=top_n, constraint=constraint)
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        texts = TokenTexts(server.runtime.text_side()[0])
        if body.stream:
            shape = ChatShape(texts) if top_n is not None else None
            events = stream(job, _chat_chunk(cid, model), parser, shape, splitter=splitter)
            return StreamingResponse(events, media_type="text/event-stream")
        answer = await collect(request, job, parser, splitter)
        text, turn = answer.text, answer.turn
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not answer.calls else None}
        if splitter is not None:
            message["reasoning_content"] = answer.reasoning
        if answer.calls:
            message["tool_calls"] = [openai_tool_call(call) for call in answer.calls]
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": finish_reason(turn, len(answer.calls)),
            "logprobs": chat_logprobs(answer.logprobs, texts) if top_n is not None else None,
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
        """One choice per prompt, computed one after another; ``colibri`` holds the stats of the one
        turn, or a list of them for several prompts."""
        key = server.authenticate(request)
        body = await parse_body(request, CompletionRequest)
        server.check_fields(body)
        session = server.session(request, key)
        if body.prompt_logprob_count() is not None and session is not None:
            raise ApiError(
                400,
                f"{SESSION_PARAM}: a request for its prompt's logprobs (echo with logprobs) computes the whole "
                "prompt, so it cannot continue a session",
                "invalid_value",
                SESSION_PARAM,
            )
        prompts = await server.off_loop(server.completion_prompts, body)
        limits = [server.token_limit(body, prompt) for prompt, _ in prompts]  # every prompt checked first
        texts = TokenTexts(server.runtime.text_side()[0]) if body.logprobs is not None else None
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        choices, turns = [], []
        for index, ((prompt, echo), limit) in enumerate(zip(prompts, limits, strict=True)):
            job = await server.submit(body, prompt, limit, session, key, body.logprobs, body.prompt_logprob_count())
            shape = CompletionShape(texts, prompt, echo) if texts is not None else None
            if body.stream:
                events = stream(job, _completion_chunk(cid, model), shape=shape, echo=echo)
                return StreamingResponse(events, media_type="text/event-stream")
            answer = await collect(request, job)
            if job.cancel.is_set():  # the client left: the prompts after this one are not run
                raise ApiError(499, "request cancelled", "cancelled")
            text = (echo or "") + answer.text
            logprobs = None
            if shape is not None:  # the echoed prompt's entries first: their offsets come first
                echoed = shape.prompt(answer.prompt_logprobs) if echo is not None else None
                logprobs = shape.tokens(answer.logprobs)
                logprobs = joined(echoed, logprobs) if echoed is not None else logprobs
            reason = finish_reason(answer.turn)
            choices.append({"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs})
            turns.append(answer.turn)
        return {
            "id": cid,
            "object": "text_completion",
            "created": now(),
            "model": model,
            "choices": choices,
            "usage": usage(*turns),
            "colibri": turns[0].stats if len(turns) == 1 else [turn.stats for turn in turns],
        }

    add_anthropic_routes(app, server)
    add_responses_routes(app, server)
    add_dashboard_routes(app, server)
    if server.request_log is not None:
        app.add_middleware(RequestLogMiddleware, log=server.request_log)
    return app
