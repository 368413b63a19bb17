"""`serve --request-log FILE`: one JSON line per HTTP request, written when its response has ended.

Off unless asked for. It exists so a client run (tools/agent_clients.py) can read, per request, what the
API's usage fields say and when the first token came, for requests of any route (chat, completions,
Responses, Anthropic Messages) and for refusals too. One line:

    {"at": unix time the request arrived, "method", "route" (path), "query", "status" (HTTP status, 0 when
     the client left before any), "wall_s" (arrival -> response ended), "ttft_s" (arrival -> first token
     sampled; null without one), "prefill_s" (the model's own time to the first token), "prompt_tokens",
     "cached_tokens" (prompt tokens whose KV was reused), "completion_tokens", "tool_calls" (parsed from the
     answer), "finish_reason", "error" (the first 300 characters of a >= 400 answer's body)}

A request running several turns (completions with several prompts) sums their token counts and keeps the
first turn's times. The record of the request being answered is found through a context variable, set by
the middleware in the request's task (StreamingResponse bodies run in child tasks, which inherit it);
serve/answers.py notes each tool call and finished turn there.
"""

from __future__ import annotations

import contextvars
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from colibri_stream.errors import ColibriError
from colibri_stream.runtime.turn import TurnResult
from colibri_stream.serve.model_thread import Job

ERROR_CHARS = 300  # of a refusal's body: enough for the message naming the field


@dataclass
class Record:
    """What one request did, gathered while it is answered."""

    arrived: float  # time.perf_counter() at arrival
    at: float  # time.time() at arrival
    method: str
    route: str
    query: str
    status: int = 0
    first_token_at: float | None = None  # perf_counter() of the first sampled token of any turn
    turns: list[TurnResult] = field(default_factory=list)
    tool_calls: int = 0
    error: bytes = b""

    def line(self, ended: float) -> dict[str, Any]:
        first = self.turns[0] if self.turns else None
        ttft = self.first_token_at - self.arrived if self.first_token_at is not None else None
        return {
            "at": round(self.at, 3),
            "method": self.method,
            "route": self.route,
            "query": self.query,
            "status": self.status,
            "wall_s": round(ended - self.arrived, 4),
            "ttft_s": round(ttft, 4) if ttft is not None else None,
            "prefill_s": first.stats.get("prefill_s") if first is not None else None,
            "prompt_tokens": sum(t.prompt_tokens for t in self.turns) if self.turns else None,
            "cached_tokens": sum(t.stats["reused_tokens"] for t in self.turns) if self.turns else None,
            "completion_tokens": sum(len(t.ids) for t in self.turns) if self.turns else None,
            "tool_calls": self.tool_calls,
            "finish_reason": first.finish_reason if first is not None else None,
            "error": self.error[:ERROR_CHARS].decode(errors="replace") if self.status >= 400 else None,
        }


_current: contextvars.ContextVar[Record | None] = contextvars.ContextVar("colibri_request_record", default=None)


def note_tool_call() -> None:
    if (record := _current.get()) is not None:
        record.tool_calls += 1


def note_turn(turn: TurnResult, job: Job) -> None:
    """A finished turn of the request being answered (the job's first token: its perf_counter() time)."""
    if (record := _current.get()) is None:
        return
    record.turns.append(turn)
    if record.first_token_at is None:
        record.first_token_at = job.first_token_at


class RequestLog:
    """Appends one JSON line per request to ``path`` (created; appended to when it exists)."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        except OSError as exc:  # at start-up, as a user error: not a traceback
            raise ColibriError(f"--request-log: cannot write {path}: {exc}") from None

    def write(self, line: dict[str, Any]) -> None:
        text = json.dumps(line, separators=(",", ":")) + "\n"
        with self.lock, self.path.open("a") as out:  # one write per line: readers never see half of one
            out.write(text)


class RequestLogMiddleware:
    """ASGI middleware: a Record per HTTP request, written to the log when its response has ended."""

    def __init__(self, app: ASGIApp, log: RequestLog):
        self.app, self.log = app, log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        query = scope.get("query_string", b"").decode(errors="replace")
        record = Record(time.perf_counter(), time.time(), scope["method"], scope["path"], query)

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body" and record.status >= 400:
                record.error += message.get("body", b"")[: ERROR_CHARS - len(record.error)]
            await send(message)

        token = _current.set(record)
        try:
            await self.app(scope, receive, watched)
        finally:
            _current.reset(token)
            self.log.write(record.line(time.perf_counter()))
