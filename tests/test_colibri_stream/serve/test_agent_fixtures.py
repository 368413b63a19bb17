"""The requests the real agents send, recorded once from the real clients (tests/fixtures/agents/*_recorded.json,
README.md there: `tools/agent_clients.py --record`), replayed against `serve` with the shipped demo
model's tokenizer and chat template (agent_model below).

Two checks per client:
- the request exactly as recorded (path, body, the client's own headers; streamed, as each client asks)
  gets 200 and a first event its SDK parses; the stream is then closed, which cancels the job before its
  prompt is computed (a 26k-token prompt takes the demo model minutes on a busy machine);
- the same request through the client's SDK (`anthropic` for Claude Code, `openai` for the others:
  Responses for Codex, chat completions for OpenCode and Aider) is answered and parsed, and a second turn
  (the answer and one more user message appended) reports >= 90% of its prompt as cached in the API's
  standard usage field. For speed this pair is sent with every string of the body cut to CUT characters
  (every field, tool, message and item kept, so the request keeps its shape; the prompt is 2-7k tokens
  instead of 9-26k), except Aider's, sent whole (1k tokens: cut, it would be too short for 90% in 64-token
  prefix blocks); and with the answer limited to MAX_TOKENS tokens: the clients' own limits (64000, 32000,
  or none: the server's default 4096) would decode for minutes. The second turn appends to the first
  (what Claude Code, Codex and OpenCode do); Aider itself, restoring a chat, puts the history before the
  files, so its real second request shares only its system prompt with the first (docs/benchmarks.md).

A check that fails today because a feature another part of #69 adds is missing is marked
xfail(strict=True) naming that feature: the mark comes off when the feature lands."""

from __future__ import annotations

import http.client
import inspect
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types import RawMessageStartEvent
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseCreatedEvent

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.devtools import fixtures
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "agents"
WAIT_S = 300
CUT = 300  # characters kept of each string of the body in the SDK + prefix-cache check
MAX_TOKENS = 16
FOLLOW_UP = "Thanks. Now add a comment at the top of hello.py."
TINY = dict(
    vocab_size=4096,  # the demo tokenizer's
    max_position_embeddings=32768,
    num_hidden_layers=2,
    indexer_types=["full", "shared"],
    hidden_size=32,
    num_attention_heads=1,
    num_key_value_heads=1,
    index_n_heads=1,
    index_head_dim=16,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    intermediate_size=64,
    moe_intermediate_size=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
)
DEMO_TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
# the client's own headers that may change an answer (versions, betas); transport and identity ones are not sent
SENT_HEADER_PREFIXES = ("anthropic-", "openai-", "x-codex", "x-claude", "session-id", "thread-id")


@dataclass(frozen=True)
class Case:
    label: str
    api: str  # "anthropic" | "responses" | "chat"
    recorded_missing: str | None = None  # why the request as recorded is refused today
    sdk_missing: str | None = None  # why the SDK + prefix-cache check fails today
    cut: bool = True  # send the SDK pair with each string cut to CUT characters

    def record(self) -> dict[str, Any]:
        return json.loads((FIXTURES / f"{self.label}_recorded.json").read_text())


CASES = [
    Case("claude_code", "anthropic"),
    Case("codex", "responses"),
    Case("opencode", "chat"),
    Case("aider", "chat", cut=False),
]


def _params(cases: list[Case], missing: Callable[[Case], str | None]) -> list[Any]:
    marks = lambda case: [pytest.mark.xfail(strict=True, reason=r)] if (r := missing(case)) else []  # noqa: E731
    return [pytest.param(case, id=case.label, marks=marks(case)) for case in cases]


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory) -> Path:
    """A tiny random GLM-5-shaped model (2 layers, width 32) speaking through the demo model's tokenizer
    and chat template (GLM tool calls, 32768-token context): the demo's own weights prefill ~300 tokens/s
    on a busy test machine, this ~5x faster, and the protocol is the same."""
    dst = fixtures.build_tiny_checkpoint(
        "glm_moe_dsa", tmp_path_factory.mktemp("agent-model") / "m", config_overrides=TINY
    )
    for name in DEMO_TEXT_FILES:
        shutil.copy(demo_model_dir() / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def served(live_server, agent_model, tmp_path_factory):
    options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp("agent-fixtures-kv"), model_id="demo")
    return live_server(load_runtime(agent_model, options))


def client_headers(record: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in record["headers"].items() if k.startswith(SENT_HEADER_PREFIXES)}


