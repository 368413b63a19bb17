"""Forced tool calls and structured output over HTTP (serve/constrained.py), on the demo model (whose chat
template has no tool-call format: a forced call is decoded as JSON whatever the family), parsed by the
official `openai` and `anthropic` SDKs: OpenAI tool_choice "required" and a named function (streamed too),
response_format json_object and json_schema (the SDK's own ``parse`` with a pydantic model), Anthropic
tool_choice any and tool; a few random schemas through HTTP; bad schemas and unknown tools are 400s naming
the field."""

from __future__ import annotations

import json
import random

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.devtools.json_schemas import random_schema
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime

MODEL = "demo"
WAIT_S = 120
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["query"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": s}} for n, s in SCHEMAS.items()
]
ANTHROPIC_TOOLS = [{"name": n, "description": n, "input_schema": s} for n, s in SCHEMAS.items()]


@pytest.fixture(scope="module")
def served(tmp_path_factory, live_server):
    options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp("constrained-kv"), model_id=MODEL)
    return live_server(load_runtime(demo_model_dir(), options))


def openai_client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def anthropic_client(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.base, api_key="unused", max_retries=0, timeout=WAIT_S)


def chat(served, **request):
    request = {"max_tokens": 200, **request}
    return openai_client(served).chat.completions.create(model=MODEL, messages=ASK, temperature=0, **request)


def test_tool_choice_required_is_a_real_tool_call(served):
    choice = chat(served, tools=OPENAI_TOOLS, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_called_streamed_or_not(served):
    named = {"type": "function", "function": {"name": "search"}}
    choice = chat(served, tools=OPENAI_TOOLS, tool_choice=named).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "search"
    jsonschema.validate(json.loads(call.function.arguments), SEARCH)
    chunks = list(chat(served, tools=OPENAI_TOOLS, tool_choice=named, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "search", call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # no JSON leaks as text


class Forecast(BaseModel):
    city: str
    days: int
    sunny: bool


def test_response_format_json_schema_and_json_object(served):
    parsed = openai_client(served).chat.completions.parse(
        model=MODEL, messages=ASK, max_tokens=200, temperature=0, response_format=Forecast
    )
    message = parsed.choices[0].message
    assert isinstance(message.parsed, Forecast) and parsed.choices[0].finish_reason == "stop"
    # any object: the grammar cannot force an end (the demo adds keys until max_tokens), only the shape
    answer = chat(served, response_format={"type": "json_object"}, max_tokens=12).choices[0]
    assert answer.message.content.startswith('{"')  # unconstrained, the demo answers in prose
    if answer.finish_reason == "stop":
        assert isinstance(json.loads(answer.message.content), dict)


def test_random_schemas_through_http_validate(served):
    rng = random.Random(11)
    for _ in range(4):
        schema = random_schema(rng)
        form = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        content = chat(served, response_format=form).choices[0].message.content
        jsonschema.validate(json.loads(content), schema)


def test_anthropic_tool_choice_any_and_tool(served):
    client = anthropic_client(served)
    ask = dict(model=MODEL, max_tokens=200, messages=ASK, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0})
    message = client.messages.create(**ask, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use"
    (block,) = [b for b in message.content if b.type == "tool_use"]
    assert block.id.startswith("toolu_")
    jsonschema.validate(block.input, SCHEMAS[block.name])
    with client.messages.stream(**ask, tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    (block,) = final.content
    assert final.stop_reason == "tool_use" and block.type == "tool_use" and block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER)


@pytest.mark.parametrize(
    ("request_fields", "param"),
    [
        (
            {"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_bad_schemas_and_unknown_tools_are_400s_naming_the_field(served, request_fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(served, **request_fields)
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == param and refused.value.body["message"].startswith(param)


def test_anthropic_refusals_name_the_field(served):
    client = anthropic_client(served)
    ask = dict(model=MODEL, max_tokens=20, messages=ASK)
    for fields, param in [
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        (
            {
                "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}],
                "tool_choice": {"type": "any"},
            },
            "tools.0.input_schema",
        ),
    ]:
        with pytest.raises(anthropic.BadRequestError, match=param.replace(".", r"\.")) as refused:
            client.messages.create(**ask, **fields)
        assert refused.value.status_code == 400


# ------------------------------------------------------------------------------------ Responses API
RESPONSES_TOOLS = [{"type": "function", "name": n, "description": n, "parameters": s} for n, s in SCHEMAS.items()]


def respond(served, **request):
    request = {"max_output_tokens": 200, "temperature": 0, **request}
    return openai_client(served).responses.create(model=MODEL, input=ASK[0]["content"], **request)


def test_responses_forced_calls_are_function_call_items(served):
    calls = [item for item in respond(served, tools=RESPONSES_TOOLS, tool_choice="required").output]
    calls = [item for item in calls if item.type == "function_call"]
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    named = {"type": "function", "name": "search"}
    request = {"max_output_tokens": 200, "temperature": 0, "tools": RESPONSES_TOOLS, "tool_choice": named}
    with openai_client(served).responses.stream(model=MODEL, input=ASK[0]["content"], **request) as stream:
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.name == "search" and not final.output_text  # no JSON leaks as text
    jsonschema.validate(json.loads(call.arguments), SEARCH)


def test_responses_text_format_json_schema_parses(served):
    parsed = openai_client(served).responses.parse(
        model=MODEL, input=ASK[0]["content"], max_output_tokens=200, temperature=0, text_format=Forecast
    )
    assert isinstance(parsed.output_parsed, Forecast) and parsed.status == "completed"
