"""The OpenAI Responses API: ``POST /v1/responses`` (JSON or SSE), ``GET`` and ``DELETE /v1/responses/{id}``.

A request (instructions, input items, tools; responses_schemas.py) is mapped onto the same template
messages as a chat request and runs through the same Server (auth, limits, the model thread, the prefix
cache); its answer is shaped into output items and events by responses_output.py. Errors are OpenAI's
``{"error": {...}}``, as on the chat routes.

What the route does with the API's fields:
- ``store`` (default true) keeps the response and its conversation in memory (responses_store.py,
  bounded); ``previous_response_id`` puts that conversation before ``input`` (an unknown id, or one
  evicted or made by another key: 400 ``previous_response_not_found``); ``instructions`` are never
  carried over, as OpenAI does.
- Tools the server cannot run (hosted tools: web_search, file_search, code_interpreter, ...; freeform
  ``custom`` tools) are left out of the prompt and reported: the ``x-colibri-ignored-tools`` header,
  ``colibri.ignored_tools`` in the response, an INFO log line. Never a failed request.
- ``tool_choice`` "auto" / "none" / "required" / {"type": "function", "name"} and ``text.format`` text /
  json_object / json_schema: a forced call or a JSON output is decoded under its grammar
  (``output_constraint``; serve/constrained.py), so it always parses and a call's arguments validate.
- ``reasoning.effort`` turns a thinking model's thinking mode on or off where its chat template has a
  switch, as chat's ``reasoning_effort`` does (serve/thinking.py: none/minimal off, low..xhigh on,
  absent the template's default); a model without a switch accepts it and answers as it always does.
  The answer of a model that thinks is read through the ReasoningSplitter, so its reasoning never
  reaches ``output_text`` or the tool-call parser: it comes first, as a ``reasoning`` item whose summary
  is the reasoning text itself (nothing summarises it; ``reasoning.summary`` is accepted and changes
  nothing) and whose ``content`` is the same text as ``reasoning_text`` (responses_output.py).
  ``usage.output_tokens_details.reasoning_tokens``: the answer's tokens up to and including the one that
  closes the think block (all of them when it never closes; thinking.reasoning_tokens).
- ``include: ["reasoning.encrypted_content"]``: reasoning items carry their text sealed (sealed.py); a
  reasoning item sent back with it is opened and rendered as the next assistant message's
  ``reasoning_content`` (a forged one: 400). The conversation kept for ``previous_response_id`` has its
  reasoning sealed whatever was included, so a continued conversation renders it back too.
- ``user``, ``safety_identifier``, ``prompt_cache_key`` (the prefix cache reuses prompts by content),
  ``parallel_tool_calls``, ``service_tier``, ``metadata`` (echoed) are accepted; ``user`` never names a
  KV session here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from colibri_stream.runtime.turn import Runtime
from colibri_stream.serve.answers import AnswerParser, cancel_on_disconnect, tool_parser
from colibri_stream.serve.constrained import Constrained, Params, constraint_for, format_constraint
from colibri_stream.serve.intake import parse_request, read_body
from colibri_stream.serve.model_thread import Job
from colibri_stream.serve.responses_output import Output, ResponseRun, new_id, sse_event
from colibri_stream.serve.responses_schemas import (
    ITEMS,
    RESPONSES_UNIMPLEMENTED,
    SEALED_REASONING,
    OfferedTools,
    ResponsesRequest,
    template_messages,
)
from colibri_stream.serve.responses_store import ResponseStore
from colibri_stream.serve.schemas import ApiError
from colibri_stream.serve.sealed import Sealer
from colibri_stream.serve.thinking import effort_thinking, reasoning_tokens

Server = Any  # serve.app.Server, which imports this module (so it cannot be imported here)
IGNORED_TOOLS_HEADER = "x-colibri-ignored-tools"
log = logging.getLogger(__name__)


@dataclass
class ResponsesState:
    """What the routes keep between requests (``app.state.responses``)."""

    store: ResponseStore
    sealer: Sealer

    def open_reasoning(self, blob: str) -> str:
        return self.sealer.open(blob, SEALED_REASONING)

    def seal_reasoning(self, text: str) -> str:
        return self.sealer.seal(text, SEALED_REASONING)

    def kept_items(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A response's output items as stored for previous_response_id: its reasoning items sealed when
        they are not, so a continued conversation renders their text back. Only for the server's own
        items: a client's unsealed reasoning must stay unsealed (it renders nothing)."""
        return [
            {**item, "encrypted_content": self.seal_reasoning(_reasoning_text(item))}
            if item.get("type") == "reasoning" and "encrypted_content" not in item and _reasoning_text(item)
            else item
            for item in items
        ]


