"""The OpenAI Responses API (`/v1/responses`) end to end: the official `openai` client (its `responses.create`
and its streaming accumulator) and raw HTTP against a real server on loopback. The server runs the tiny
deepseek_v3 checkpoint with a DeepSeek-V3.1-style chat template (tools, tool results, reasoning_content)
and a tokenizer whose tool markers are special tokens, with a 2,048-token context so that an agent's
request fits. Answers with tool calls are scripted (Server.submit replaced, as in
text/test_tool_calls.py); token equality with the chat route, the prefix cache and the rendered prompts
use the real model.

tests/fixtures/agents/codex_responses_request.json is a request in the shape codex-rs's request builder
makes (instructions, developer + user messages, function tools, a namespace of MCP tools, a freeform
`custom` tool, the hosted `web_search` tool, reasoning, include, store false, prompt_cache_key, stream),
written after its source, shortened to fit the tiny model's context."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from colibri_stream.runtime.turn import RuntimeOptions, TurnResult, load_runtime
from colibri_stream.serve.responses_store import ResponseStore
from colibri_stream.serve.schemas import ApiError
from colibri_stream.serve.sealed import KEY_ENV, Sealer, SealError, load_key
from colibri_stream.text.chat_format import IncrementalDecoder
from colibri_stream.text.tool_calls import TOOL_MARKERS

MODEL = "tiny"
WAIT_S = 120
CONTEXT = 2048
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "agents" / "codex_responses_request.json"
CALLS, CALL, SEP, CALL_END, CALLS_END = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)
# DeepSeek-V3.1's shape: system text, the tools as JSON lines, then the turns; an assistant turn renders
# its reasoning_content (as thinking models' templates do) before its text and calls.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages if m['role'] == 'system' %}{{ m['content'] }}\n{% endfor %}"
    "{% if tools %}## Tools\n{% for tool in tools %}{{ tool['function'] | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>"
    "{% if m['reasoning_content'] %}<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}"
    "{% if m['tool_calls'] %}<｜tool▁calls▁begin｜>{% for tc in m['tool_calls'] %}"
    "{{ '<｜tool▁call▁begin｜>' + tc['function']['name'] + '<｜tool▁sep｜>' + tc['function']['arguments']"
    " + '<｜tool▁call▁end｜>' }}{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
HELLO = [{"role": "user", "content": "Hello, world!"}]
SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}},
}


def call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"{CALL}{name}{SEP}{json.dumps(arguments)}{CALL_END}"


# text, then shell(["ls"]) and the namespaced MCP tool mcp__docs__ + search
ANSWER = (
    "Let me look." + CALLS + call_text("shell", {"command": ["ls"]}) + call_text("mcp__docs__search", {"query": "x"})
)
ANSWER += CALLS_END


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny deepseek_v3 checkpoint with TEMPLATE, a marker-aware tokenizer and a 2k context."""
    dst = Path(shutil.copytree(tiny_checkpoints["deepseek_v3"], tmp_path_factory.mktemp("responses") / "model"))
    config = json.loads((dst / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (dst / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config["vocab_size"],
        special_tokens=["<bos>", "<eos>", *sorted(TOOL_MARKERS)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [FIXTURE.read_text(), TEMPLATE, ANSWER, json.dumps(SHELL), "Hello, world! List the files."]
    tokenizer.train_from_iterator(corpus * 20, trainer)
    tokenizer.save(str(dst / "tokenizer.json"))
    settings = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": TEMPLATE}
    (dst / "tokenizer_config.json").write_text(json.dumps(settings))
    return dst


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory, live_server):
    options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp("responses-kv"), model_id=MODEL)
    return live_server(load_runtime(checkpoint, options))


@pytest.fixture
def prompts(served, monkeypatch) -> list[list[int]]:
    """The prompt of every request from here on (the real model still answers)."""
    seen: list[list[int]] = []
    real_submit = served.server.submit

    async def spy(body, prompt, limit, session, owner=None, **options):
        seen.append(prompt)
        return await real_submit(body, prompt, limit, session, owner, **options)

    monkeypatch.setattr(served.server, "submit", spy)
    return seen


def script(monkeypatch, served, answer: str) -> list[list[int]]:
    """Replace served.server.submit: the 'model' writes ``answer`` (markers as special ids), decoded as the
    model thread decodes; returns the list each request's prompt is appended to."""
    tokenizer, chat = served.server.runtime.text_side()
    ids = tokenizer.encode(answer, add_special_tokens=False).ids
    seen: list[list[int]] = []

    async def submit(body, prompt, limit, session, owner=None, **options):
        seen.append(prompt)
        job = SimpleNamespace(events=asyncio.Queue(), cancel=threading.Event())
        decoder, out = IncrementalDecoder(tokenizer, chat.stop_ids), ids[:limit]
        for token in out:
            if delta := decoder.push(token):
                job.events.put_nowait(("text", delta))
        if tail := decoder.flush():
            job.events.put_nowait(("text", tail))
        stats = {"reused_tokens": 0}
        job.events.put_nowait(("done", TurnResult(out, "length" if len(ids) > limit else "stop", len(prompt), stats)))
        return job

    monkeypatch.setattr(served.server, "submit", submit)
    return seen


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def request(served, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=WAIT_S)
    conn.request(method, path, json.dumps(body) if body is not None else None, {"content-type": "application/json"})
    response = conn.getresponse()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    events = []
    for block in raw.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append(data)
    return events


def decoded(served, prompt: list[int]) -> str:
    return served.server.runtime.tokenizer.decode(prompt, skip_special_tokens=False)


MESSAGE_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


def collapsed(names: list[str]) -> list[str]:
    """Event names with each run of text deltas shown once."""
    return [n for i, n in enumerate(names) if not (n == "response.output_text.delta" and names[i - 1] == n)]


# ------------------------------------------------------------------------------------ answers
def test_greedy_tokens_equal_the_chat_routes(served):
    whole = client(served).responses.create(model=MODEL, input="Hello, world!", max_output_tokens=8, temperature=0)
    chat = client(served).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == MODEL
    assert [item.type for item in whole.output] == ["message"]
    assert whole.output_text == chat.choices[0].message.content
    usage = whole.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    cut = chat.choices[0].finish_reason == "length"
    assert whole.status == ("incomplete" if cut else "completed")
    assert (whole.incomplete_details.reason if cut else whole.incomplete_details) == (
        "max_output_tokens" if cut else None
    )


def test_instructions_and_items_render_as_the_chat_messages(served, prompts):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello, world!"}]}]
    client(served).responses.create(
        model=MODEL, instructions="Be brief.", input=items, max_output_tokens=1, temperature=0
    )
    client(served).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *HELLO], max_tokens=1, temperature=0
    )
    assert prompts[0] == prompts[1] and decoded(served, prompts[0]).startswith("<bos>Be brief.\n<｜User｜>Hello")


