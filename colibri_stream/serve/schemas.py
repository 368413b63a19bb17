"""Request bodies of the OpenAI-compatible endpoints, validated strictly: a wrong type is a 400, never
a silent coercion ("5" is not 5), and unknown fields are ignored as OpenAI clients send many; and the
error body every failure is answered with (``ApiError``). Numbers must be finite (NaN and inf are
refused, also where a range check alone would let them through)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Common(BaseModel):
    model_config = STRICT
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stop: str | list[str] | None = None
    user: str | None = Field(None, max_length=256)  # the KV session this request continues
    n: int = Field(1, ge=1, le=1)  # one model, one generation at a time: a single choice

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: at most 4 non-empty strings")
        return stops


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(min_length=1)

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
