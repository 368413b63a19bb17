"""Request bodies of the OpenAI-compatible endpoints, validated strictly: a wrong type is a 400, never
a silent coercion ("5" is not 5), and unknown fields are ignored as OpenAI clients send many, but a
field OpenAI (or vLLM) defines and this server does not implement is a 400 naming it unless its value
asks for nothing (``logprobs: false``, ``best_of: 1``, ``null``): ignoring it would answer another
question than the one asked. Also the error body every failure is answered with (``ApiError``).
Numbers must be finite (NaN and inf are refused, also where a range check alone would let them
through)."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from colibri_stream.text import bounded_json
from colibri_stream.text.tool_calls import TemplateArguments

STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


# A tool's name: what every family's call syntax can carry back unambiguously (no markers, no ':').
TOOL_NAME = r"^[A-Za-z0-9_.\-]{1,128}$"
MAX_TOOLS = 256


class FunctionDef(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class ToolDef(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced (constrained decoding)


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema (serve/constrained.py)."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=TOOL_NAME)
    arguments: str  # JSON text of an object, as OpenAI sends it

    def parsed_arguments(self) -> dict[str, Any]:
        try:
            value = bounded_json.loads(self.arguments)  # nested too deeply: a ValueError too, never recursion
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"tool call {self.name!r}: arguments must be the JSON text of an object")
        return value


class ToolCallPart(BaseModel):
    model_config = STRICT
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallPart] | None = None  # an assistant's calls
    tool_call_id: str | None = Field(None, max_length=256)  # the call a tool message answers
    reasoning_content: str | None = None  # an assistant's reasoning (DeepSeek's convention)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates read it: tool calls carry their arguments as a
        mapping (TemplateArguments, which also reads as JSON text), a tool result its tool_call_id."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.role == "assistant" and self.tool_calls:
            message["tool_calls"] = [
                template_call(c.id, c.function.name, c.function.parsed_arguments()) for c in self.tool_calls
            ]
        if self.role == "tool" and self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.role == "assistant" and self.reasoning_content:  # rendered where the template does, else dropped
            message["reasoning_content"] = self.reasoning_content
        return message


def template_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One assistant tool call in the shape chat templates expect."""
    function = {"name": name, "arguments": TemplateArguments(arguments)}
    return {"id": call_id, "type": "function", "function": function}


MAX_LABEL_BYTES = 512  # an opaque end-user label (OpenAI ``user``, Anthropic ``metadata.user_id``)


def check_label(value: str | None) -> str | None:
    """An opaque label: any string of at most MAX_LABEL_BYTES UTF-8 bytes, kept as it is (ValueError
    otherwise: the field validator makes it a 400 naming the field)."""
    if value is not None and (size := len(value.encode("utf-8", "surrogatepass"))) > MAX_LABEL_BYTES:
        raise ValueError(f"an opaque label of at most {MAX_LABEL_BYTES} UTF-8 bytes, got {size}")
    return value


# Fields that change what is generated or returned, not implemented here: the values that ask for
# nothing (null always does). A value is matched by type too: best_of true is not best_of 1.
NoOps = dict[str, tuple[Any, ...]]
COMMON_UNIMPLEMENTED: NoOps = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "top_k": (0, -1),  # vLLM's extensions, sent by clients written for it
    "min_p": (0, 0.0),
    "repetition_penalty": (1, 1.0),
}
CHAT_UNIMPLEMENTED: NoOps = {
    **COMMON_UNIMPLEMENTED,
    "functions": ([],),  # the deprecated form of tools
    "function_call": ("none", "auto"),
    "parallel_tool_calls": (True,),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
}
COMPLETION_UNIMPLEMENTED: NoOps = {
    **COMMON_UNIMPLEMENTED,
    "top_logprobs": (0,),  # chat's field; here ``logprobs`` is the count
    "best_of": (1,),
    "suffix": ("",),
}
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's chat limit)
MAX_PROMPTS = 128  # prompts in one /v1/completions request


def refuse_unimplemented(data: dict[str, Any], unimplemented: NoOps) -> None:
    """ApiError 400 naming the first field in ``data`` that asks for something not implemented."""
    for name, no_ops in unimplemented.items():
        value = data.get(name)
        if value is not None and not any(type(value) is type(n) and value == n for n in no_ops):
            allowed = ", ".join(json.dumps(n) for n in (None, *no_ops))
            raise ApiError(
                400,
                f"{name}: not supported by this server (accepted only as {allowed})",
                "unsupported_parameter",
                name,
            )


class _Common(BaseModel):
    model_config = STRICT
    unimplemented: ClassVar[NoOps] = COMMON_UNIMPLEMENTED
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stop: str | list[str] | None = None
    user: str | None = None  # an opaque label (never a session name: see serve/auth.py)
    n: int = Field(1, ge=1, le=1)  # one model, one generation at a time: a single choice

    @field_validator("user")
    @classmethod
    def _user_is_a_label(cls, value: str | None) -> str | None:
        return check_label(value)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: at most 4 non-empty strings")
        return stops


class ChatRequest(_Common):
    unimplemented: ClassVar[NoOps] = CHAT_UNIMPLEMENTED
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # thinking: none/minimal off, the others on, absent the template's default (serve/thinking.py)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    def logprob_count(self) -> int | None:
        """Alternatives per token when logprobs are asked (None: not asked)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs: needs logprobs: true")
            return None
        return self.top_logprobs or 0

    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools for the template (Hugging Face's shape), none when tool_choice is "none"; a choice
        that forces a call needs tools (serve/constrained.py forces it)."""
        if self.tool_choice not in (None, "auto", "none") and not self.tools:
            raise ValueError("tool_choice: forcing a tool call needs tools")
        if not self.tools or self.tool_choice == "none":
            return []
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    """A legacy completion: one prompt (text or token ids) or several (a choice each, in order).
    ``max_tokens: 0`` scores the prompt without answering (with ``echo`` and ``logprobs``)."""

    unimplemented: ClassVar[NoOps] = COMPLETION_UNIMPLEMENTED
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, value: Any) -> Any:
        return None if value is False else value  # "logprobs": false asks for nothing, as null does

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each non-empty; at most MAX_PROMPTS."""
        several = isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)
        prompts = list(self.prompt) if several else [self.prompt]
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}")
        if any(len(p) == 0 for p in prompts):  # type: ignore[arg-type]
            raise ValueError("prompt: every prompt must be non-empty")
        if self.max_tokens == 0 and not (self.echo and self.logprobs is not None):
            raise ValueError("max_tokens: 0 scores the prompt, which needs echo: true and logprobs")
        if self.stream and len(prompts) > 1:
            raise ValueError("prompt: one prompt at a time when streaming")
        return prompts  # type: ignore[return-value]

    def prompt_logprob_count(self) -> int | None:
        """Alternatives per prompt token when the prompt's logprobs are asked (echo with logprobs)."""
        return self.logprobs if self.echo else None

    def token_limit(self) -> int | None:
        return self.max_tokens


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem, in OpenAI's style: the field path and what is wrong."""
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    return (f"{param}: {first['msg']}" if param else first["msg"]), param


class ApiError(Exception):
    """An error with an OpenAI-shaped body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