def _reasoning_text(item: dict[str, Any]) -> str:
    return "".join(part["text"] for part in item.get("content") or [])


def reasoning_counter(server: Server, prompt: list[int]) -> Callable[[list[int]], int]:
    """The answer's ids -> its reasoning tokens (thinking.reasoning_tokens), with a fresh splitter."""
    tokenizer, chat = server.runtime.text_side()
    return lambda ids: reasoning_tokens(server.splitter(prompt), tokenizer, ids, chat.stop_ids)


# ------------------------------------------------------------------------------------ constrained decoding
RESPONSES = Params(lambda i: f"tools.{i}.parameters", "text.format.schema", "tool_choice.name", "tool_choice")


def output_constraint(runtime: Runtime, body: ResponsesRequest, tools: OfferedTools) -> Constrained | None:
    """What the answer must be beyond free text, decoded under its grammar (serve/constrained.py): a forced
    call (``tool_choice`` "required" or {"type": "function", "name"}) or structured text (``text.format``
    json_object / json_schema); None for free text. Other choices (``allowed_tools``, a hosted tool's) are a
    400 naming ``tool_choice``."""
    choice = body.tool_choice
    if choice == "required":
        return constraint_for(runtime, "required", tools=tools.functions, params=RESPONSES)
    if isinstance(choice, dict):
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ApiError(
                400,
                'tool_choice: an object must be {"type": "function", "name": ...} (other choices are not supported)',
                "unsupported_parameter",
                "tool_choice",
            )
        return constraint_for(runtime, "function", tools=tools.functions, name=name, params=RESPONSES)
    if choice not in (None, "auto", "none"):
        raise ApiError(
            400, f'tool_choice: {choice!r} is not one of "auto", "none", "required"', "invalid_value", "tool_choice"
        )
    text_format = body.text.format if body.text is not None else None
    if text_format is None:
        return None
    return format_constraint(runtime, text_format.type, text_format.schema_, "text.format.schema", RESPONSES)


