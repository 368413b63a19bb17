"""Request bodies of the OpenAI Responses API (``POST /v1/responses``), validated as schemas.py does
(strict types, unknown fields ignored, a field that would change the answer and is not implemented is a
400 naming it), and mapped onto the template messages the chat route uses.

Input items -> template messages:
  ``instructions``                            {"role": "system"} first
  message (role system/developer)             {"role": "system"} (OpenAI's developer role is its system role)
  message (role user)                         {"role": "user"}
  message (role assistant), function_call     one {"role": "assistant", "content", "tool_calls"} per run
                                              of consecutive assistant items
  function_call_output                        {"role": "tool", "tool_call_id", "content"}
  reasoning with ``encrypted_content``        opened (sealed.py; forged: 400) and given to the next
                                              assistant message as ``reasoning_content``, which templates
                                              of thinking models render and others ignore; without it,
                                              a reasoning item renders nothing
  additional_tools                            nothing: its tools are offered with ``tools`` (Codex 0.171
                                              sends its tools only so)
  configuration_update                        nothing: its ``reasoning`` (the last one's) is the request's
Tools: ``function`` tools, and the function tools of a ``namespace`` (their name joined to the
namespace's, e.g. ``mcp__fs__`` + ``read`` -> ``mcp__fs__read``; the call comes back split). Every other
tool type (OpenAI's hosted tools: web_search, file_search, code_interpreter, computer use, image
generation, local_shell, custom/freeform tools, tool_search, mcp, ...) cannot run here: it is left out
of the prompt and reported (ResponsesRequest.ignored_tools), never refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, Discriminator, Field, Tag, TypeAdapter, ValidationError

from colibri_stream.serve.schemas import (
    COMMON_UNIMPLEMENTED,
    STRICT,
    TOOL_NAME,
    ApiError,
    NoOps,
    describe_validation_error,
    template_call,
)
from colibri_stream.serve.thinking import Effort
from colibri_stream.text import bounded_json

MAX_TOOLS = 256
MAX_ID = 256
# Fields whose value would change the answer and that are not implemented: the values that ask for
# nothing (schemas.refuse_unimplemented; null always does).
RESPONSES_UNIMPLEMENTED: NoOps = {
    **COMMON_UNIMPLEMENTED,
    "background": (False,),  # a response run in the background, polled later
    "background_options": (),
    "conversation": (),  # OpenAI's server-side conversation objects (previous_response_id is here)
    "prompt": (),  # a stored prompt template, by id
    "top_logprobs": (0,),
    "truncation": ("disabled",),  # "auto" drops input items to fit the context
    "max_tool_calls": (),
    "context_management": ([],),  # server-side compaction
    "moderation": (),
}
# ``include`` values: what each adds to the answer. The hosted tools' outputs are never produced here,
# so asking for them asks for nothing; logprobs are not implemented on this route.
INCLUDE_ACCEPTED = frozenset(
    {
        "reasoning.encrypted_content",
        "web_search_call.action.sources",
        "web_search_call.results",
        "file_search_call.results",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "message.input_image.image_url",
    }
)
SEALED_REASONING = "responses.reasoning"  # the seal's purpose (sealed.Sealer) for reasoning items


# ------------------------------------------------------------------------------------ input items
class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(BaseModel):
    model_config = STRICT
    type: Literal["refusal"]
    refusal: str


Part = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


def _as_parts(value: Any) -> Any:
    """Text given as a string is one text part: a list stays the one shape to validate (so a bad part
    is reported at its own place, not as "not a string")."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class MessageItem(BaseModel):
    """A message; ``type`` may be left out (OpenAI's EasyInputMessage)."""

    model_config = STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[list[Part], BeforeValidator(_as_parts)]

    def text(self) -> str:
        return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID)
    name: str = Field(min_length=1, max_length=128)
    namespace: str | None = Field(None, max_length=128)
    arguments: str  # JSON text of an object


class FunctionCallOutputItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID)
    output: Annotated[list[TextPart], BeforeValidator(_as_parts)]

    def text(self) -> str:
        return "".join(p.text for p in self.output)


class ReasoningText(BaseModel):
    model_config = STRICT
    type: Literal["summary_text", "reasoning_text"]
    text: str


class ReasoningItem(BaseModel):
    model_config = STRICT
    type: Literal["reasoning"]
    id: str | None = Field(None, max_length=MAX_ID)
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


