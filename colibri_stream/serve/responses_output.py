"""A Responses API answer: its output items and the streamed events that build them, from a job's answer
events (serve/answers.py). One path makes both: the JSON answer is the last event's response, so a
streamed answer and a whole one are the same items.

Output items, in the order the model wrote them: a thinking model's ``reasoning`` first (when its answer
has reasoning, read off by the request's ReasoningSplitter), a ``message`` (one ``output_text`` part) for
each run of text, a ``function_call`` for each tool call (its prompt name split back into ``namespace``
and ``name``, responses_schemas.joined_name). An answer with neither message nor call gets one empty
message.

A reasoning item carries the reasoning twice, in the two places clients read: ``summary`` (one
``summary_text`` part: our summary IS the reasoning text, nothing summarises it) and ``content`` (one
``reasoning_text`` part); with ``include: ["reasoning.encrypted_content"]`` also ``encrypted_content``,
the text sealed (sealed.py), set when the item is done.

Events (SSE, ``event:`` named as the type, every one with a ``sequence_number`` from 0), in the order
the official SDK's accumulator (openai/lib/streaming/responses) and Codex read them:
  response.created, response.in_progress (the response so far: status in_progress, no output)
  a reasoning:     response.output_item.added, response.reasoning_summary_part.added,
                   response.content_part.added (its reasoning_text part),
                   response.reasoning_summary_text.delta + response.reasoning_text.delta ...,
                   response.reasoning_summary_text.done, response.reasoning_summary_part.done,
                   response.reasoning_text.done, response.content_part.done, response.output_item.done
  a message:       response.output_item.added, response.content_part.added,
                   response.output_text.delta ..., response.output_text.done,
                   response.content_part.done, response.output_item.done
  a function call: response.output_item.added, response.function_call_arguments.delta,
                   response.function_call_arguments.done, response.output_item.done
  then response.completed, or response.incomplete (max_output_tokens reached:
  incomplete_details.reason "max_output_tokens"), or response.failed (``error``: code and message; also
  for a response cancelled before its end, by a client that left or a server stopping).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from colibri_stream.runtime.turn import TurnResult
from colibri_stream.serve.answers import AnswerParser, answer_events
from colibri_stream.serve.model_thread import Job
from colibri_stream.serve.schemas import ApiError
from colibri_stream.text.reasoning import ReasoningSplitter
from colibri_stream.text.tool_calls import ToolCall

Event = dict[str, Any]
Seal = Callable[[str], str]  # reasoning text -> its encrypted_content


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(turn: TurnResult, reasoning_tokens: int = 0) -> dict[str, Any]:
    """Usage as the Responses API counts it: cached_tokens are the prompt's tokens whose KV was reused
    (a session's or the prefix cache's), not computed; reasoning_tokens are the answer's tokens up to and
    including its think block's closing marker (thinking.reasoning_tokens), part of output_tokens."""
    prompt, output = turn.prompt_tokens, len(turn.ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": turn.stats["reused_tokens"]},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + output,
    }