# ------------------------------------------------------------------------------------------ as recorded
def first_event(served, record: dict[str, Any]) -> tuple[int, bytes]:
    """POST the recorded request; (status, the body's first SSE event's data, or the whole error body)."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=WAIT_S)
    headers = {**client_headers(record), "content-type": "application/json", "authorization": "Bearer unused"}
    try:
        conn.request(record["method"], record["path"], json.dumps(record["body"]), headers)
        response = conn.getresponse()
        if response.status != 200:
            return response.status, response.read()
        lines = []
        while not lines or not lines[-1].startswith(b"data:"):
            line = response.fp.readline()
            assert line, "the stream ended before its first event"
            if line.strip():
                lines.append(line.strip())
        return 200, lines[-1][len(b"data:") :].strip()
    finally:
        conn.close()  # a stream left open would decode on: closing it cancels the job


FIRST_EVENT = {"anthropic": RawMessageStartEvent, "responses": ResponseCreatedEvent, "chat": ChatCompletionChunk}


@pytest.mark.parametrize("case", _params(CASES, lambda c: c.recorded_missing))
def test_the_request_as_recorded_is_answered(served, case: Case):
    record = case.record()
    assert record["body"].get("stream") is True, "each of these clients streams; the check reads one event"
    status, data = first_event(served, record)
    assert status == 200, data.decode(errors="replace")[:500]
    FIRST_EVENT[case.api].model_validate(json.loads(data))


# ------------------------------------------------------------------------------------------ through the SDKs
def cut(value: Any) -> Any:
    """Every string in ``value`` cut to CUT characters; keys, numbers and the nesting kept."""
    if isinstance(value, str):
        return value[:CUT]
    if isinstance(value, dict):
        return {k: cut(v) for k, v in value.items()}
    if isinstance(value, list):
        return [cut(v) for v in value]
    return value


def split_for(create: Callable[..., Any], body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the keyword arguments ``create`` names, the rest as extra_body): the body goes out as recorded."""
    known = set(inspect.signature(create).parameters)
    return {k: v for k, v in body.items() if k in known}, {k: v for k, v in body.items() if k not in known}


@dataclass
class Reply:
    text: str
    prompt_tokens: int
    cached_tokens: int


def ask_anthropic(served, record: dict[str, Any], body: dict[str, Any]) -> Reply:
    client = anthropic.Anthropic(base_url=served.base, api_key="unused", max_retries=0, timeout=WAIT_S)
    known, extra = split_for(client.beta.messages.create, {**body, "max_tokens": MAX_TOKENS})
    known.pop("stream", None)
    with client.beta.messages.stream(**known, extra_body=extra, extra_headers=client_headers(record)) as stream:
        message = stream.get_final_message()
    usage = message.usage
    cached = usage.cache_read_input_tokens or 0
    prompt = usage.input_tokens + cached + (usage.cache_creation_input_tokens or 0)
    text = "".join(block.text for block in message.content if block.type == "text")
    return Reply(text, prompt, cached)


def openai_client(served, record: dict[str, Any]) -> openai.OpenAI:
    headers = client_headers(record)
    return openai.OpenAI(
        base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S, default_headers=headers
    )


def ask_responses(served, record: dict[str, Any], body: dict[str, Any]) -> Reply:
    client = openai_client(served, record)
    known, extra = split_for(client.responses.create, {**body, "max_output_tokens": MAX_TOKENS})
    completed = None
    for event in client.responses.create(**known, extra_body=extra):
        if event.type in ("response.completed", "response.incomplete"):  # incomplete: cut at MAX_TOKENS
            completed = event.response
    assert completed is not None and completed.usage is not None, "no response.completed/incomplete with usage"
    usage = completed.usage
    return Reply(completed.output_text, usage.input_tokens, usage.input_tokens_details.cached_tokens)


def ask_chat(served, record: dict[str, Any], body: dict[str, Any]) -> Reply:
    client = openai_client(served, record)
    body = {k: v for k, v in body.items() if k != "max_completion_tokens"}
    known, extra = split_for(client.chat.completions.create, {**body, "max_tokens": MAX_TOKENS})
    text, usage = "", None
    for chunk in client.chat.completions.create(**known, extra_body=extra):
        text += "".join(choice.delta.content or "" for choice in chunk.choices)
        usage = chunk.usage or usage
    assert usage is not None and usage.prompt_tokens_details is not None, "no usage with prompt_tokens_details"
    return Reply(text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0)


ASK = {"anthropic": ask_anthropic, "responses": ask_responses, "chat": ask_chat}


def next_turn(api: str, body: dict[str, Any], answer: str) -> dict[str, Any]:
    """The conversation one turn on: the answer (some text if it was only tool calls), then FOLLOW_UP."""
    answer = answer or "Done."
    if api == "responses":
        said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answer}]}
        asked = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": FOLLOW_UP}]}
        return {**body, "input": [*body["input"], said, asked]}
    turns = [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
    return {**body, "messages": [*body["messages"], *turns]}


@pytest.mark.parametrize("case", _params(CASES, lambda c: c.sdk_missing))
def test_the_sdk_reads_the_answer_and_the_next_turn_comes_from_the_prefix_cache(served, case: Case):
    record = case.record()
    body = cut(record["body"]) if case.cut else record["body"]
    first = ASK[case.api](served, record, body)
    second = ASK[case.api](served, record, next_turn(case.api, body, first.text))
    assert second.prompt_tokens > first.prompt_tokens
    assert second.cached_tokens >= 0.9 * second.prompt_tokens, (second.cached_tokens, second.prompt_tokens)