def _as_items(value: Any) -> Any:
    """A string input is one user message."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


# ------------------------------------------------------------------------------------ tools
class FunctionTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(BaseModel):
    model_config = STRICT
    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    tools: list[dict[str, Any]] = Field(max_length=MAX_TOOLS)


class OtherTool(BaseModel):
    """A tool of a type this server cannot run (hosted tools, freeform tools): left out, reported."""

    model_config = STRICT
    type: str


def _tool_type(value: Any) -> str | None:
    """The tag of a tool: of request JSON (a dict) when validating, of a tool model when serialising (a
    stored conversation's additional_tools item)."""
    if isinstance(value, FunctionTool | NamespaceTool | OtherTool):
        return "other" if isinstance(value, OtherTool) else value.type
    if not isinstance(value, dict):
        return None
    return value["type"] if value.get("type") in ("function", "namespace") else "other"


ToolSpec = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[OtherTool, Tag("other")],
    Discriminator(_tool_type),
]


def joined_name(namespace: str | None, name: str) -> str:
    """The name a namespaced function has in the prompt: ``mcp__fs__`` + ``read`` -> ``mcp__fs__read``,
    ``crm`` + ``find`` -> ``crm.find`` (a separator is added unless the namespace ends with one)."""
    if not namespace:
        return name
    return namespace + name if namespace[-1] in "_.-" else f"{namespace}.{name}"


class OfferedTools:
    """The tools a request offers the model: Hugging Face's function shape for the template and the
    tool-call parser, each prompt name's (namespace, name), and the tool types left out."""

    def __init__(self) -> None:
        self.functions: list[dict[str, Any]] = []
        self.names: dict[str, tuple[str | None, str]] = {}
        self.ignored: list[str] = []

    def add(self, tool: FunctionTool, namespace: str | None, where: str) -> None:
        flat = joined_name(namespace, tool.name)
        if not _fits_tool_name(flat):
            raise ApiError(400, f"{where}.name: {flat!r} must match {TOOL_NAME}", "invalid_value", f"{where}.name")
        if flat in self.names:
            raise ApiError(400, f"{where}.name: two tools are named {flat!r}", "invalid_value", f"{where}.name")
        self.names[flat] = (namespace, tool.name)
        function: dict[str, Any] = {"name": flat}  # chat's FunctionDef order: the same tools, the same prompt
        if tool.description is not None:
            function["description"] = tool.description
        if tool.parameters is not None:
            function["parameters"] = tool.parameters
        self.functions.append({"type": "function", "function": function})


def _fits_tool_name(name: str) -> bool:
    return re.fullmatch(TOOL_NAME, name) is not None


# ------------------------------------------------------------------------------------ the request
class Reasoning(BaseModel):
    """Accepted, with no effect on a model without a thinking mode (see README)."""

    model_config = STRICT
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(BaseModel):
    """``text.format``: free text, any JSON object, or JSON valid against ``schema`` (always enforced, as
    ``strict`` asks: constrained decoding, serve/constrained.py)."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to the model: accepted


# ------------------------------------------------------------------------------------ all input items
class AdditionalToolsItem(BaseModel):
    """Tools offered inside the input (Codex 0.171 sends its tools so, as namespaces in a developer item,
    with no top-level ``tools``): offered as if they were in ``tools``."""

    model_config = STRICT
    type: Literal["additional_tools"]
    id: str | None = Field(None, max_length=MAX_ID)
    role: Literal["developer", "system", "user"] | None = None
    tools: list[ToolSpec] = Field(max_length=MAX_TOOLS)


class ConfigurationUpdateItem(BaseModel):
    """A change of the request's settings within the input (Codex: ``{"reasoning": {"effort": "low"}}``);
    the last one's ``reasoning`` is the request's (other settings it may carry are accepted, unread)."""

    model_config = STRICT
    type: Literal["configuration_update"]
    reasoning: Reasoning | None = None


def _item_type(value: Any) -> str | None:
    """The tag of an input item (request JSON: a dict); None (pydantic's "unable to extract tag") else."""
    kind = value.get("type", "message") if isinstance(value, dict) else None
    return kind if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[AdditionalToolsItem, Tag("additional_tools")]
    | Annotated[ConfigurationUpdateItem, Tag("configuration_update")],
    Discriminator(_item_type),
]
ITEMS = TypeAdapter(list[InputItem])


