"""Forced tool calls and structured output: what a request asks its answer to be, as a grammar the batch
decodes under (text/grammar.py), and the answer's text turned back into tool calls.

One entry point for every API (chat completions, Anthropic Messages, Responses):

    constraint_for(runtime, kind, schema=None, tools=(), name=None, parallel=True, params=Params())
        kind "json_object"   any JSON object                        (OpenAI response_format json_object)
             "json_schema"   JSON valid against ``schema``          (response_format json_schema, text.format)
             "required"      one or more calls of the offered tools (tool_choice "required", Anthropic "any")
             "function"      one call of the tool named ``name``    (a named tool choice, Anthropic "tool")
        tools   the offered tools in Hugging Face's shape ({"type": "function", "function": {name, parameters}})
        parallel False: "required" makes exactly one call (Anthropic disable_parallel_tool_use)
        params  the request's field names, for the 400s: each tool's schema, the schema, the tool's name
    -> Constrained: ``constraint`` (a fresh TokenConstraint for the job) and ``parser()`` (the answer's
       events: tool calls for "required"/"function", None for JSON answers, which are plain text)

Forced calls are decoded as JSON, whatever the model family's own call syntax (vLLM does the same for
"required"): "required" writes ``[{"name": NAME, "arguments": {...}}, ...]`` (``anyOf`` one object per tool,
``name`` a ``const``), "function" the arguments object alone. The server builds the calls from the parsed
JSON, so they validate against each tool's parameters, and a model with no known tool-call format can be
forced to call too. An answer cut by max_tokens before its JSON closed comes back as text (finish_reason
"length"), as the tool-call parsers hand back a section that never closed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from colibri_stream.errors import ColibriError
from colibri_stream.runtime.constraint import TokenConstraint
from colibri_stream.runtime.turn import Runtime
from colibri_stream.serve.schemas import ApiError, ChatRequest, NamedToolChoice
from colibri_stream.text.grammar import GrammarError, json_constraint, json_grammar
from colibri_stream.text.tool_calls import Event, ToolCall

Kind = Literal["json_object", "json_schema", "required", "function"]
KINDS = ("json_object", "json_schema", "required", "function")
# A forced answer's calls, at most (parallel calls allowed): the grammar must be able to end the list, or a
# weak model appends calls until max_tokens (the demo did) and the answer is cut, not a call.
MAX_FORCED_CALLS = 4
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Params:
    """The request's field names for the 400s (OpenAI chat's by default)."""

    tool_schema: Callable[[int], str] = lambda i: f"tools.{i}.function.parameters"
    schema: str = "response_format.json_schema.schema"
    name: str = "tool_choice.function.name"
    choice: str = "tool_choice"


ANTHROPIC = Params(lambda i: f"tools.{i}.input_schema", "output_format.schema", "tool_choice.name", "tool_choice")


@dataclass
class Constrained:
    """A request's constraint and how its answer reads back (``calls``: "required", "function" or None)."""

    constraint: TokenConstraint
    calls: Kind | None = None
    name: str | None = None  # the one tool a "function" answer calls

    def parser(self) -> ForcedCallParser | None:
        return ForcedCallParser(self.calls, self.name) if self.calls is not None else None


def constraint_for(
    runtime: Runtime,
    kind: Kind,
    schema: dict[str, Any] | None = None,
    tools: Sequence[dict[str, Any]] = (),
    name: str | None = None,
    parallel: bool = True,
    params: Params = Params(),  # noqa: B008 (frozen)
) -> Constrained:
    """The constraint for one request (see the module docstring); ApiError 400 naming the field at fault."""
    answer = answer_schema(kind, schema, tools, name, parallel, params)
    tokenizer = runtime.text_side()[0]
    try:
        constraint = json_constraint(tokenizer, runtime.vocab_size, runtime.stop_ids, answer)
    except GrammarError as exc:
        field = params.schema if kind == "json_schema" else params.choice
        raise ApiError(400, f"{field}: {exc}", "invalid_schema", field) from None
    except ColibriError as exc:  # the model has no tokenizer (loaded for token ids only)
        raise ApiError(400, f"{params.choice}: {exc}", "unsupported_parameter", params.choice) from None
    calls = kind if kind in ("required", "function") else None
    return Constrained(constraint, calls, name if kind == "function" else None)


