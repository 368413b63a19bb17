"""Request bodies, taken in defensively: read as a stream that stops at MAX_BODY_BYTES (413) or when
the whole body has not arrived within BODY_TIMEOUT_S (408), so a huge or trickled body costs at most
the limit in memory and a bounded wait; then parsed and validated (in a worker thread: a 4 MiB body is
CPU work the event loop must not wait on). JSON's absent NaN/Infinity and text that is not Unicode (a
lone UTF-16 surrogate, which "\\ud800" escapes can smuggle in) are 400s like any other bad body."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from colibri_stream.serve.schemas import ApiError, NoOps, describe_validation_error, refuse_unimplemented

MAX_BODY_BYTES = 4 * 2**20
BODY_TIMEOUT_S = 30.0
CLOSE = {"connection": "close"}  # the unread rest of a refused body cannot be skipped: the connection goes


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, timeout_s: float | None = None) -> bytes:
    """The body, read chunk by chunk; refused as soon as it (or its declared length) passes ``limit``,
    or when all of it has not arrived within ``timeout_s`` (default BODY_TIMEOUT_S)."""
    timeout_s = BODY_TIMEOUT_S if timeout_s is None else timeout_s
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(f"{int(declared)} bytes", limit)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    raise ApiError(499, "client disconnected while sending the body", "cancelled")
                body += message.get("body", b"")
                if len(body) > limit:
                    raise too_large(f"over {limit} bytes", limit)
                if not message.get("more_body", False):
                    return bytes(body)
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {timeout_s:g} s", "body_timeout", headers=CLOSE
        ) from None


def too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"request body of {size} exceeds the limit of {limit} bytes", "body_too_large", headers=CLOSE)


class _NotJson(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotJson(f"the request body contains {name}, which is not JSON (numbers must be finite)")


def parse_request(raw: bytes, schema: type[BaseModel], unimplemented: NoOps | None = None) -> Any:
    """The validated request, or ApiError 400 naming what is wrong, including a field of
    ``unimplemented`` (schemas.NoOps) whose value asks for something."""
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except _NotJson as exc:
        raise ApiError(400, str(exc), "invalid_json") from None
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, absurd nesting
        raise ApiError(400, "the request body is not valid JSON", "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_json")
    check_unicode(data)
    refuse_unimplemented(data, unimplemented or {})
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise ApiError(400, message, "invalid_value", param) from None


def check_unicode(data: Any) -> None:
    """Every string must be encodable as UTF-8 (what the tokenizer and the session files need)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
        raise ApiError(
            400, f"the request body contains {bad}, a lone UTF-16 surrogate: text must be valid Unicode", "invalid_text"
        ) from None
