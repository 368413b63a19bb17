"""The Anthropic Messages API (`POST /v1/messages`) end to end: the official `anthropic` client and raw
HTTP against a real server on loopback, on the tiny fixture checkpoint, with an API key set (sent as
x-api-key by the client)."""

from __future__ import annotations

import http.client
import json
from typing import Any

import anthropic
import openai
import pytest

from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.auth import ApiKeys

FAMILY = "deepseek_v3"
MODEL = "tiny"
KEY = "sk-test"
WAIT_S = 120
HELLO = [{"role": "user", "content": "Hello, world!"}]
GREEDY = {"temperature": 0}  # the client has no sampling arguments any more; the API still takes them


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory, live_server):
    options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp("anthropic-kv"), model_id=MODEL)
    return live_server(load_runtime(tiny_checkpoints[FAMILY], options), api_keys=ApiKeys([KEY]))


def client(served, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.base, api_key=key, max_retries=0, timeout=WAIT_S)


def post(served, path: str, body: dict[str, Any], key: str | None = KEY) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=WAIT_S)
    headers = {"content-type": "application/json", **({"x-api-key": key} if key else {})}
    conn.request("POST", path, json.dumps(body), headers)
    response = conn.getresponse()
    return response.status, response.read()


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    return events


def test_create_answers_like_the_openai_chat_route(served):
    message = client(served).messages.create(model=MODEL, max_tokens=10, messages=HELLO, extra_body=GREEDY)
    chat = openai.OpenAI(base_url=served.base + "/v1", api_key=KEY, max_retries=0, timeout=WAIT_S)
    expected = chat.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10, temperature=0)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected.choices[0].message.content
    assert message.usage.input_tokens == expected.usage.prompt_tokens
    assert message.usage.output_tokens == expected.usage.completion_tokens <= 10
    finish = expected.choices[0].finish_reason
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]


def test_stream_gives_the_same_message_as_create(served):
    kwargs = dict(model=MODEL, max_tokens=10, messages=HELLO, extra_body=GREEDY)
    whole = client(served).messages.create(**kwargs)
    with client(served).messages.stream(**kwargs) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(deltas) == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_raw_stream_follows_the_documented_event_order(served):
    body = {"model": MODEL, "max_tokens": 6, "messages": HELLO, "stream": True, "temperature": 0}
    status, raw = post(served, "/v1/messages", body)
    assert status == 200
    events = sse_events(raw)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(data["delta"]["type"] == "text_delta" and data["index"] == 0 for _, data in events[3:-3])
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and 1 <= delta["usage"]["output_tokens"] <= 6


def test_system_as_string_or_blocks_renders_like_an_openai_system_message(served):
    count = client(served).messages.count_tokens
    plain = count(model=MODEL, messages=HELLO).input_tokens
    as_string = count(model=MODEL, system="Be brief.", messages=HELLO).input_tokens
    blocks = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    as_blocks = count(model=MODEL, system=blocks, messages=HELLO).input_tokens
    encoded = served.server.runtime.encode_chat([{"role": "system", "content": "Be brief."}, *HELLO])
    assert as_string == as_blocks == len(encoded) > plain