def test_the_sdk_parses_json_and_stream_with_tool_calls(served, monkeypatch):
    seen = script(monkeypatch, served, ANSWER)
    namespace = {
        "type": "namespace",
        "name": "mcp__docs__",
        "description": "docs",
        "tools": [{**SHELL, "name": "search"}],
    }
    kwargs = dict(model=MODEL, input="List the files.", tools=[SHELL, namespace], max_output_tokens=200)
    whole = client(served).responses.create(**kwargs)
    with client(served).responses.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    for response in (whole, final):
        assert response.status == "completed" and response.output_text == "Let me look."
        assert [item.type for item in response.output] == ["message", "function_call", "function_call"]
        shell, search = response.output[1:]
        assert (shell.name, shell.namespace, json.loads(shell.arguments)) == ("shell", None, {"command": ["ls"]})
        assert (search.name, search.namespace, json.loads(search.arguments)) == (
            "search",
            "mcp__docs__",
            {"query": "x"},
        )
        assert shell.call_id != search.call_id and shell.call_id.startswith("call_")
    assert collapsed(events) == [
        "response.created",
        "response.in_progress",
        *MESSAGE_EVENTS,
        *CALL_EVENTS,
        *CALL_EVENTS,
        "response.completed",
    ]
    assert seen[0] == seen[1]
    prompt = decoded(served, seen[0])
    assert json.dumps(SHELL["parameters"]) in prompt and '"name": "mcp__docs__search"' in prompt