class Output:
    """The output items of one answer, and the events that announce them (without sequence numbers)."""

    def __init__(self, names: dict[str, tuple[str | None, str]], seal: Seal | None = None):
        self.names = names  # prompt name -> (namespace, name)
        self.seal = seal  # include reasoning.encrypted_content: reasoning text -> its sealed blob
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the message whose text is streaming
        self._reasoning: dict[str, Any] | None = None  # the reasoning item whose text is streaming

    def reasoning(self, delta: str) -> list[Event]:
        events = [] if self._reasoning is not None else self._open_reasoning()
        assert self._reasoning is not None
        item = self._reasoning
        item["summary"][0]["text"] += delta
        item["content"][0]["text"] += delta
        where = self._where(item)
        return [
            *events,
            {"type": "response.reasoning_summary_text.delta", **where, "summary_index": 0, "delta": delta},
            {"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": delta},
        ]

    def text(self, delta: str) -> list[Event]:
        events = self._close_reasoning("completed")
        events += [] if self._message is not None else self._open_message()
        assert self._message is not None
        self._message["content"][0]["text"] += delta
        where = self._where(self._message)
        return [
            *events,
            {"type": "response.output_text.delta", **where, "content_index": 0, "delta": delta, "logprobs": []},
        ]

    def tool_call(self, call: ToolCall) -> list[Event]:
        events = self._close_reasoning("completed") + self._close_message("completed")
        namespace, name = self.names.get(call.name, (None, call.name))
        item: dict[str, Any] = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call.id or new_id("call"),
            "name": name,
            **({"namespace": namespace} if namespace is not None else {}),
            "arguments": "",
        }
        arguments = call.arguments_json()
        events.append(self._added(item))
        where = self._where(item)
        events.append({"type": "response.function_call_arguments.delta", **where, "delta": arguments})
        item["arguments"], item["status"] = arguments, "completed"
        events.append({"type": "response.function_call_arguments.done", **where, "name": name, "arguments": arguments})
        events.append({"type": "response.output_item.done", "output_index": where["output_index"], "item": dict(item)})
        return events

    def finish(self, status: str) -> list[Event]:
        """Close the open item (``status``: completed or incomplete); an answer with no message and no
        call gets an empty message."""
        events = self._close_reasoning(status)
        if not any(item["type"] != "reasoning" for item in self.items):
            events += self._open_message()
        return events + self._close_message(status)

    def _open_reasoning(self) -> list[Event]:
        item: dict[str, Any] = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
        item["status"] = "in_progress"
        events = [self._added(item)]
        where = self._where(item)
        summary: dict[str, Any] = {"type": "summary_text", "text": ""}
        content: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        item["summary"], item["content"] = [dict(summary)], [dict(content)]
        self._reasoning = item
        return [
            *events,
            {"type": "response.reasoning_summary_part.added", **where, "summary_index": 0, "part": summary},
            {"type": "response.content_part.added", **where, "content_index": 0, "part": content},
        ]

    def _close_reasoning(self, status: str) -> list[Event]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        item["status"] = status
        text, where = item["content"][0]["text"], self._where(item)
        if self.seal is not None:
            item["encrypted_content"] = self.seal(text)
        summary, content = {**where, "summary_index": 0}, {**where, "content_index": 0}
        cut = {"status": "incomplete"} if status == "incomplete" else {}  # a summary part cut short says so
        return [
            {"type": "response.reasoning_summary_text.done", **summary, "text": text},
            {"type": "response.reasoning_summary_part.done", **summary, "part": dict(item["summary"][0]), **cut},
            {"type": "response.reasoning_text.done", **content, "text": text},
            {"type": "response.content_part.done", **content, "part": dict(item["content"][0])},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(item)},
        ]

    def _open_message(self) -> list[Event]:
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item: dict[str, Any] = {
            "id": new_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        events = [self._added(item)]
        item["content"] = [dict(part)]
        events.append({"type": "response.content_part.added", **self._where(item), "content_index": 0, "part": part})
        self._message = item
        return events

    def _close_message(self, status: str) -> list[Event]:
        item, self._message = self._message, None
        if item is None:
            return []
        item["status"] = status
        part, where = item["content"][0], self._where(item)
        done = {**where, "content_index": 0}
        return [
            {"type": "response.output_text.done", **done, "text": part["text"], "logprobs": []},
            {"type": "response.content_part.done", **done, "part": dict(part)},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(item)},
        ]

    def _added(self, item: dict[str, Any]) -> Event:
        self.items.append(item)
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    copied: dict[str, Any] = json.loads(json.dumps(value))  # an event's snapshot: later deltas leave it as it was
    return copied


Shell = Callable[..., dict[str, Any]]  # (status, output, usage=..., error=..., incomplete_details=...) -> Response


class ResponseRun:
    """The events of one response, from ``response.created`` to its last event; ``final`` is the
    Response object that last event carries (``error`` the ApiError when it failed). A thinking model's
    answer is read through ``splitter`` and its reasoning tokens counted by ``count_reasoning`` (the
    answer's ids -> reasoning_tokens)."""

    def __init__(
        self,
        shell: Shell,
        output: Output,
        splitter: ReasoningSplitter | None = None,
        count_reasoning: Callable[[list[int]], int] | None = None,
    ):
        self.shell, self.output = shell, output
        self.splitter, self.count_reasoning = splitter, count_reasoning
        self.final: dict[str, Any] | None = None
        self.error: ApiError | None = None
        self.turn: TurnResult | None = None
        self._sequence = 0

    async def events(self, job: Job, parser: AnswerParser | None) -> AsyncIterator[Event]:
        yield self._numbered({"type": "response.created", "response": self.shell("in_progress", [])})
        yield self._numbered({"type": "response.in_progress", "response": self.shell("in_progress", [])})
        async for kind, value in answer_events(job, parser, self.splitter):
            if kind == "reasoning":
                numbered = [self._numbered(e) for e in self.output.reasoning(value)]
            elif kind == "text":
                numbered = [self._numbered(e) for e in self.output.text(value)]
            elif kind == "tool_call":
                numbered = [self._numbered(e) for e in self.output.tool_call(value)]
            elif kind == "error":
                numbered = [self._failed(value)]
            elif kind == "done":
                numbered = [self._numbered(e) for e in self._done(value)]
            else:  # logprobs events: not asked on this route
                numbered = []
            for event in numbered:
                yield event

    def _done(self, turn: TurnResult) -> list[Event]:
        self.turn = turn
        if turn.finish_reason == "cancelled":  # the client left, or the server is stopping: not an answer
            return [self._failed(ApiError(499, "the response was cancelled before it was finished", "cancelled"))]
        cut = turn.finish_reason == "length"
        events = self.output.finish("incomplete" if cut else "completed")
        details = {"incomplete_details": {"reason": "max_output_tokens"}} if cut else {}
        status = "incomplete" if cut else "completed"
        reasoning = self.count_reasoning(turn.ids) if self.count_reasoning is not None else 0
        self.final = self.shell(status, self.output.items, usage=responses_usage(turn, reasoning), **details)
        return [*events, {"type": f"response.{status}", "response": self.final}]

    def _failed(self, exc: ApiError) -> Event:
        self.error = exc
        error = {"code": exc.code or "server_error", "message": exc.message}
        failed = self.shell("failed", self.output.items, error=error)
        return self._numbered({"type": "response.failed", "response": failed})

    def _numbered(self, event: Event) -> Event:
        event["sequence_number"], self._sequence = self._sequence, self._sequence + 1
        return event


def sse_event(event: Event) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