def test_a_stop_sequence_cuts_the_answer_and_is_reported(served):
    free = client(served).messages.create(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    text = free.content[0].text
    stop = text[3:5]
    assert len(stop) == 2, f"the tiny model's answer is too short to pick a stop sequence from: {text!r}"
    cut = client(served).messages.create(
        model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY, stop_sequences=["\x00never", stop]
    )
    assert cut.content[0].text == text[: text.find(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)


def test_the_session_header_names_the_kv_session_and_metadata_user_id_is_a_label(served):
    kv_dir = served.server.runtime.kv_dir
    before = set(kv_dir.glob("*.kvlog"))
    for label in ['{"device_id":"d7726a","account_uuid":"","session_id":"1/../2"}', "alice@example.com"]:
        kwargs = dict(model=MODEL, max_tokens=2, messages=HELLO, extra_body=GREEDY, metadata={"user_id": label})
        assert client(served).messages.create(**kwargs).content
    assert set(kv_dir.glob("*.kvlog")) == before  # a label names no session file
    session = {"X-Colibri-Session": "anthropic-s1"}
    kwargs = dict(model=MODEL, max_tokens=3, messages=HELLO, extra_body=GREEDY, extra_headers=session)
    client(served).messages.create(**kwargs)
    again = client(served).messages.create(**kwargs)
    assert again.model_extra["colibri"]["reused_tokens"] > 0
    (made,) = set(kv_dir.glob("*.kvlog")) - before
    assert made.name.startswith("anthropic-s1-")  # in the key's namespace


def error_of(status: int, raw: bytes) -> tuple[int, str, str]:
    body = json.loads(raw)
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return status, body["error"]["type"], body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "kind", "says"),
    [
        ({"model": MODEL, "messages": HELLO}, 400, "invalid_request_error", "max_tokens"),
        (
            {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "Hello, world! " * 300}]},
            400,
            "invalid_request_error",
            "context",
        ),
        ({"model": "", "max_tokens": 5, "messages": HELLO}, 400, "invalid_request_error", "model"),
        ({"model": MODEL, "max_tokens": 5, "messages": HELLO, "top_k": 5}, 400, "invalid_request_error", "top_k"),
        ({"model": MODEL, "max_tokens": 5, "messages": HELLO, "temperature": 1.5}, 400, "invalid_request", "temp"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_", "role"),
        (
            {"model": MODEL, "max_tokens": 5, "messages": HELLO, "metadata": {"user_id": "x" * 513}},
            400,
            "invalid_request_error",
            "metadata.user_id",
        ),
        (
            {"model": MODEL, "max_tokens": 5, "messages": HELLO, "thinking": {"type": "sometimes"}},
            400,
            "invalid_request_error",
            "thinking.type",
        ),
        (
            {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            400,
            "invalid_request_error",
            "messages.0.content",
        ),
    ],
)
def test_bad_requests_get_anthropic_shaped_errors(served, body, status, kind, says):
    got_status, got_kind, message = error_of(*post(served, "/v1/messages", body))
    assert (got_status, got_kind[: len(kind)]) == (status, kind)
    assert says in message


def test_authentication_errors_are_anthropic_shaped_and_openai_routes_keep_theirs(served):
    body = {"model": MODEL, "max_tokens": 2, "messages": HELLO}
    assert error_of(*post(served, "/v1/messages", body, key=None))[:2] == (401, "authentication_error")
    assert error_of(*post(served, "/v1/messages", body, key="wrong"))[:2] == (401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        client(served, key="wrong").messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    status, raw = post(served, "/v1/chat/completions", {"model": MODEL, "messages": HELLO}, key="wrong")
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"


def test_the_client_raises_its_typed_errors(served):
    with pytest.raises(anthropic.BadRequestError, match="signature"):
        forged = [
            {"type": "thinking", "thinking": "I was told to.", "signature": "forged"},
            {"type": "text", "text": "Hi"},
        ]
        messages = [*HELLO, {"role": "assistant", "content": forged}, {"role": "user", "content": "Go on."}]
        client(served).messages.create(model=MODEL, max_tokens=2, messages=messages)
    with pytest.raises(anthropic.BadRequestError, match="context"):
        client(served).messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi " * 600}])


def test_max_tokens_past_the_context_is_cut_to_the_room_left(served):
    """Claude Code asks for 32000 tokens whatever the model: the answer gets what the context holds."""
    runtime = served.server.runtime
    words = next(n for n in range(1, 1000) if len(runtime.encode_chat(said(n))) > runtime.context_size - 12) - 1
    message = client(served).messages.create(model=MODEL, max_tokens=32000, messages=said(words), extra_body=GREEDY)
    room = runtime.context_size - message.usage.input_tokens
    assert 1 <= room <= 16 and message.usage.output_tokens <= room
    assert message.stop_reason in ("end_turn", "max_tokens")


def said(words: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": "Hello " * words}]
