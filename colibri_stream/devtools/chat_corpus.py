"""Synthetic agent conversations for the demo model's chat fine-tune, made from the stdlib's own source.

The demo learned Python from the standard library and never saw a conversation, so behind a chat template
it writes code until its output budget runs out: a Responses client (Codex) then gets ``incomplete`` and
exits 1, and a long rambling answer re-tokenises differently from the generated ids, which costs the next
request its prefix-cache reuse. This module makes conversations of the shape agents send — a long system
or developer preamble (English from docstrings, sometimes a tool list made from real function
signatures), then one to three short questions — where every answer is one sentence taken from a
docstring and ends the turn. Answer quality is not the point; ending the turn is.

Each conversation is rendered with the model's own chat template (``ChatFormat``, what ``serve`` renders)
and encoded as ``serve`` encodes it, and the training targets are the answer ids only (the text after each
``<|assistant|>\\n``, and its end-of-turn id): the model learns to answer and stop, not to write preambles.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibri_stream.text.chat_format import ChatFormat, PromptEncoder

IGNORE = -100  # cross_entropy's ignore_index: positions that are context, not answers
MAX_SUMMARY_CHARS = 160


@dataclass(frozen=True)
class Documented:
    """A function or class of the stdlib with a docstring: the material of questions and answers."""

    module: str  # e.g. "json/decoder.py"
    name: str
    args: tuple[str, ...]
    summary: str  # the docstring's first sentence
    docstring: str


@dataclass(frozen=True)
class ChatExample:
    ids: list[int]
    targets: list[int]  # same length: the next id where it is an answer's, IGNORE elsewhere


def first_sentence(docstring: str) -> str:
    paragraph = docstring.strip().split("\n\n")[0]
    text = " ".join(paragraph.split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return match.group(1) if match else text


def documented(files: Sequence[Path], root: Path) -> list[Documented]:
    """Every function and class with a docstring whose first sentence reads like one (4+ words, at most
    MAX_SUMMARY_CHARS: an answer is short)."""
    found: list[Documented] = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            docstring = ast.get_docstring(node)
            if not docstring or node.name.startswith("_"):
                continue
            summary = first_sentence(docstring)
            if len(summary.split()) < 4 or len(summary) > MAX_SUMMARY_CHARS:
                continue
            args = tuple(a.arg for a in node.args.args if a.arg != "self") if not isinstance(node, ast.ClassDef) else ()
            found.append(Documented(path.relative_to(root).as_posix(), node.name, args, summary, docstring))
    return found


QUESTIONS = (
    "What does {name} do?",
    "What does {name} in {module} do? Answer in one sentence.",
    "Explain `{name}` briefly.",
    "what is {name} for",
    "Summarize {module}'s {name} in one line.",
    "In one sentence: what does the function {name} do?",
    "Can you tell me what {name} is used for?",
    "Look at {module}. What does {name} do?",
)
FILE_QUESTIONS = (  # an agent's usual first turns, answered from the file's first documented item
    "What does {module} do? Answer in one sentence.",
    "What does {stem}.py print? Answer in one sentence.",
    "Read {module} and tell me what it is for.",
    "Now add a comment at the top of {module} that says what it does.",
)
GREETINGS = (
    ("hi", "Hello! How can I help?"),
    ("hello", "Hello! What would you like to do?"),
    ("Say hello.", "Hello."),
    ("Are you there?", "Yes, I am here."),
    ("thanks", "You're welcome."),
    ("What can you do?", "I can read code and answer short questions about it."),
)
PREAMBLE_OPENINGS = (
    "You are a coding agent running in a terminal. Answer briefly and stop.",
    "You are an interactive CLI tool that helps users with software engineering tasks.",
    "You are a helpful assistant. Keep answers short.",
    "Instructions for the assistant working in this repository:",
    "",
)


def tool_spec(item: Documented) -> dict[str, Any]:
    """A function tool in the OpenAI shape the template prints, made from a real signature."""
    properties = {arg: {"type": "string", "description": f"the {arg} argument"} for arg in item.args[:4]}
    return {
        "type": "function",
        "function": {
            "name": item.name,
            "description": item.summary,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)[:1]},
        },
    }


class ConversationMaker:
    """Random agent-shaped conversations over ``items`` (seeded: the same seed makes the same data)."""

    def __init__(self, items: Sequence[Documented], seed: int):
        self.items = list(items)
        self.rng = random.Random(seed)

    def preamble(self, target_chars: int) -> str:
        """English instructions of about ``target_chars`` characters: docstrings, one after another."""
        parts = [self.rng.choice(PREAMBLE_OPENINGS)]
        size = len(parts[0])
        while size < target_chars:
            text = self.rng.choice(self.items).docstring
            parts.append(text)
            size += len(text) + 2
        return "\n\n".join(parts).strip()

    def question(self) -> tuple[str, str]:
        roll = self.rng.random()
        if roll < 0.1:
            return self.rng.choice(GREETINGS)
        item = self.rng.choice(self.items)
        module, stem = item.module, Path(item.module).stem
        if roll < 0.35:
            return self.rng.choice(FILE_QUESTIONS).format(module=module, stem=stem), item.summary
        return self.rng.choice(QUESTIONS).format(name=item.name, module=module), item.summary

    def conversation(self, preamble_chars: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools): a preamble, then 1-3 question/answer turns, the last answer the one to learn."""
        tools = None
        if self.rng.random() < 0.5:
            count = min(len(self.items), self.rng.randint(3, 12))
            tools = [tool_spec(item) for item in self.rng.sample(self.items, count)]
        messages: list[dict[str, Any]] = []
        if preamble_chars:
            role = self.rng.choice(("system", "developer", "system"))
            messages.append({"role": role, "content": self.preamble(preamble_chars)})
        for _ in range(self.rng.randint(1, 3)):
            asked, answer = self.question()
            messages.append({"role": "user", "content": asked})
            reply: dict[str, Any] = {"role": "assistant", "content": answer}
            if self.rng.random() < 0.25:  # the thinking switch: a short thought, closed, then the answer
                reply["reasoning_content"] = f"The user asks: {asked.rstrip('?.')}. One sentence answers it."
            messages.append(reply)
        return messages, tools


def encode_conversation(
    chat: ChatFormat, encoder: PromptEncoder, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> ChatExample | None:
    """Ids of the rendered conversation and the answer targets, or None where an answer's prompt does
    not encode as a prefix of the whole (a BPE merge across the seam: such an example would teach ids
    that serve never sees)."""
    ids = encoder.encode(chat.render(messages, add_generation_prompt=False, tools=tools))
    targets = [IGNORE] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        thinking = {"enable_thinking": bool(message.get("reasoning_content"))}
        prompt = encoder.encode(chat.render(messages[:k], add_generation_prompt=True, tools=tools, options=thinking))
        upto = encoder.encode(chat.render(messages[: k + 1], add_generation_prompt=False, tools=tools))
        if ids[: len(upto)] != upto or upto[: len(prompt)] != prompt:
            return None
        for position in range(len(prompt), len(upto)):
            targets[position - 1] = upto[position]  # the id at `position` is predicted from the one before
    return ChatExample(ids, targets)