# ------------------------------------------------------------------------------------ routes
def add_responses_routes(app: FastAPI, server: Server) -> None:
    state = ResponsesState(ResponseStore(), Sealer(server.seal_key))
    app.state.responses = state
    model = server.runtime.model_id

    def prompt_of(body: ResponsesRequest, earlier: list[Any], tools: OfferedTools) -> list[int]:
        items = earlier + body.input_items()
        first = -len(earlier)  # stored items are numbered before the request's own
        messages = template_messages(body.instructions, items, state.open_reasoning, first)
        options = server.traits.options(effort_thinking(body.effort()))
        try:
            prompt: list[int] = server.encode_messages(messages, tools.functions, options)
        except ApiError as exc:
            if exc.param != "messages":  # the chat routes' name for the conversation
                raise
            raise ApiError(exc.status, exc.message, exc.code, "input", exc.headers) from None
        return prompt

    def shell_of(rid: str, created: int, body: ResponsesRequest, tools: OfferedTools) -> Any:
        def shell(status: str, output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "response",
                "created_at": created,
                "status": status,
                "error": None,
                "incomplete_details": None,
                "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens,
                "model": model,
                "output": output,
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id,
                "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
                "store": body.store,
                "temperature": body.temperature,
                "text": {"format": {"type": "text"}},
                "tool_choice": body.tool_choice or "auto",
                "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
                "top_p": body.top_p,
                "truncation": "disabled",
                "usage": None,
                "metadata": body.metadata or {},
                **fields,
            }

        return shell

    @app.post("/v1/responses")
    async def create(request: Request):
        key = server.authenticate(request)  # before the body is read: strangers cost nothing
        raw = await read_body(request)
        body: ResponsesRequest = await server.off_loop(parse_request, raw, ResponsesRequest, RESPONSES_UNIMPLEMENTED)
        server.check_fields(body)
        body.check_include()
        tools = body.offered_tools()
        forced = await server.off_loop(output_constraint, server.runtime, body, tools)
        parser = (forced.parser() if forced is not None else None) or tool_parser(server.runtime, tools.functions)
        earlier = previous_items(state.store, body.previous_response_id, key)
        prompt = await server.off_loop(prompt_of, body, earlier, tools)
        limit = server.token_limit(body, prompt)  # max_output_tokens cut to the context's room
        constraint = forced.constraint if forced is not None else None
        # user/safety_identifier: labels, not sessions
        job = await server.submit(body, prompt, limit, None, key, constraint=constraint)
        rid = new_id("resp")
        output = Output(tools.names, state.seal_reasoning if body.wants_sealed_reasoning() else None)
        shell = shell_of(rid, _now(), body, tools)
        run = ResponseRun(shell, output, server.splitter(prompt), reasoning_counter(server, prompt))
        headers = {IGNORED_TOOLS_HEADER: ",".join(tools.ignored)} if tools.ignored else {}
        if tools.ignored:
            log.info("/v1/responses %s: tools left out (this server cannot run them): %s", rid, tools.ignored)

        def keep(final: dict[str, Any]) -> None:
            final["colibri"] = {**(run.turn.stats if run.turn else {}), "ignored_tools": tools.ignored}
            if body.store:
                conversation = [item.model_dump(exclude_none=True) for item in earlier + body.input_items()]
                if not state.store.put(rid, final, conversation + state.kept_items(final["output"]), key):
                    log.info("/v1/responses %s: not stored (over %d bytes)", rid, state.store.max_bytes)

        if body.stream:
            events = stream(run, job, parser, keep)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        final = await whole(request, run, job, parser)
        keep(final)
        return JSONResponse(final, headers=headers)

    @app.get("/v1/responses/{rid}")
    async def retrieve(request: Request, rid: str):
        stored = state.store.get(rid, server.authenticate(request))
        if stored is None:
            raise ApiError(404, f"no stored response with id {rid!r}", "not_found", "response_id")
        return stored.response

    @app.delete("/v1/responses/{rid}")
    async def delete(request: Request, rid: str):
        if not state.store.delete(rid, server.authenticate(request)):
            raise ApiError(404, f"no stored response with id {rid!r}", "not_found", "response_id")
        return {"id": rid, "object": "response", "deleted": True}


def previous_items(store: ResponseStore, rid: str | None, key: bytes | None) -> list[Any]:
    """The stored conversation ``previous_response_id`` continues, as input items; 400 when unknown."""
    if rid is None:
        return []
    stored = store.get(rid, key)
    if stored is None:
        raise ApiError(
            400,
            f"previous_response_id: no stored response with id {rid!r} (never stored, evicted, or stored with "
            "store: false)",
            "previous_response_not_found",
            "previous_response_id",
        )
    items: list[Any] = ITEMS.validate_python(stored.items)
    return items


async def stream(run: ResponseRun, job: Job, parser: AnswerParser | None, keep: Any) -> AsyncIterator[bytes]:
    """The SSE events; the job is cancelled however the stream ends (see app.stream)."""
    try:
        async for event in run.events(job, parser):
            if run.final is not None and event.get("response") is run.final:
                keep(run.final)  # before the last event is sent: a client may continue from it at once
            yield sse_event(event)
    finally:
        job.cancel.set()


async def whole(request: Request, run: ResponseRun, job: Job, parser: AnswerParser | None) -> dict[str, Any]:
    """The final Response; the job is cancelled if the client disconnects meanwhile (answers.collect)."""
    watcher = asyncio.create_task(cancel_on_disconnect(request, job))
    try:
        async for _ in run.events(job, parser):
            pass
    finally:
        watcher.cancel()
    if run.error is not None:
        raise run.error
    assert run.final is not None
    return run.final


def _now() -> int:
    return int(time.time())
