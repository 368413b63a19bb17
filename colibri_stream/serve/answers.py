"""A job's answer as the API routes use it: its text split into text and tool calls (when the request
offered tools), either collected whole or iterated as it streams. Shared by the OpenAI and Anthropic
routes, which only shape what comes out of here.

A job's events (model_thread.Job) are ("text", delta) ..., then ("done", TurnResult) or ("error", ApiError);
a job that asked for logprobs also gets ("prompt", [TokenLogprob]) before its first token and one
("token", TokenLogprob) per token, before that token's text. ``answer_events`` passes them on with each
text delta run through the request's ToolCallParser, so they become ("text", str) and ("tool_call",
ToolCall) events, in the order the model wrote them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from colibri_stream.runtime.sampling import TokenLogprob
from colibri_stream.runtime.turn import Runtime, TurnResult
from colibri_stream.serve import request_log
from colibri_stream.serve.model_thread import Job
from colibri_stream.serve.schemas import ApiError
from colibri_stream.text.tool_calls import ToolCall, ToolCallParser, tools_from_functions

KNOWN_FORMATS = "DeepSeek-V3/R1, DeepSeek-V3.1/V3.2-Exp, DeepSeek-V3.2/V4 DSML, GLM-4.5/5, Kimi-K2"


def tool_parser(runtime: Runtime, tools: Sequence[dict[str, Any]], param: str = "tools") -> ToolCallParser | None:
    """The parser for a request offering ``tools`` (Hugging Face's function shape); None without tools.
    A model whose chat template speaks no known tool format cannot be offered tools: 400."""
    if not tools:
        return None
    chat = runtime.chat
    tool_format = chat.tool_format if chat is not None else None
    if tool_format is None:
        raise ApiError(
            400,
            f"{param}: this model's chat template has no tool-call format colibri knows ({KNOWN_FORMATS}), "
            "so it cannot be offered tools",
            "tools_unsupported",
            param,
        )
    return ToolCallParser(tool_format, tools_from_functions([tool["function"] for tool in tools]))


async def answer_events(job: Job, parser: ToolCallParser | None) -> AsyncIterator[tuple[str, Any]]:
    """("text", str), ("tool_call", ToolCall), ("prompt", ...) and ("token", ...) events, then ("done",
    TurnResult) or ("error", ApiError)."""
    while True:
        kind, value = await job.events.get()
        if kind == "text":
            for event in parser.push(value) if parser is not None else [("text", value)]:
                _note(event)
                yield event
        elif kind in ("prompt", "token"):
            yield kind, value
        elif kind == "error":
            yield kind, value
            return
        else:
            for event in parser.finish() if parser is not None else []:
                _note(event)
                yield event
            request_log.note_turn(value, job)
            yield "done", value
            return


def _note(event: tuple[str, Any]) -> None:
    if event[0] == "tool_call":  # counted for serve --request-log
        request_log.note_tool_call()


@dataclass
class Answer:
    text: str
    calls: list[ToolCall]
    turn: TurnResult
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., when asked


async def collect(request: Request, job: Job, parser: ToolCallParser | None = None) -> Answer:
    """The whole answer. Meanwhile a watcher waits for the client's disconnect (the body is read, so
    the next ASGI message is that) and cancels the job: generation stops after its current token."""
    watcher = asyncio.create_task(cancel_on_disconnect(request, job))
    parts: list[str] = []
    calls: list[ToolCall] = []
    logprobs: list[TokenLogprob] = []
    prompt: list[TokenLogprob] = []
    try:
        async for kind, value in answer_events(job, parser):
            if kind == "text":
                parts.append(value)
            elif kind == "tool_call":
                calls.append(value)
            elif kind == "token":
                logprobs.append(value)
            elif kind == "prompt":
                prompt = value
            elif kind == "error":
                raise value
            else:
                return Answer("".join(parts), calls, value, logprobs, prompt)
        raise AssertionError("answer_events ended without done or error")
    finally:
        watcher.cancel()


async def cancel_on_disconnect(request: Request, job: Job) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel.set()
