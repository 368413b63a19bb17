"""The server's continuous batching on the demo model (a trained GLM-5-style DSA model) at a RAM budget
where the store misses: concurrent clients of both APIs, one with a prompt longer than a prefill chunk,
are decoded together and each gets its solo answer; a session's next request continues from memory,
with the answer a restart (which reads the log) gives too."""

from __future__ import annotations

import threading
from pathlib import Path

import anthropic
import openai
import pytest

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.planning.activations import PREFILL_CHUNK_TOKENS
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.batching import ContinuousBatch
from colibri_stream.runtime.kv.sessions import Session
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime

MODEL = "demo"
WAIT_S = 300
LONG = "Explain this code:\n" + "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}" for i in range(60))
QUESTIONS = ["What is a mixture of experts?", "Write a haiku about disks.", LONG, "Count to five."]


@pytest.fixture(scope="module")
def demo_container(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("demo") / "demo.cstream"
    Converter(demo_model_dir(), dst, ConvertOptions(), progress=False).run()
    return dst


def demo_runtime(container: Path, kv_dir: Path):
    # bf16 KV records: a session continued from memory must compute what one read back from the log does
    options = RuntimeOptions(store=StoreOptions(ram="30%"), kv_dir=kv_dir, model_id=MODEL, kv_dtype="bfloat16")
    return load_runtime(container, options)


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def served(live_server, demo_container, kv_dir):
    return live_server(demo_runtime(demo_container, kv_dir), slots=4, max_queue=4)


def openai_client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def ask_openai(served, question: str, stream: bool = False, session: str | None = None) -> str:
    messages = [{"role": "user", "content": question}]
    headers = {"extra_headers": {"X-Colibri-Session": session}} if session else {}
    ask = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0, **headers)
    if not stream:
        return openai_client(served).chat.completions.create(**ask).choices[0].message.content
    chunks = openai_client(served).chat.completions.create(**ask, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def ask_anthropic(served, question: str) -> str:
    client = anthropic.Anthropic(base_url=served.base, api_key="unused", max_retries=0, timeout=WAIT_S)
    message = client.messages.create(
        model=MODEL, max_tokens=10, messages=[{"role": "user", "content": question}], extra_body={"temperature": 0}
    )
    return "".join(block.text for block in message.content if block.type == "text")


def test_concurrent_clients_are_batched_and_get_their_solo_answers(served, monkeypatch):
    runtime = served.server.runtime
    assert len(runtime.encode_chat([{"role": "user", "content": LONG}])) > PREFILL_CHUNK_TOKENS
    calls = [
        lambda q: ask_openai(served, q),
        lambda q: ask_openai(served, q, stream=True),
        lambda q: ask_openai(served, q),
        lambda q: ask_anthropic(served, q),
    ]
    solo = [call(q) for call, q in zip(calls, QUESTIONS, strict=True)]
    assert all(solo) and len(set(solo)) > 1
    rows, real_step = [], ContinuousBatch.step

    def counting_step(self):
        rows.append(len(self.active))
        return real_step(self)

    monkeypatch.setattr(ContinuousBatch, "step", counting_step)
    before = runtime.loaded.experts.snapshot()
    answers: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, calls[i](QUESTIONS[i]))) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WAIT_S)
    assert [answers.get(i) for i in range(4)] == solo
    assert max(rows) >= 2  # they really shared steps
    assert runtime.loaded.experts.snapshot().minus(before).misses > 0  # under the budget, experts streamed


def test_a_session_continues_from_memory_and_a_restart_continues_from_the_log(
    live_server, served, demo_container, kv_dir, monkeypatch
):
    first = ask_openai(served, "Tell me about tiers.", session="talk")
    follow_up = [
        {"role": "user", "content": "Tell me about tiers."},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And caches?"},
    ]
    reads, real_start = [], Session.start_turn

    def counting_start(self, *args, **kwargs):
        reads.append(self.name)
        return real_start(self, *args, **kwargs)

    monkeypatch.setattr(Session, "start_turn", counting_start)
    ask = dict(
        model=MODEL, messages=follow_up, max_tokens=10, temperature=0, extra_headers={"X-Colibri-Session": "talk"}
    )
    from_memory = openai_client(served).chat.completions.create(**ask)
    assert reads == [] and from_memory.model_extra["colibri"]["reused_tokens"] > 0

    served.stop()  # the session is closed; a new server reads it back from its log
    restarted = live_server(demo_runtime(demo_container, kv_dir), slots=2)
    from_log = openai_client(restarted).chat.completions.create(**ask)
    assert reads == ["talk"] and from_log.model_extra["colibri"]["reused_tokens"] > 0
    assert from_log.choices[0].message.content == from_memory.choices[0].message.content


def test_drafting_server_answers_concurrent_clients_as_a_plain_one(live_server, demo_container, tmp_path):
    """The demo model's MTP head drafting every step (`serve --mtp on`): concurrent requests, each drafting
    and verifying in the shared batch, get a plain server's answers."""
    from colibri_stream.runtime.mtp_governor import MTPOptions

    def runtime(mode: str, kv: str):
        options = RuntimeOptions(
            store=StoreOptions(ram="30%"), kv_dir=tmp_path / kv, model_id=MODEL, mtp=MTPOptions(mode)
        )
        return load_runtime(demo_container, options)

    plain = live_server(runtime("off", "plain"), slots=4, max_queue=4)
    drafting = live_server(runtime("on", "mtp"), slots=4, max_queue=4)
    assert drafting.server.runtime.speculation is not None and plain.server.runtime.speculation is None
    expected = [ask_openai(plain, q) for q in QUESTIONS]
    answers: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: answers.__setitem__(i, ask_openai(drafting, QUESTIONS[i])))
        for i in range(len(QUESTIONS))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WAIT_S)
    assert [answers.get(i) for i in range(len(QUESTIONS))] == expected
    assert drafting.server.runtime.speculation.governor.report()["drafted"] > 0