def test_a_codex_request_is_answered_in_the_event_order_the_clients_read(served, monkeypatch):
    seen = script(monkeypatch, served, ANSWER)
    codex = json.loads(FIXTURE.read_text())
    status, headers, raw = request(served, "POST", "/v1/responses", codex)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["x-colibri-ignored-tools"] == "custom,web_search"
    events = sse_events(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    names = [e["type"] for e in events]
    expected = ["response.created", "response.in_progress", *MESSAGE_EVENTS, *CALL_EVENTS, *CALL_EVENTS]
    assert collapsed(names) == [*expected, "response.completed"]
    created, completed = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == completed["id"]
    assert completed["status"] == "completed" and completed["store"] is False
    assert completed["colibri"]["ignored_tools"] == ["custom", "web_search"]
    usage = completed["usage"]
    assert usage["input_tokens"] == len(seen[0]) and usage["input_tokens_details"]["cached_tokens"] == 0
    calls = [e["item"] for e in events if e["type"] == "response.output_item.done"][1:]
    assert completed["output"][1:] == calls and calls[1]["namespace"] == "mcp__docs__"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert deltas == calls[0]["arguments"] + calls[1]["arguments"]
    prompt = decoded(served, seen[0])
    assert prompt.startswith("<bos>You are Codex") and "<permissions instructions>" in prompt
    assert '"name": "shell"' in prompt and '"name": "mcp__docs__search"' in prompt
    assert "apply_patch" not in prompt.split("## Tools")[1] and "web_search" not in prompt
    status, _, _ = request(served, "GET", f"/v1/responses/{completed['id']}")
    assert status == 404  # store: false


def test_the_codex_request_runs_on_the_real_model(served):
    """The same request, generated for real (a few tokens: Codex sends no max_output_tokens, this test does)."""
    codex = {**json.loads(FIXTURE.read_text()), "max_output_tokens": 4, "temperature": 0}
    status, _, raw = request(served, "POST", "/v1/responses", codex)
    events = sse_events(raw)
    final = events[-1]["response"]
    assert status == 200 and events[-1]["type"] in ("response.completed", "response.incomplete")
    assert final["usage"]["input_tokens"] > 200 and 1 <= final["usage"]["output_tokens"] <= 4
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final["output"]


def test_a_cut_answer_streams_response_incomplete(served):
    body = {"model": MODEL, "input": "Hello, world!", "max_output_tokens": 3, "temperature": 0, "stream": True}
    status, _, raw = request(served, "POST", "/v1/responses", body)
    events = sse_events(raw)
    final = events[-1]["response"]
    assert status == 200 and events[-1]["type"] == "response.incomplete" and final["status"] == "incomplete"
    assert final["usage"]["output_tokens"] == 3 and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]


def test_a_failed_generation_is_response_failed_when_streamed_and_its_status_when_not(served, monkeypatch):
    async def submit(body, prompt, limit, session, owner=None, **options):
        job = SimpleNamespace(events=asyncio.Queue(), cancel=threading.Event())
        job.events.put_nowait(("text", "Par"))
        job.events.put_nowait(("error", ApiError(507, "disk full", "insufficient_storage")))
        return job

    monkeypatch.setattr(served.server, "submit", submit)
    body = {"model": MODEL, "input": "Hello, world!", "stream": True}
    status, _, raw = request(served, "POST", "/v1/responses", body)
    events = sse_events(raw)
    assert status == 200 and [e["type"] for e in events][-1] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "insufficient_storage", "message": "disk full"}
    with pytest.raises(openai.APIStatusError) as refused:
        client(served).responses.create(model=MODEL, input="Hello, world!")
    assert refused.value.status_code == 507
    seen = script(monkeypatch, served, "Par")  # then cancelled (a server stopping): no answer, nothing stored
    turn = TurnResult([5], "cancelled", 3, {"reused_tokens": 0})
    scripted = served.server.submit

    async def cancelled(*args, **kwargs):
        job = await scripted(*args, **kwargs)
        job.events = asyncio.Queue()
        job.events.put_nowait(("done", turn))
        return job

    monkeypatch.setattr(served.server, "submit", cancelled)
    status, _, raw = request(served, "POST", "/v1/responses", body)
    last = sse_events(raw)[-1]
    assert last["type"] == "response.failed" and last["response"]["error"]["code"] == "cancelled" and seen
    status, _, _ = request(served, "GET", f"/v1/responses/{last['response']['id']}")
    assert status == 404


