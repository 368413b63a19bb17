"""`serve` for agents and evaluation harnesses: any model name (``--strict-model-name``, ``--alias``),
logprobs on chat and completions (streamed too), ``echo`` with the prompt's logprobs, the reused
prefix in the APIs' usage fields, and 400s naming the fields still unimplemented. Logprobs are checked
against log_softmax of the transformers oracle's logits over the same ids."""

from __future__ import annotations

import http.client
import json
from typing import Any

import anthropic
import openai
import pytest
import torch

from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.text.chat_format import load_chat_format

FAMILY = "deepseek_v3"
MODEL = "tiny"
WAIT_S = 120
LOGPROB_TOL = 2e-4  # the oracle's logits agree within 1e-4 (test_against_oracle); log_softmax adds its normaliser's
PROMPT = list(range(2, 23))  # 21 ids: longer than the fixture's index_topk, so DSA selects
HELLO = [{"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory, live_server):
    options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp("logprobs-kv"), model_id=MODEL)
    return live_server(load_runtime(tiny_checkpoints[FAMILY], options), slots=2)


@pytest.fixture(scope="module")
def strict(tiny_checkpoints, tmp_path_factory, live_server):
    options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp("strict-kv"), model_id=MODEL)
    return live_server(load_runtime(tiny_checkpoints[FAMILY], options), strict_model_name=True, aliases=["dsv3"])


@pytest.fixture(scope="module")
def oracle_logprobs(tiny_checkpoints):
    """ids -> [len(ids), vocab] log_softmax of the transformers model's logits (row p predicts ids[p + 1])."""
    model = fixtures.load_reference(tiny_checkpoints[FAMILY])
    return lambda ids: fixtures.oracle_teacher_forced(model, ids).logits.log_softmax(-1)


def engine_greedy(checkpoint, prompt: list[int], max_tokens: int) -> list[int]:
    """The ids the server generates at temperature 0, computed without it (stop token included)."""
    loaded = load_checkpoint(checkpoint)
    return generate(
        loaded.model, prompt, max_tokens, loaded.experts, stop_ids=load_chat_format(checkpoint).stop_ids
    ).ids


def openai_client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=WAIT_S)


def post(served, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=WAIT_S)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def sse_chunks(served, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=WAIT_S)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"content-type": "application/json"})
    raw = conn.getresponse().read().decode()
    lines = [line.removeprefix("data: ") for line in raw.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ------------------------------------------------------------------------------------ model names
def test_any_model_name_is_served_and_the_response_names_the_served_model(served):
    client = openai_client(served)
    chat = client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=3, temperature=0)
    done = client.completions.create(model="claude-haiku", prompt=PROMPT, max_tokens=3, temperature=0)
    own = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    messages = anthropic.Anthropic(base_url=served.base, api_key="x", max_retries=0, timeout=WAIT_S)
    message = messages.messages.create(model="claude-sonnet-4-5", max_tokens=3, messages=HELLO)
    assert chat.model == done.model == message.model == MODEL
    assert done.choices[0].text == own.choices[0].text
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_strict_model_name_serves_the_id_and_aliases_only(strict):
    client = openai_client(strict)
    assert [m.id for m in client.models.list().data] == [MODEL, "dsv3"]
    assert client.completions.create(model="dsv3", prompt=PROMPT, max_tokens=2).model == MODEL
    with pytest.raises(openai.NotFoundError, match="'tiny' or 'dsv3'"):
        client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2)
    status, body = post(strict, "/v1/messages", {"model": "claude-x", "max_tokens": 2, "messages": HELLO})
    assert status == 404 and body["error"]["type"] == "not_found_error" and "claude-x" in body["error"]["message"]


# ------------------------------------------------------------------------------------ logprobs
def test_completion_logprobs_are_the_models_and_leave_the_tokens_unchanged(served, tiny_checkpoints, oracle_logprobs):
    greedy = engine_greedy(tiny_checkpoints[FAMILY], PROMPT, 6)
    client = openai_client(served)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    assert scored.choices[0].text == plain.choices[0].text
    logprobs = scored.choices[0].logprobs
    reference = oracle_logprobs(PROMPT + greedy)[len(PROMPT) - 1 : -1]  # [len(greedy), vocab]
    texts = served.server.runtime.tokenizer
    assert logprobs.tokens == [texts.decode([t], skip_special_tokens=False) for t in greedy]
    expected = reference.gather(1, torch.tensor(greedy)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs.token_logprobs), expected, atol=LOGPROB_TOL)
    for top, row, token in zip(logprobs.top_logprobs, reference, greedy, strict=True):

        def text(i: int) -> str:
            return texts.decode([i], skip_special_tokens=False)

        best = row.topk(3)
        named = {text(i): v for i, v in zip(best.indices.tolist(), best.values, strict=True)}
        named.setdefault(text(token), row[token])
        assert top.keys() == named.keys() and all(abs(top[k] - named[k]) <= LOGPROB_TOL for k in top)
    pieces = logprobs.tokens
    assert logprobs.text_offset == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]


