"""The prefix cache per API key (#70): a key's cached prefixes are its own, so another key sending the same
preamble gets no cached tokens (OpenAI ``usage.prompt_tokens_details.cached_tokens``, Anthropic
``usage.cache_read_input_tokens``) and the same greedy tokens; ``--shared-prefix-cache`` shares them on
purpose. Raw HTTP against real servers on loopback, on the tiny fixture checkpoint."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest

from colibri_stream.runtime.kv.prefix_cache import BLOCK_TOKENS
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.auth import ApiKeys
from storage.kv.prefix_store import PrefixConfig

FAMILY = "deepseek_v3"
KEYS = ("sk-alice", "sk-bob")
WAIT_S = 120
PREAMBLE = "You are a careful assistant for the accounts team. " * 12  # several blocks of tokens
SYSTEM = "You answer questions about the warehouse stock, briefly. " * 12  # the Anthropic test's own preamble


def _serve(live_server, tiny_checkpoints, tmp_path_factory, shared: bool):
    options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp("tenants-kv"), prefix=PrefixConfig(shared=shared))
    return live_server(load_runtime(tiny_checkpoints[FAMILY], options), api_keys=ApiKeys(KEYS))


@pytest.fixture(scope="module")
def separate(live_server, tiny_checkpoints, tmp_path_factory):
    return _serve(live_server, tiny_checkpoints, tmp_path_factory, shared=False)


@pytest.fixture(scope="module")
def shared(live_server, tiny_checkpoints, tmp_path_factory):
    return _serve(live_server, tiny_checkpoints, tmp_path_factory, shared=True)


def post(served, path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=WAIT_S)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json", "authorization": f"Bearer {key}"})
    response = conn.getresponse()
    data = response.read()
    assert response.status == 200, data
    return json.loads(data)


def chat(served, key: str, question: str) -> tuple[int, int, str]:
    """(prompt tokens, cached tokens, answer) of a greedy chat request with the preamble."""
    messages = [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": question}]
    body = post(
        served, "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0}, key
    )
    usage = body["usage"]
    return (
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        body["choices"][0]["message"]["content"],
    )


def message(served, key: str, question: str) -> tuple[int, str]:
    """(cache_read_input_tokens, answer) of a greedy Anthropic request with the preamble as its system prompt."""
    body = {"model": "m", "system": SYSTEM, "max_tokens": 4, "temperature": 0}
    answer = post(served, "/v1/messages", {**body, "messages": [{"role": "user", "content": question}]}, key)
    return answer["usage"]["cache_read_input_tokens"], answer["content"][0]["text"] if answer["content"] else ""


def test_another_keys_preamble_is_never_a_cached_prefix(separate, shared):
    alice, bob = KEYS
    prompt, cached, _ = chat(separate, alice, "What is due today?")
    assert prompt > 2 * BLOCK_TOKENS and cached == 0
    _, cached, _ = chat(separate, alice, "And tomorrow?")
    assert cached >= BLOCK_TOKENS  # the key's own preamble is cached
    _, cached, bob_answer = chat(separate, bob, "And tomorrow?")
    assert cached == 0  # the same preamble, another key: nothing of alice's is found
    _, cached, _ = chat(separate, bob, "And tomorrow?")
    assert cached >= BLOCK_TOKENS  # bob's own blocks now

    # shared on purpose: bob's request starts from alice's blocks, with the same greedy tokens
    chat(shared, alice, "What is due today?")
    _, cached, shared_answer = chat(shared, bob, "And tomorrow?")
    assert cached >= BLOCK_TOKENS
    assert shared_answer == bob_answer


def test_the_anthropic_route_reports_no_cache_read_across_keys(separate, shared):
    alice, bob = KEYS
    message(separate, alice, "Summarise the ledger.")
    read, _ = message(separate, alice, "Summarise the ledger.")
    assert read >= BLOCK_TOKENS
    read, bob_answer = message(separate, bob, "Summarise the ledger.")
    assert read == 0
    message(shared, alice, "Summarise the ledger.")
    read, shared_answer = message(shared, bob, "Summarise the ledger.")
    assert read >= BLOCK_TOKENS and shared_answer == bob_answer


def test_block_files_record_a_tenant_id_never_the_key(separate):
    chat(separate, KEYS[0], "Anything new?")
    blocks = list((separate.server.runtime.kv_dir / "prefix").glob("*.kvblock"))
    assert blocks
    data = b"".join(path.read_bytes() for path in blocks)
    assert not any(key.encode() in data for key in KEYS)
    assert b'"tenant"' in data