# ------------------------------------------------------------------------------------ conversations
def test_a_tool_round_trip_renders_the_call_and_its_output(served, prompts):
    items = [
        {"role": "user", "content": "List the files."},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"command": ["ls"]}'},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py\nb.py"},
    ]
    client(served).responses.create(model=MODEL, input=items, tools=[SHELL], max_output_tokens=1, temperature=0)
    chat = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": None, "tool_calls": [_chat_call("c1", "shell", '{"command": ["ls"]}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py"},
    ]
    chat_tools = [{"type": "function", "function": {k: v for k, v in SHELL.items() if k != "type"}}]
    client(served).chat.completions.create(model=MODEL, messages=chat, tools=chat_tools, max_tokens=1, temperature=0)
    prompt = decoded(served, prompts[0])
    assert call_text("shell", {"command": ["ls"]}) in prompt
    assert prompt.endswith("<｜tool▁output▁begin｜>a.py\nb.py<｜tool▁output▁end｜><｜Assistant｜>")
    assert prompts[0] == prompts[1]


def _chat_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_conversations_second_request_reads_its_prompt_from_the_prefix_cache(served):
    """Codex's way (store false, the whole conversation resent): the second request's prompt is the first's
    plus a short turn, and at least 90% of it is reported as cached_tokens."""
    runtime = served.server.runtime
    preamble = "You are a coding agent. Follow the repository's conventions. " * 4
    while len(runtime.encode_chat([{"role": "system", "content": preamble}, *HELLO])) < 1200:
        preamble += "Keep answers short and precise; run the tests before you finish. "
    ask = dict(model=MODEL, instructions=preamble, max_output_tokens=2, temperature=0, store=False)
    first = client(served).responses.create(**ask, input="Hello, world!")
    turn = [
        {"role": "user", "content": "Hello, world!"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "Go on."},
    ]
    second = client(served).responses.create(**ask, input=turn)
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens >= 1200 and second.usage.input_tokens > first.usage.input_tokens
    assert cached >= 0.9 * second.usage.input_tokens
    assert cached == second.model_extra["colibri"]["reused_tokens"]


def test_previous_response_id_continues_a_stored_conversation(served, prompts):
    ask = dict(model=MODEL, max_output_tokens=2, temperature=0)
    first = client(served).responses.create(**ask, instructions="Be brief.", input="Hello, world!")
    second = client(served).responses.create(**ask, previous_response_id=first.id, input="Go on.")
    explicit = [
        {"role": "user", "content": "Hello, world!"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Go on."},
    ]
    client(served).responses.create(**ask, input=explicit)
    assert prompts[1] == prompts[2]  # the stored input and output, before the new input; no instructions
    assert second.previous_response_id == first.id
    assert client(served).responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.BadRequestError) as refused:
        client(served).responses.create(**ask, previous_response_id="resp_unknown", input="Go on.")
    assert refused.value.code == "previous_response_not_found" and refused.value.param == "previous_response_id"
    unstored = client(served).responses.create(**ask, input="Hello, world!", store=False)
    with pytest.raises(openai.NotFoundError):
        client(served).responses.retrieve(unstored.id)
    client(served).responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client(served).responses.retrieve(first.id)


def test_the_store_is_bounded_in_count_and_bytes():
    store = ResponseStore(max_responses=2, max_bytes=1000)
    for rid in ("a", "b", "c"):
        assert store.put(rid, {"id": rid}, [], None)
    assert store.get("a", None) is None and store.get("b", None) is not None and len(store) == 2
    assert store.get("c", b"another key") is None  # visible to the key that made it only
    assert store.put("big", {"id": "big", "text": "x" * 600}, [], None)
    assert [rid for rid in "bc" if store.get(rid, None)] == ["c"] and store.bytes <= 1000
    assert not store.put("huge", {"text": "x" * 2000}, [], None) and store.get("huge", None) is None
    assert store.evicted == 2


