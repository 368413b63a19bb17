"""Random JSON schemas of the kinds API clients send (tool parameters, structured-output formats), and a
valid instance of each: the constrained-decoding tests and tools/bench_grammar.py draw from here.

What clients send, as pydantic, zod and hand-written tool definitions emit it: an object at the root with
described properties, some required; strings (sometimes a format or a bounded length), integers and numbers
(sometimes a range), booleans, string enums, arrays of scalars or objects, nested objects, optional values
as ``anyOf [X, null]`` or ``type: [X, "null"]``. Every object is closed (``additionalProperties: false``, as
OpenAI's strict mode and pydantic's forbid-extra send it: an open object lets a model add keys without end),
every string and array is bounded (maxLength, maxItems), every integer has a range and every number a range
and a ``multipleOf`` (0.25: its fraction has at most two digits, and is exact in binary, so jsonschema's
float division checks it exactly), so a grammar built from a schema forces an end within a few hundred
tokens whatever a model writes (no max_tokens cut truncates a constrained answer). Unbounded, a small
model does loop: the demo writes 0.434343... until its budget runs out.
"""

from __future__ import annotations

import random
import string
from typing import Any

MAX_STRING = 8  # characters in a generated string value
MAX_ITEMS = 3  # items in an array
NAMES = ["path", "query", "city", "limit", "mode", "items", "user", "tags", "count", "options", "id", "value"]
WORDS = ["alpha", "beta", "red", "green", "fast", "slow", "read", "write", "yes", "no", "on", "off"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema with 1-4 properties, nested at most two levels below the root."""
    names = rng.sample(NAMES, rng.randint(1, 4))
    properties = {name: _value_schema(rng, depth + 1) for name in names}
    for spec in properties.values():
        if rng.random() < 0.4:
            spec["description"] = rng.choice(WORDS) + " " + rng.choice(WORDS)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    required = [name for name in names if rng.random() < 0.6]
    if required:
        schema["required"] = required
    schema["additionalProperties"] = False
    return schema


def _value_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "object":
        spec = random_schema(rng, depth)
    elif kind == "array":
        items = random_schema(rng, depth + 1) if depth < 3 and rng.random() < 0.3 else _scalar(rng)
        spec = {"type": "array", "items": items, "maxItems": rng.randint(1, MAX_ITEMS)}
        if rng.random() < 0.3:
            spec["minItems"] = 1
    elif kind == "enum":
        spec = {"type": "string", "enum": rng.sample(WORDS, rng.randint(1, 4))}
    else:
        spec = _scalar(rng, kind)
    if rng.random() < 0.15:  # Optional[X]: pydantic's anyOf, or a type list
        spec = {"anyOf": [spec, {"type": "null"}]} if rng.random() < 0.5 else _nullable_type(spec)
    return spec


def _scalar(rng: random.Random, kind: str | None = None) -> dict[str, Any]:
    kind = kind or rng.choice(["string", "integer", "number", "boolean"])
    if kind == "string":
        spec: dict[str, Any] = {"type": "string", "maxLength": rng.randint(1, MAX_STRING)}
        if rng.random() < 0.2:
            spec["minLength"] = 1
        return spec
    if kind == "integer":
        low = rng.randint(-100, 10)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000]), "multipleOf": 0.25}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(WORDS, rng.randint(1, 4))}
    return {"type": "boolean"}


def _nullable_type(spec: dict[str, Any]) -> dict[str, Any]:
    if "enum" in spec or "type" not in spec or not isinstance(spec["type"], str):
        return {"anyOf": [spec, {"type": "null"}]}
    return {**spec, "type": [spec["type"], "null"]}


def random_instance(schema: dict[str, Any], rng: random.Random) -> Any:
    """A value valid against a schema ``random_schema`` made (every property, required or not)."""
    if "anyOf" in schema:
        return random_instance(rng.choice(schema["anyOf"]), rng)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = rng.choice(kind)
    if kind == "object":
        return {name: random_instance(spec, rng) for name, spec in schema.get("properties", {}).items()}
    if kind == "array":
        count = rng.randint(schema.get("minItems", 0), schema["maxItems"])
        return [random_instance(schema["items"], rng) for _ in range(count)]
    if kind == "string":
        length = rng.randint(schema.get("minLength", 0), schema["maxLength"])
        return "".join(rng.choice(string.ascii_letters + " ") for _ in range(length))
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if kind == "number":
        return rng.randint(0, int(schema["maximum"] * 4)) / 4
    if kind == "boolean":
        return rng.random() < 0.5
    return None
