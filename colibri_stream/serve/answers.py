"""A job's answer as the API routes use it: its text split into text and tool calls (when the request
offered tools), either collected whole or iterated as it streams. Shared by the OpenAI and Anthropic
routes, which only shape what comes out of here.

A job's events (model_thread.Job) are ("started", reused prompt tokens) once its turn has begun, ("text",
delta) ..., then ("done", TurnResult) or ("error", ApiError); a job that asked for logprobs also gets
("prompt", [TokenLogprob]) before its first token and one ("token", TokenLogprob) per token, before that
token's text. ``answer_events`` passes them on with each text delta run first through the request's
ReasoningSplitter (a thinking model's: its reasoning becomes ("reasoning", str) events and never reaches
the rest) and then through its ToolCallParser, so the content becomes ("text", str) and ("tool_call",
ToolCall) events, in the order the model wrote them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import Request

from colibri_stream.runtime.sampling import TokenLogprob
from colibri_stream.runtime.turn import Runtime, TurnResult
from colibri_stream.serve import request_log
from colibri_stream.serve.model_thread import Job
from colibri_stream.serve.schemas import ApiError
from colibri_stream.text.reasoning import ReasoningSplitter
from colibri_stream.text.tool_calls import Event, ToolCall, ToolCallParser, tools_from_functions


class AnswerParser(Protocol):
    """Text deltas -> ("text", str) / ("tool_call", ToolCall) events: a family's ToolCallParser, or a forced
    call's (serve/constrained.py ForcedCallParser)."""

    def push(self, delta: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


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


async def answer_events(
    job: Job, parser: AnswerParser | None, splitter: ReasoningSplitter | None = None
) -> AsyncIterator[tuple[str, Any]]:
    """("started", int), ("reasoning", str), ("text", str), ("tool_call", ToolCall), ("prompt", ...) and
    ("token", ...) events, then ("done", TurnResult) or ("error", ApiError).

    The splitter and the parser run in a worker thread, never on the event loop (a section closing can
    be a lot of text to parse, and the loop serves every other request and /health): each round takes the
    job's events queued so far, in order, and hands them over together."""
    loop = asyncio.get_running_loop()
    while True:
        batch = [await job.events.get()]
        while not job.events.empty():
            batch.append(job.events.get_nowait())
        if parser is None and splitter is None:
            events, ended = _answer_batch(batch, parser, splitter)
        else:  # one round at a time: the parser sees the deltas in the model's order
            events, ended = await loop.run_in_executor(None, _answer_batch, batch, parser, splitter)
        for event in events:
            _note(event, job)  # here, in the request's context: serve --request-log reads it
            yield event
        if ended:
            return


def _note(event: tuple[str, Any], job: Job) -> None:
    """What serve --request-log counts of an answer: its tool calls and its turn."""
    if event[0] == "tool_call":
        request_log.note_tool_call()
    elif event[0] == "done":
        request_log.note_turn(event[1], job)


def _answer_batch(
    batch: list[tuple[str, Any]], parser: AnswerParser | None, splitter: ReasoningSplitter | None
) -> tuple[list[tuple[str, Any]], bool]:
    """A round's events out, and whether the answer ended (done or error; nothing follows either)."""
    out: list[tuple[str, Any]] = []
    for kind, value in batch:
        if kind == "text":
            out += _content_events(value, parser, splitter)
        elif kind == "done":
            out += _content_events("", parser, splitter, final=True)
            out.append((kind, value))
            return out, True
        else:
            out.append((kind, value))
            if kind == "error":
                return out, True
    return out, False


def _content_events(
    text: str, parser: AnswerParser | None, splitter: ReasoningSplitter | None, final: bool = False
) -> list[tuple[str, Any]]:
    """A text delta's events: its reasoning, then its content through the tool-call parser (``final``:
    what the splitter and the parser held back)."""
    reasoning, content = ("", text) if splitter is None else splitter.finish() if final else splitter.push(text)
    events: list[tuple[str, Any]] = [("reasoning", reasoning)] if reasoning else []
    if parser is None:
        return events + ([("text", content)] if content else [])
    events += parser.push(content) if content else []
    return events + (parser.finish() if final else [])


@dataclass
class Answer:
    text: str
    calls: list[ToolCall]
    turn: TurnResult
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., when asked
    reasoning: str = ""  # a thinking model's reasoning (never part of ``text``)


async def collect(
    request: Request, job: Job, parser: AnswerParser | None = None, splitter: ReasoningSplitter | None = None
) -> Answer:
    """The whole answer. Meanwhile a watcher waits for the client's disconnect (the body is read, so
    the next ASGI message is that) and cancels the job: generation stops after its current token."""
    watcher = asyncio.create_task(cancel_on_disconnect(request, job))
    parts: list[str] = []
    calls: list[ToolCall] = []
    logprobs: list[TokenLogprob] = []
    prompt: list[TokenLogprob] = []
    reasoning: list[str] = []
    try:
        async for kind, value in answer_events(job, parser, splitter):
            if kind == "text":
                parts.append(value)
            elif kind == "reasoning":
                reasoning.append(value)
            elif kind == "tool_call":
                calls.append(value)
            elif kind == "token":
                logprobs.append(value)
            elif kind == "prompt":
                prompt = value
            elif kind == "error":
                raise value
            elif kind == "done":
                return Answer("".join(parts), calls, value, logprobs, prompt, "".join(reasoning))
        raise AssertionError("answer_events ended without done or error")
    finally:
        watcher.cancel()


async def cancel_on_disconnect(request: Request, job: Job) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel.set()