# ------------------------------------------------------------------------------------ sealed reasoning
def test_sealed_reasoning_is_rendered_back_and_a_forged_one_is_refused(served, prompts):
    seal = served.http_server.config.app.state.responses.seal_reasoning
    summary = [{"type": "summary_text", "text": "Listing."}]
    item = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": summary,
        "encrypted_content": seal("The user wants a listing."),
    }
    items = [
        {"role": "user", "content": "List the files."},
        item,
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        {"role": "user", "content": "Go on."},
    ]
    client(served).responses.create(model=MODEL, input=items, max_output_tokens=1, temperature=0)
    assert "<｜Assistant｜><think>The user wants a listing.</think>Sure." in decoded(served, prompts[0])
    blob = item["encrypted_content"]
    forged = blob[:-2] + ("A" if blob[-2] != "A" else "B") + blob[-1]
    for bad in (forged, Sealer(bytes(32)).seal("The user wants a listing.", "responses.reasoning"), "garbage"):
        items[1] = {**item, "encrypted_content": bad}
        with pytest.raises(openai.BadRequestError) as refused:
            client(served).responses.create(model=MODEL, input=items, max_output_tokens=1)
        assert refused.value.param == "input.1.encrypted_content"
    items[1] = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}  # nothing sealed
    client(served).responses.create(model=MODEL, input=items, max_output_tokens=1, temperature=0)
    assert "<think>" not in decoded(served, prompts[-1])


def test_an_always_thinking_models_reasoning_comes_before_its_text_and_calls(served, monkeypatch):
    """This template has no thinking switch but knows </think> (as R1's): its answers are read for
    reasoning whatever ``reasoning`` asks, and the calls after the reasoning are parsed."""
    seen = script(monkeypatch, served, "<think>\nList first, then search.</think>\n\n" + ANSWER)
    docs = {"type": "namespace", "name": "mcp__docs__", "tools": [{**SHELL, "name": "search"}]}
    kwargs = dict(model=MODEL, input="List the files.", tools=[SHELL, docs], max_output_tokens=200)
    whole = client(served).responses.create(**kwargs, reasoning={"effort": "high"})
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call", "function_call"]
    assert whole.output[0].summary[0].text == "List first, then search." and whole.output_text == "Let me look."
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    client(served).responses.create(**kwargs)
    assert seen[0] == seen[1]  # no switch: effort renders nothing


@pytest.mark.parametrize("encrypt", [True, False])
def test_a_seal_opens_only_with_its_key_and_purpose(encrypt):
    if encrypt:
        pytest.importorskip("cryptography")
    sealer = Sealer(b"k" * 32, encrypt=encrypt)
    blob = sealer.seal("thinking, with ünïcode", "a")
    assert blob.startswith("cs1g." if encrypt else "cs1h.") and sealer.encrypts == encrypt
    assert Sealer(b"k" * 32).open(blob, "a") == "thinking, with ünïcode"  # either kind opens on any holder
    if encrypt:  # the text is hidden too: the same text seals differently each time (a fresh nonce)
        assert sealer.seal("thinking, with ünïcode", "a") != blob
    for opener, purpose, text in (
        (Sealer(b"j" * 32), "a", blob),
        (sealer, "b", blob),
        (sealer, "a", blob[:-1]),
        (sealer, "a", blob[:6]),
    ):
        with pytest.raises(SealError):
            opener.open(text, purpose)


def test_the_seal_key_is_kept_in_the_kv_dir_or_read_from_a_file(tmp_path):
    first = load_key(tmp_path, env={})
    assert load_key(tmp_path, env={}) == first and len(first) == 32
    assert (tmp_path / "seal.key").stat().st_mode & 0o777 == 0o600
    named = tmp_path / "shared.key"
    named.write_bytes(b"s" * 40)
    assert load_key(tmp_path, env={KEY_ENV: str(named)}) not in (first, b"s" * 40)
    named.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 32"):
        load_key(tmp_path, env={KEY_ENV: str(named)})