def test_chat_logprobs_in_json_and_in_the_stream(served, tiny_checkpoints, oracle_logprobs):
    runtime = served.server.runtime
    prompt = runtime.encode_chat(HELLO)
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=5, temperature=0)
    plain = openai_client(served).chat.completions.create(**kwargs)
    whole = openai_client(served).chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    assert whole.choices[0].message.content == plain.choices[0].message.content
    content = whole.choices[0].logprobs.content
    greedy = engine_greedy(tiny_checkpoints[FAMILY], prompt, 5)
    assert [e.token for e in content] == [runtime.tokenizer.decode([t], skip_special_tokens=False) for t in greedy]
    reference = oracle_logprobs(prompt + greedy)[len(prompt) - 1 : -1]
    for entry, row, token in zip(content, reference, greedy, strict=True):
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(row[token].item(), abs=LOGPROB_TOL)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=LOGPROB_TOL)
    streamed = sse_chunks(served, "/v1/chat/completions", {**kwargs, "logprobs": True, "top_logprobs": 2})
    entries = [e for c in streamed if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert entries == [e.model_dump() for e in content]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed) == plain.choices[0].message.content


def test_echo_returns_the_prompt_text_exactly(served):
    prompt = "def area(r):\n    return 3.14159 * r ** 2  # héllo\n"
    client = openai_client(served)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    chunks = sse_chunks(
        served, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4, "echo": True, "temperature": 0}
    )
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed.choices[0].text


def test_echo_with_logprobs_scores_every_prompt_token(served, oracle_logprobs):
    """What lm-evaluation-harness's local-completions model sends: token ids, echo, logprobs, max_tokens 0 or 1,
    several prompts in one request."""
    second = PROMPT[::-1]
    body = {"model": MODEL, "prompt": [PROMPT, second], "echo": True, "logprobs": 1, "temperature": 0}
    status, scored = post(served, "/v1/completions", {**body, "max_tokens": 0})
    assert status == 200 and [c["index"] for c in scored["choices"]] == [0, 1]
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == 2 * len(PROMPT)
    for choice, ids in zip(scored["choices"], [PROMPT, second], strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
        assert logprobs["top_logprobs"][0] is None and choice["finish_reason"] == "length"
        expected = oracle_logprobs(ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs["token_logprobs"][1:]), expected, atol=LOGPROB_TOL)
    status, one_more = post(served, "/v1/completions", {**body, "prompt": [PROMPT], "max_tokens": 1})
    logprobs = one_more["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(PROMPT) + 1
    assert logprobs["token_logprobs"][:-1] == pytest.approx(scored["choices"][0]["logprobs"]["token_logprobs"])
    assert one_more["choices"][0]["text"].startswith(served.server.runtime.tokenizer.decode(PROMPT))
    chunks = sse_chunks(served, "/v1/completions", {**body, "prompt": PROMPT, "max_tokens": 3})
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert streamed[0]["token_logprobs"] == pytest.approx(scored["choices"][0]["logprobs"]["token_logprobs"])
    assert sum(len(piece["tokens"]) for piece in streamed) == len(PROMPT) + 3


def test_a_scored_prompt_is_computed_whole_even_when_its_prefix_is_cached(served, oracle_logprobs):
    """The shared prefix cache holds this prompt's blocks after the first requests; a request for the
    prompt's logprobs must not start from them (those positions would have no logits)."""
    long = [2 + (i * 7) % 300 for i in range(150)]  # more than two 64-token blocks
    client = openai_client(served)
    client.completions.create(model=MODEL, prompt=long, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=long, max_tokens=1, temperature=0)
    assert again.model_extra["colibri"]["reused_tokens"] >= 128  # the cache is there to be refused
    body = {"model": MODEL, "prompt": long, "echo": True, "logprobs": 0, "max_tokens": 0}
    status, scored = post(served, "/v1/completions", body)
    assert status == 200 and scored["colibri"]["reused_tokens"] == 0
    expected = oracle_logprobs(long)[:-1].gather(1, torch.tensor(long[1:])[:, None])[:, 0]
    got = scored["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None and torch.allclose(torch.tensor(got[1:]), expected, atol=LOGPROB_TOL)


# ------------------------------------------------------------------------------------ usage
def test_a_sessions_second_turn_reports_its_reused_tokens_as_cached(served):
    client = openai_client(served)
    session = {"X-Colibri-Session": "usage-s1"}
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_headers=session)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_headers=session)
    reused = again.model_extra["colibri"]["reused_tokens"]
    assert reused > 0 and again.usage.prompt_tokens_details.cached_tokens == reused
    body = {"model": MODEL, "max_tokens": 2, "messages": HELLO}
    post(served, "/v1/messages", body, {"X-Colibri-Session": "usage-s2"})
    _, message = post(served, "/v1/messages", body, {"X-Colibri-Session": "usage-s2"})
    usage, reused = message["usage"], message["colibri"]["reused_tokens"]
    assert reused > 0 and usage["cache_read_input_tokens"] == reused
    assert usage["input_tokens"] + reused == len(served.server.runtime.encode_chat(HELLO))


# ------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"echo": True, "logprobs": 1, "session": "s"}, "X-Colibri-Session"),
        ("/v1/completions", {"prompt": ["a", "b"], "stream": True}, "prompt"),
        ("/v1/completions", {"prompt": [[2, 3], []]}, "prompt"),
        ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logit_bias": {"5": 1}}, "logit_bias"),
        ("/v1/messages", {"mcp_servers": [{"type": "url"}]}, "mcp_servers"),
        ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_what_is_not_implemented_is_a_400_naming_the_field(served, path, extra, param):
    base = {"model": MODEL, "max_tokens": 2}
    base |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": HELLO}
    extra = dict(extra)
    session = extra.pop("session", None)
    status, body = post(served, path, {**base, **extra}, {"X-Colibri-Session": session} if session else None)
    assert status == 400, body
    error = body["error"]
    assert error.get("param", param) == param and param in error["message"]
