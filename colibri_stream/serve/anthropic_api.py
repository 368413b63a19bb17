"""The Anthropic Messages API: ``POST /v1/messages`` (JSON or SSE) and ``POST /v1/messages/count_tokens``.

A request (system, messages of text / tool_use / tool_result blocks, tools) is mapped onto the same
template messages as an OpenAI chat request (assistant ``tool_calls``, ``tool`` messages), so one chat
template renders both, and runs through the same Server (auth, limits, sessions, model thread). Only the shapes
differ: the answer is a message of content blocks with a stop_reason, streamed as Anthropic's event
sequence (message_start, ping, content_block_start / _delta / _stop per block, message_delta with the
stop_reason and usage, message_stop), and every failure on these routes, authentication and validation
included, is ``{"type": "error", "error": {"type", "message"}}``. ``metadata.user_id`` is an opaque
label (a session is named only by the X-Colibri-Session header, serve/auth.py). Usage counts the
prompt's reused tokens (their KV taken from a session or the prefix cache) as ``cache_read_input_tokens``
and the computed rest as ``input_tokens``, as Anthropic counts them, in ``message_start`` too (sent once
the turn has begun, when the reuse is known). ``thinking`` and thinking blocks: serve/anthropic_thinking.py.
A ``system`` message among ``messages`` (Claude Code sends them) is rendered where it stands when the
template does that, else merged into the leading system prompt (text/template_traits.py). Fields of the
API that would change the answer and are not implemented (``mcp_servers``, ``container``; ``top_k``) are
a 400 naming them; any ``anthropic-beta`` header and ``?beta=true`` are accepted.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, field_validator

from colibri_stream.runtime.constraint import TokenConstraint
from colibri_stream.runtime.turn import TurnResult
from colibri_stream.serve.answers import Answer, AnswerParser, answer_events, collect, tool_parser
from colibri_stream.serve.anthropic_thinking import (
    OutputConfig,
    RedactedThinkingBlock,
    ThinkingBlock,
    ThinkingConfig,
    thinking_block,
    verified_reasoning,
    wants_thinking,
)
from colibri_stream.serve.constrained import anthropic_constraint
from colibri_stream.serve.intake import parse_request, read_body
from colibri_stream.serve.model_thread import Job
from colibri_stream.serve.schemas import STRICT, TOOL_NAME, ApiError, NoOps, check_label, template_call
from colibri_stream.serve.signing import Signer
from colibri_stream.text.reasoning import ReasoningSplitter
from colibri_stream.text.template_traits import TemplateTraits, place_system_messages
from colibri_stream.text.tool_calls import ToolCall

Server = Any  # serve.app.Server, which imports this module (so it cannot be imported here)

MAX_STOP_SEQUENCES = 16
MAX_TOOLS = 256
# What these fields accept as asking for nothing (schemas.refuse_unimplemented); anything else is a 400.
UNIMPLEMENTED: NoOps = {"mcp_servers": ([],), "container": ()}

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


# ------------------------------------------------------------------------------------ request schema
class TextBlock(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = STRICT
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=TOOL_NAME)
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = STRICT
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {text}" if self.is_error else text


Block = Annotated[
    TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]


class Message(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolSpec(BaseModel):
    model_config = STRICT
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) are not offered
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(BaseModel):
    model_config = STRICT
    user_id: str | None = None  # an opaque label (Claude Code's is a JSON string), never a session name

    @field_validator("user_id")
    @classmethod
    def _a_label(cls, value: str | None) -> str | None:
        return check_label(value)


class MessagesRequest(BaseModel):
    """A Messages API request. ``temperature``, ``top_p``, ``seed``, ``stop_strings`` and ``token_limit``
    are what Server.check_fields / submit / token_limit read of any request."""

    model_config = STRICT
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None  # its effort is accepted; nothing here grades effort

    @property
    def seed(self) -> None:
        return None  # the API has no seed

    def stop_strings(self) -> list[str]:
        stops = list(self.stop_sequences or [])
        if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
            raise ValueError(f"stop_sequences: at most {MAX_STOP_SEQUENCES} non-empty strings")
        return stops

    def token_limit(self) -> int | None:
        return self.max_tokens

    def check_supported(self) -> None:
        if self.top_k is not None:
            raise ApiError(400, "top_k: not supported by this server (temperature and top_p are)", param="top_k")

    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools in Hugging Face's function shape; none for tool_choice "none". A choice that forces
        a call ("any", "tool") needs tools, and "tool" a name (serve/constrained.py forces it)."""
        choice = self.tool_choice.type if self.tool_choice is not None else "auto"
        if choice in ("any", "tool") and not self.tools:
            raise ApiError(400, "tool_choice: forcing a tool call needs tools", param="tool_choice")
        if choice == "tool" and self.tool_choice is not None and self.tool_choice.name is None:
            raise ApiError(400, 'tool_choice.name: required for type "tool"', param="tool_choice.name")
        if not self.tools or choice == "none":
            return []
        return [{"type": "function", "function": _function(tool)} for tool in self.tools]

    def template_messages(self, signer: Signer, traits: TemplateTraits) -> list[dict[str, Any]]:
        """The conversation as chat-template messages (the OpenAI shape; see module docstring)."""
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        messages = [{"role": "system", "content": system}] if system else []
        for position, message in enumerate(self.messages):
            messages += _template_messages(message, f"messages.{position}", signer)
        return place_system_messages(messages, traits)