def chat_constraint(runtime: Runtime, body: ChatRequest) -> Constrained | None:
    """A chat request's constraint: its forced tool call, else its response_format; None if neither."""
    tools = body.offered_tools()
    if isinstance(body.tool_choice, NamedToolChoice):
        return constraint_for(runtime, "function", tools=tools, name=body.tool_choice.function.name)
    if body.tool_choice == "required":
        return constraint_for(runtime, "required", tools=tools)
    form = body.response_format
    if form is None:
        return None
    schema = form.json_schema.schema_ if form.json_schema is not None else None
    return format_constraint(runtime, form.type, schema, "response_format.json_schema")


def format_constraint(
    runtime: Runtime,
    kind: str,
    schema: dict[str, Any] | None,
    missing: str,
    params: Params = Params(),  # noqa: B008 (frozen)
) -> Constrained | None:
    """A response format's constraint (chat's ``response_format``, Responses' ``text.format``): none for
    "text", any JSON object, or JSON valid against ``schema``; a json_schema without one is a 400 naming
    ``missing``."""
    if kind == "text":
        return None
    if kind == "json_object":
        return constraint_for(runtime, "json_object", params=params)
    if schema is None:
        raise ApiError(400, f"{missing}: required for type json_schema", "invalid_value", missing)
    return constraint_for(runtime, "json_schema", schema=schema, params=params)


def anthropic_constraint(
    runtime: Runtime, choice: str, name: str | None, tools: Sequence[dict[str, Any]], parallel: bool
) -> Constrained | None:
    """An Anthropic tool_choice's constraint ("any": calls, "tool": the named one's); None for the others."""
    if choice == "any":
        return constraint_for(runtime, "required", tools=tools, parallel=parallel, params=ANTHROPIC)
    if choice == "tool":
        return constraint_for(runtime, "function", tools=tools, name=name, params=ANTHROPIC)
    return None


def answer_schema(
    kind: Kind,
    schema: dict[str, Any] | None,
    tools: Sequence[dict[str, Any]],
    name: str | None,
    parallel: bool,
    params: Params,
) -> dict[str, Any]:
    """The JSON schema of the whole answer; each tool's schema checked on its own (a 400 names it)."""
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        return checked(schema if schema is not None else {"type": "object"}, params.schema)
    functions = [tool["function"] for tool in tools]
    if not functions:
        raise ApiError(400, f"{params.choice}: forcing a tool call needs tools", "invalid_value", params.choice)
    arguments = {
        f["name"]: checked_arguments(f.get("parameters"), params.tool_schema(i)) for i, f in enumerate(functions)
    }
    if kind == "function":
        if name not in arguments:
            offered = ", ".join(repr(n) for n in arguments)
            raise ApiError(400, f"{params.name}: no tool {name!r} is offered ({offered})", "invalid_value", params.name)
        return arguments[name]
    calls = [call_schema(tool, parameters) for tool, parameters in arguments.items()]
    listed: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    return {**listed, "minItems": 1, "maxItems": MAX_FORCED_CALLS if parallel else 1}


def call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    properties = {"name": {"const": name}, "arguments": parameters}
    return {
        "type": "object",
        "properties": properties,
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def checked_arguments(parameters: Any, param: str) -> dict[str, Any]:
    """A tool's parameters schema (none: no parameters), which must describe a JSON object."""
    if parameters is None:
        return NO_PARAMETERS
    schema = checked(parameters, param)
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and kind == ["object"]):
        raise ApiError(
            400, f'{param}: a tool\'s arguments are a JSON object (type must be "object")', "invalid_schema", param
        )
    return schema


def checked(schema: Any, param: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param}: a JSON schema must be an object", "invalid_schema", param)
    try:
        json_grammar(schema)
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {exc}", "invalid_schema", param) from None
    return schema


class ForcedCallParser:
    """A forced answer's text -> tool calls, once it is whole (answers.AnswerParser's shape): nothing is
    emitted while it streams, then one ("tool_call", ToolCall) event per call; text that is not the JSON
    the grammar forces (cut by max_tokens or a stop string) is handed back as text."""

    def __init__(self, calls: Kind, name: str | None):
        self.calls, self.name, self.text = calls, name, ""

    def push(self, delta: str) -> list[Event]:
        self.text += delta
        return []

    def finish(self) -> list[Event]:
        try:
            found = self._calls(json.loads(self.text))
        except (ValueError, TypeError, KeyError):
            found = None
        if found is None:
            return [("text", self.text)] if self.text else []
        return [("tool_call", call) for call in found]

    def _calls(self, value: Any) -> list[ToolCall] | None:
        if self.calls == "function":
            return [ToolCall(str(self.name), value)] if isinstance(value, dict) else None
        if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
            return None
        calls = [ToolCall(c["name"], c["arguments"]) for c in value]
        return calls if all(isinstance(c.name, str) and isinstance(c.arguments, dict) for c in calls) else None
