"""An agent-like trace against the real server (tools/bench_agent.py): a long shared preamble (system
prompt), several conversations of several turns, every request resending the whole conversation through
the stateless OpenAI chat API with no session id, as Claude Code, OpenCode or Aider do.

Per request it measures the time to the first streamed token at the client, and from the response's
usage the prompt tokens the server computed (prompt_tokens - cached_tokens). "New" tokens are what the
request adds to the conversation the server has seen (the model's own chat template, rendered here
exactly as the server renders it: the prompt minus its longest common prefix with an earlier request's
conversation, answer included); the prefix cache's goal is computed <= new + one block.
"""

from __future__ import annotations

import inspect
import json
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from colibri_stream.runtime.kv.prefix_cache import BLOCK_TOKENS
from colibri_stream.runtime.kv.sessions import common_prefix
from colibri_stream.runtime.turn import Runtime

# Text the preamble and messages are cut from: real prose and code, the same on every machine with this
# Python (a random string would be tokens no agent sends).
_SOURCES = ("json.decoder", "textwrap", "argparse", "pathlib", "inspect", "dataclasses")


@dataclass(frozen=True)
class TraceShape:
    preamble_tokens: int = 4096
    sessions: int = 5
    turns: int = 4
    message_tokens: int = 48  # each user message
    answer_tokens: int = 32  # max_tokens of each request


@dataclass
class RequestRecord:
    phase: str
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    new_tokens: int
    ttft_s: float
    wall_s: float

    @property
    def within_goal(self) -> bool:
        return self.computed_tokens <= self.new_tokens + BLOCK_TOKENS


def source_text() -> str:
    import importlib

    return "\n".join(inspect.getsource(importlib.import_module(name)) for name in _SOURCES)


def cut_tokens(runtime: Runtime, text: str, tokens: int, start_token: int = 0) -> str:
    """The piece of ``text`` that encodes to about ``tokens`` tokens from token ``start_token`` on."""
    tokenizer, _ = runtime.text_side()
    encoding = tokenizer.encode(text, add_special_tokens=False)
    offsets = encoding.offsets[start_token : start_token + tokens]
    return text[offsets[0][0] : offsets[-1][1]]


class AgentTrace:
    """The conversations' messages (deterministic) and the bookkeeping of what the server has seen."""

    def __init__(self, runtime: Runtime, shape: TraceShape):
        self.runtime, self.shape = runtime, shape
        text = source_text()
        self.system = cut_tokens(runtime, text, shape.preamble_tokens)
        self.messages = [
            [
                f"Task {session}.{turn}: explain this.\n"
                + cut_tokens(runtime, text, shape.message_tokens, shape.preamble_tokens + 97 * (session * 7 + turn))
                for turn in range(shape.turns + 1)  # one more: the request after a restart
            ]
            for session in range(shape.sessions)
        ]
        self.seen: list[list[int]] = []  # every conversation (prompt + answer) the server has been sent
        self.conversations = [[{"role": "system", "content": self.system}] for _ in range(shape.sessions)]

    def new_tokens(self, prompt_ids: list[int]) -> int:
        longest = max((common_prefix(prompt_ids, ids) for ids in self.seen), default=0)
        return len(prompt_ids) - longest

    def remember(self, conversation: list[dict[str, str]]) -> None:
        self.seen.append(self.runtime.encode_chat(conversation, add_generation_prompt=False))


def chat_stream(port: int, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed /v1/chat/completions request: its text, usage and client-side timings."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    start = time.perf_counter()
    first, text, usage = None, [], None
    with urllib.request.urlopen(request, timeout=7200) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
    end = time.perf_counter()
    return {"text": "".join(text), "usage": usage, "ttft_s": (first or end) - start, "wall_s": end - start}


def run_phase(port: int, model: str, trace: AgentTrace, phase: str, turns: range) -> list[RequestRecord]:
    """Turns ``turns`` of every session, interleaved as concurrent agents' requests arrive (turn by turn),
    continuing the trace's conversations (a later phase continues an earlier one's)."""
    shape, records = trace.shape, []
    for turn in turns:
        for session, conversation in enumerate(trace.conversations):
            conversation.append({"role": "user", "content": trace.messages[session][turn]})
            prompt_ids = trace.runtime.encode_chat(conversation)
            new = trace.new_tokens(prompt_ids)
            answer = chat_stream(port, model, conversation, shape.answer_tokens)
            usage = answer["usage"] or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            prompt = usage.get("prompt_tokens", len(prompt_ids))
            timings = answer["ttft_s"], answer["wall_s"]
            records.append(RequestRecord(phase, session, turn, prompt, cached, prompt - cached, new, *timings))
            conversation.append({"role": "assistant", "content": answer["text"]})
            trace.remember(conversation)
    return records


def summary(records: list[RequestRecord]) -> dict[str, Any]:
    """Per phase: median TTFT of first requests (a session's first turn) and of later ones, the
    computed/new token totals and how many requests (all but the trace's first) met the goal."""
    out: dict[str, Any] = {}
    for phase in dict.fromkeys(r.phase for r in records):
        rows = [r for r in records if r.phase == phase]
        firsts, laters = [r for r in rows if r.turn == 0], [r for r in rows if r.turn > 0]
        out[phase] = {
            "requests": len(rows),
            "ttft_first_turn_median_s": round(statistics.median(r.ttft_s for r in firsts), 3) if firsts else None,
            "ttft_later_turns_median_s": round(statistics.median(r.ttft_s for r in laters), 3) if laters else None,
            "computed_tokens": sum(r.computed_tokens for r in rows),
            "new_tokens": sum(r.new_tokens for r in rows),
            "within_goal": sum(r.within_goal for r in rows if not _first_of_trace(r)),
            "of": sum(not _first_of_trace(r) for r in rows),
        }
    return out


def _first_of_trace(record: RequestRecord) -> bool:
    """The trace's very first request: nothing before it to reuse, so no goal."""
    return record.session == 0 and record.turn == 0


def as_rows(records: list[RequestRecord]) -> list[dict[str, Any]]:
    return [asdict(r) | {"within_goal": r.within_goal} for r in records]