class CountTokensRequest(MessagesRequest):
    max_tokens: int | None = Field(None, ge=1)  # type: ignore[assignment]  # optional here: not needed to count


def _function(tool: ToolSpec) -> dict[str, Any]:
    """OpenAI's function shape, keys in OpenAI's order (templates write it as JSON: the same tools
    make the same prompt whichever API sent them)."""
    described = {"description": tool.description} if tool.description is not None else {}
    return {"name": tool.name, **described, "parameters": tool.input_schema}


def _template_messages(message: Message, where: str, signer: Signer) -> list[dict[str, Any]]:
    """One Anthropic message -> template messages: a user's tool_result blocks become ``tool`` messages
    (first, as Anthropic puts them first), its text one user message; an assistant's text and tool_use
    blocks one assistant message with ``tool_calls``, its verified thinking blocks its
    ``reasoning_content``; a system message's text blocks one system message."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
    if message.role == "system":
        if any(not isinstance(b, TextBlock) for b in message.content):
            raise ApiError(400, f"{where}.content: a system message holds text blocks only", param=where)
        return [{"role": "system", "content": text}]
    if message.role == "assistant":
        if any(isinstance(b, ToolResultBlock) for b in message.content):
            raise ApiError(400, f"{where}: tool_result blocks belong in a user message", param=where)
        calls = [template_call(b.id, b.name, b.input) for b in message.content if isinstance(b, ToolUseBlock)]
        reasoning = "".join(
            verified_reasoning(signer, b, f"{where}.content.{k}")
            for k, b in enumerate(message.content)
            if isinstance(b, ThinkingBlock)
        )
        extra = {"tool_calls": calls} if calls else {}
        return [
            {"role": "assistant", "content": text, **extra, **({"reasoning_content": reasoning} if reasoning else {})}
        ]
    if any(isinstance(b, ThinkingBlock) for b in message.content):
        raise ApiError(400, f"{where}: thinking blocks belong in an assistant message", param=where)
    if any(isinstance(b, ToolUseBlock) for b in message.content):
        raise ApiError(400, f"{where}: tool_use blocks belong in an assistant message", param=where)
    results = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
        for b in message.content
        if isinstance(b, ToolResultBlock)
    ]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


# ------------------------------------------------------------------------------------ responses
def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)


def error_body(exc: ApiError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id or f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": {}}


StopReason = Callable[[TurnResult, int], tuple[str, str | None]]


def stop_reason_of(server: Server, stops: list[str]) -> StopReason:
    """(stop_reason, stop_sequence) of a finished turn: tool_use when it called tools, max_tokens when
    it ran out, stop_sequence when the first stop string in its text cut it, else end_turn."""

    def reason(turn: TurnResult, calls: int) -> tuple[str, str | None]:
        if calls:
            return "tool_use", None
        if turn.finish_reason == "length":
            return "max_tokens", None
        if stops and server.runtime.tokenizer is not None:
            text = server.runtime.tokenizer.decode(turn.ids)
            found = [(text.find(s), s) for s in stops if s in text]
            if found:
                return "stop_sequence", min(found)[1]
        return "end_turn", None

    return reason


def message_json(
    mid: str, model: str, answer: Answer, stop_reason: StopReason, signer: Signer | None = None
) -> dict[str, Any]:
    """``signer``: the reasoning is returned (as a signed thinking block), else dropped."""
    content: list[dict[str, Any]] = [thinking_block(signer, answer.reasoning)] if signer and answer.reasoning else []
    content += [{"type": "text", "text": answer.text}] if answer.text or not answer.calls else []
    content += [{**tool_use_block(call), "input": call.arguments} for call in answer.calls]
    reason, sequence = stop_reason(answer.turn, len(answer.calls))
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": anthropic_usage(answer.turn),
        "colibri": answer.turn.stats,
    }


def anthropic_usage(turn: TurnResult) -> dict[str, int]:
    """Anthropic's split: ``input_tokens`` computed, ``cache_read_input_tokens`` reused (their sum is the
    prompt); nothing is written to a cache the way Anthropic bills it (``cache_creation_input_tokens`` 0)."""
    reused = turn.stats["reused_tokens"]
    return {
        "input_tokens": turn.prompt_tokens - reused,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": reused,
        "output_tokens": len(turn.ids),
    }


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, separators=(',', ':'))}\n\n".encode()


class _Blocks:
    """The content blocks of a streamed message, numbered in order; a thinking or text block stays open
    until another block or the end closes it (a thinking block with its signature_delta, which signs
    all of its text)."""

    def __init__(self, signer: Signer | None = None) -> None:
        self.index, self.open, self.calls = 0, "", 0  # open: "", "text" or "thinking"
        self.signer, self.thought = signer, list[str]()
        self.texts = 0  # text blocks started

    def text(self, delta: str) -> list[bytes]:
        out = [] if self.open == "text" else [*self.close(), self._start({"type": "text", "text": ""})]
        self.open = "text"
        text = {"type": "text_delta", "text": delta}
        return out + [event("content_block_delta", {"index": self.index, "delta": text})]

    def thinking(self, delta: str) -> list[bytes]:
        """A reasoning delta: shown only when thinking was asked for (a signer), else dropped."""
        if self.signer is None:
            return []
        out = [] if self.open == "thinking" else [*self.close(), self._start({"type": "thinking", "thinking": ""})]
        self.open = "thinking"
        self.thought.append(delta)
        thought = {"type": "thinking_delta", "thinking": delta}
        return out + [event("content_block_delta", {"index": self.index, "delta": thought})]

    def tool_call(self, call: ToolCall) -> list[bytes]:
        arguments = {"type": "input_json_delta", "partial_json": call.arguments_json()}
        self.calls += 1
        return [
            *self.close(),
            self._start(tool_use_block(call)),
            event("content_block_delta", {"index": self.index, "delta": arguments}),
            *self._stop(),
        ]

    def close(self) -> list[bytes]:
        was, self.open = self.open, ""
        if was == "thinking" and self.signer is not None:
            text, self.thought = "".join(self.thought), []
            signature = {"type": "signature_delta", "signature": thinking_block(self.signer, text)["signature"]}
            return [event("content_block_delta", {"index": self.index, "delta": signature}), *self._stop()]
        return self._stop() if was else []

    def finish(self) -> list[bytes]:
        """Close the open block; an answer with no text or tool_use block gets an empty text block (as
        JSON does)."""
        if self.calls == 0 and self.open != "text" and not self.texts:
            return [*self.text(""), *self.close()]
        return self.close()

    def _start(self, block: dict[str, Any]) -> bytes:
        self.texts += block["type"] == "text"
        return event("content_block_start", {"index": self.index, "content_block": block})

    def _stop(self) -> list[bytes]:
        self.index += 1
        return [event("content_block_stop", {"index": self.index - 1})]


def _started(shell: dict[str, Any], reused: int) -> list[bytes]:
    """message_start, its usage split as the final usage is (the reuse is known once the turn began),
    then a ping."""
    prompt = shell["usage"]["input_tokens"]
    usage = {"input_tokens": prompt - reused, "cache_creation_input_tokens": 0, "cache_read_input_tokens": reused}
    return [event("message_start", {"message": {**shell, "usage": {**usage, "output_tokens": 0}}}), event("ping", {})]


async def stream_message(
    job: Job,
    parser: AnswerParser | None,
    shell: dict[str, Any],
    stop_reason: StopReason,
    splitter: ReasoningSplitter | None = None,
    signer: Signer | None = None,
) -> AsyncIterator[bytes]:
    """The SSE event sequence (``signer``: reasoning shown as thinking blocks); the job is cancelled
    however the stream ends (see app.stream). ``shell``'s usage holds the prompt's length."""
    blocks, started = _Blocks(signer), False
    try:
        async for kind, value in answer_events(job, parser, splitter):
            if not started:  # the model thread's first event is "started"; the others never come before it
                started = True
                for chunk in _started(shell, value if kind == "started" else 0):
                    yield chunk
            if kind == "reasoning":
                for chunk in blocks.thinking(value):
                    yield chunk
            elif kind == "text":
                for chunk in blocks.text(value):
                    yield chunk
            elif kind == "tool_call":
                for chunk in blocks.tool_call(value):
                    yield chunk
            elif kind == "error":
                yield event("error", {"error": error_body(value)["error"]})
            elif kind == "done":
                for chunk in blocks.finish():
                    yield chunk
                reason, sequence = stop_reason(value, blocks.calls)
                delta = {"stop_reason": reason, "stop_sequence": sequence}
                yield event("message_delta", {"delta": delta, "usage": anthropic_usage(value)})
                yield event("message_stop", {})
    finally:
        job.cancel.set()


# ------------------------------------------------------------------------------------ routes
def add_anthropic_routes(app: FastAPI, server: Server) -> None:
    model = server.runtime.model_id

    async def read(request: Request, schema: type[MessagesRequest]) -> tuple[bytes | None, MessagesRequest]:
        key = server.authenticate(request)  # before the body is read: strangers cost nothing
        body = await server.off_loop(parse_request, await read_body(request), schema, UNIMPLEMENTED)
        server.check_fields(body)
        body.check_supported()
        return key, body

    def encode(body: MessagesRequest) -> list[int]:
        """The prompt as the template renders it: messages, tools, and the thinking switch."""
        options = server.traits.options(wants_thinking(body.thinking))
        messages = body.template_messages(server.signer, server.traits)
        return server.encode_messages(messages, body.offered_tools(), options)

    async def prompt_of(body: MessagesRequest) -> tuple[list[int], AnswerParser | None, TokenConstraint | None]:
        tools, choice = body.offered_tools(), body.tool_choice
        forced = None
        if choice is not None:  # "any" / "tool": the call is decoded under its grammar (serve/constrained.py)
            parallel = not choice.disable_parallel_tool_use
            forced = await server.off_loop(
                anthropic_constraint, server.runtime, choice.type, choice.name, tools, parallel
            )
        parser = forced.parser() if forced is not None else tool_parser(server.runtime, tools)
        prompt = await server.off_loop(encode, body)
        return prompt, parser, forced.constraint if forced is not None else None

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            key, body = await read(request, MessagesRequest)
            session = server.session(request, key)
            prompt, parser, constraint = await prompt_of(body)
            limit = server.token_limit(body, prompt)  # max_tokens cut to the context's room
            job = await server.submit(body, prompt, limit, session, key, constraint=constraint)
            mid = f"msg_{uuid.uuid4().hex[:24]}"
            stop_reason = stop_reason_of(server, body.stop_strings())
            splitter = server.splitter(prompt)
            signer = server.signer if wants_thinking(body.thinking) else None
            if body.stream:
                shell = {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": len(prompt), "output_tokens": 0},
                }
                events = stream_message(job, parser, shell, stop_reason, splitter, signer)
                return StreamingResponse(events, media_type="text/event-stream")
            answer = await collect(request, job, parser, splitter)
            return message_json(mid, model, answer, stop_reason, signer)
        except ApiError as exc:
            return error_response(exc)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """What ``messages`` would render (system, tools, the thinking setting), counted."""
        try:
            _, body = await read(request, CountTokensRequest)
            prompt, _, _ = await prompt_of(body)
            return {"input_tokens": len(prompt)}
        except ApiError as exc:
            return error_response(exc)