class ResponsesRequest(BaseModel):
    """A Responses API request. ``temperature``, ``top_p``, ``seed``, ``user``, ``stop_strings`` and
    ``token_limit`` are what Server.check_fields / submit / token_limit read of any request: ``user``
    and ``safety_identifier`` are opaque labels here, never KV session names, so ``user`` reads None."""

    model_config = STRICT
    unimplemented: ClassVar[NoOps] = RESPONSES_UNIMPLEMENTED
    model: str = Field(min_length=1)
    input: Annotated[list[InputItem], BeforeValidator(_as_items)] = Field(min_length=1)
    instructions: str | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted: a model may write several calls either way
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    store: bool = True  # OpenAI's default
    previous_response_id: str | None = Field(None, min_length=1, max_length=MAX_ID)
    include: list[str] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    prompt_cache_key: str | None = Field(None, max_length=1024)  # a hint; the prefix cache reuses by content

    seed: ClassVar[None] = None  # the API has no seed
    user: ClassVar[None] = None  # see the class docstring

    def stop_strings(self) -> list[str]:
        return []  # the API has no stop sequences

    def token_limit(self) -> int | None:
        return self.max_output_tokens

    def wants_sealed_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or [])

    def check_include(self) -> None:
        for position, value in enumerate(self.include or []):
            if value not in INCLUDE_ACCEPTED:
                accepted = ", ".join(sorted(INCLUDE_ACCEPTED))
                raise ApiError(
                    400,
                    f"include.{position}: {value!r} is not supported by this server (accepted: {accepted})",
                    "unsupported_parameter",
                    f"include.{position}",
                )

    def offered_tools(self) -> OfferedTools:
        """The tools for the template and the parser; none for tool_choice "none" (a forced call's
        constraint is made from them in responses_api.output_constraint)."""
        offered = OfferedTools()
        given = [(f"tools.{position}", tool) for position, tool in enumerate(self.tools or [])]
        for index, item in enumerate(self.input):
            if isinstance(item, AdditionalToolsItem):
                given += [(f"input.{index}.tools.{position}", tool) for position, tool in enumerate(item.tools)]
        for where, tool in given:
            if isinstance(tool, FunctionTool):
                offered.add(tool, None, where)
            elif isinstance(tool, NamespaceTool):
                for inner, spec in enumerate(tool.tools):
                    inside = f"{where}.tools.{inner}"
                    if spec.get("type") != "function":
                        offered.ignored.append(f"{tool.name}:{spec.get('type')}")
                        continue
                    offered.add(_validated(FunctionTool, spec, inside), tool.name, inside)
            else:
                offered.ignored.append(tool.type)
        if self.tool_choice == "none":
            offered.functions, offered.names = [], {}
        return offered

    def input_items(self) -> list[Any]:
        return list(self.input)

    def effort(self) -> Effort | None:
        """The reasoning effort asked: the last ``configuration_update`` item's, else ``reasoning``'s."""
        updates = [i.reasoning for i in self.input if isinstance(i, ConfigurationUpdateItem) and i.reasoning]
        reasoning = updates[-1] if updates else self.reasoning
        return reasoning.effort if reasoning is not None else None


def _validated(model: type[BaseModel], data: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        param = f"{where}.{param}" if param else where
        raise ApiError(400, f"{where}.{message}", "invalid_value", param) from None


# ------------------------------------------------------------------------------------ template messages
def template_messages(
    instructions: str | None, items: list[Any], open_sealed: Callable[[str], str], first_index: int = 0
) -> list[dict[str, Any]]:
    """Items -> chat-template messages (see the module docstring). ``open_sealed(blob) -> text``
    raises ValueError for a blob the server did not seal (400 naming the item); ``first_index`` numbers
    the items in errors (the stored items of previous_response_id come first and are not the
    request's)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: str | None = None
    for position, item in enumerate(items, start=first_index):
        where = f"input.{position}"
        if isinstance(item, AdditionalToolsItem | ConfigurationUpdateItem):
            continue  # settings, not conversation: read by offered_tools / effort
        if isinstance(item, ReasoningItem):
            if item.encrypted_content is not None:
                try:
                    reasoning = open_sealed(item.encrypted_content)
                except ValueError as exc:
                    param = f"{where}.encrypted_content"
                    raise ApiError(400, f"{param}: {exc}", "invalid_encrypted_content", param) from None
            continue
        if isinstance(item, MessageItem) and item.role != "assistant":
            role = "user" if item.role == "user" else "system"
            messages.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            turn = _assistant_turn(messages, reasoning)
            reasoning = None
            if isinstance(item, MessageItem):
                turn["content"] += item.text()
            else:
                turn.setdefault("tool_calls", []).append(_call(item, where))
    return messages


def _assistant_turn(messages: list[dict[str, Any]], reasoning: str | None) -> dict[str, Any]:
    """The assistant message an assistant item belongs to: the last message when it is the assistant's
    (and no reasoning item came between), else a new one."""
    if messages and messages[-1]["role"] == "assistant" and reasoning is None:
        turn: dict[str, Any] = messages[-1]
        return turn
    turn = {"role": "assistant", "content": ""}
    if reasoning is not None:
        turn["reasoning_content"] = reasoning
    messages.append(turn)
    return turn


def _call(item: FunctionCallItem, where: str) -> dict[str, Any]:
    try:
        arguments = bounded_json.loads(item.arguments)  # too deep: a ValueError, not recursion
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        param = f"{where}.arguments"
        raise ApiError(400, f"{param}: must be the JSON text of an object", "invalid_value", param)
    return template_call(item.call_id, joined_name(item.namespace, item.name), arguments)