# ------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("background", True, "background"),
        ("conversation", "conv_1", "conversation"),
        ("prompt", {"id": "pmpt_1"}, "prompt"),
        ("top_logprobs", 2, "top_logprobs"),
        ("truncation", "auto", "truncation"),
        ("max_tool_calls", 3, "max_tool_calls"),
        ("tool_choice", "required", "tool_choice"),
        ("tool_choice", {"type": "function", "name": "shell"}, "tool_choice"),
        ("text", {"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
        ("tool_choice", {"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice"),
        ("include", ["message.output_text.logprobs"], "include.0"),
        ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input.0.message"),
        ("input", [{"type": "item_reference", "id": "msg_1"}], "input.0"),
        (
            "input",
            [{"type": "function_call", "call_id": "c", "name": "shell", "arguments": "[1]"}],
            "input.0.arguments",
        ),
        ("tools", [{"type": "function", "name": "bad name", "parameters": {}}], "tools.0.function.name"),
    ],
)
def test_unimplemented_or_bad_fields_are_400s_naming_them(served, field, value, param):
    body = {"model": MODEL, "input": "Hello, world!", "max_output_tokens": 2, field: value}
    status, _, raw = request(served, "POST", "/v1/responses", body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"].startswith(param), error
    assert error["message"].startswith(param.split(".")[0])


def test_no_op_values_labels_and_hints_are_accepted(served):
    body = {
        "model": MODEL,
        "input": "Hello, world!",
        "max_output_tokens": 2,
        "background": False,
        "truncation": "disabled",
        "top_logprobs": 0,
        "tool_choice": "none",
        "tools": [SHELL, {"type": "web_search_preview"}, {"type": "local_shell"}],
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "reasoning": {"effort": "high", "summary": "detailed"},
        "user": "alice@example.com",
        "safety_identifier": '{"device_id": "d7726a"}',
        "prompt_cache_key": "thread-1",
        "parallel_tool_calls": False,
        "service_tier": "auto",
        "metadata": {"k": "v"},
    }
    status, headers, raw = request(served, "POST", "/v1/responses", body)
    response = json.loads(raw)
    assert status == 200, response
    assert headers["x-colibri-ignored-tools"] == "web_search_preview,local_shell"
    assert response["metadata"] == {"k": "v"} and response["reasoning"] == {"effort": "high", "summary": "detailed"}


def test_max_output_tokens_past_the_context_is_cut_to_the_room(served):
    body = {"model": MODEL, "input": "Hello, world!", "max_output_tokens": CONTEXT, "temperature": 0}
    status, _, raw = request(served, "POST", "/v1/responses", body)
    answer = json.loads(raw)
    assert status == 200, answer
    usage = answer["usage"]
    assert usage["input_tokens"] + usage["output_tokens"] <= CONTEXT


def test_codex_additional_tools_and_configuration_update_items(served):
    """Codex 0.171 offers its tools in an ``additional_tools`` input item (no top-level ``tools``) and sets its
    effort with a ``configuration_update`` item: the same prompt as the tools given in ``tools``."""
    namespace = {
        "type": "namespace",
        "name": "functions",
        "description": "",
        "tools": [
            {"type": "function", "name": "shell", "parameters": {"type": "object"}},
            {"type": "custom", "name": "x"},
        ],
    }
    ask = {"type": "message", "role": "user", "content": "Hello, world!"}
    inside = [{"type": "additional_tools", "role": "developer", "tools": [namespace]}, ask]
    inside.append({"type": "configuration_update", "reasoning": {"effort": "low"}})
    bodies = [
        {"model": MODEL, "input": inside, "max_output_tokens": 1, "temperature": 0},
        {"model": MODEL, "input": [ask], "tools": [namespace], "max_output_tokens": 1, "temperature": 0},
        {"model": MODEL, "input": [ask], "max_output_tokens": 1, "temperature": 0},
    ]
    answers = []
    for body in bodies:
        status, _, raw = request(served, "POST", "/v1/responses", body)
        assert status == 200, raw
        answers.append(json.loads(raw))
    tokens = [a["usage"]["input_tokens"] for a in answers]
    assert tokens[0] == tokens[1] > tokens[2]  # the tools are in the prompt, as if given in tools
    assert answers[0]["colibri"]["ignored_tools"] == ["functions:custom"]
