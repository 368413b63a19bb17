"""Prompts with a token limit (serve: the context): refused before they are encoded whole, and when
they fit, the very ids an unbounded encode gives. What the tokenizer is handed is counted, never timed."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from tokenizers import Tokenizer

from colibri_stream.text import chat_format
from colibri_stream.text.chat_format import SLICE_CHARS, PromptEncoder, PromptTooLong, load_chat_format, load_tokenizer

WORDS = ["hello", "world", "the", "ünïcode", "漢字", "1234", ",", "\n", "  ", "\t", "<b>", "x!", "café", "e\u0301"]


class HandedTo:
    """A tokenizer that records the length of every text it is asked to encode."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def encode_batch(self, texts: list[str], **kwargs: Any):
        self.calls.extend(len(t) for t in texts)
        return self.tokenizer.encode_batch(texts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def spied(tokenizer: Tokenizer) -> tuple[PromptEncoder, HandedTo]:
    encoder = PromptEncoder(tokenizer)
    assert encoder.max_token_bytes > 0 and encoder.exact_seams in (True, False)  # computed before counting
    spy = HandedTo(tokenizer)
    encoder.tokenizer = spy  # type: ignore[assignment]
    return encoder, spy


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints) -> Tokenizer:
    return load_tokenizer(tiny_checkpoints["deepseek_v3"])


def variant(tokenizer: Tokenizer, pre_tokenizer: dict | None = None, normalizer: dict | None = None) -> Tokenizer:
    spec = json.loads(tokenizer.to_str())
    spec["pre_tokenizer"] = pre_tokenizer or spec["pre_tokenizer"]
    spec["normalizer"] = normalizer
    return Tokenizer.from_str(json.dumps(spec))


# Qwen's and DeepSeek's shape: NFC, a regex Split, then byte-level without its own regex.
CL100K = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
SPLIT_BYTE_LEVEL = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": CL100K}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    ],
}
# GPT-2's own shape: a space before the text, so each slice would start a word: not cut exactly.
PREFIX_SPACE = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}


@pytest.mark.parametrize("shape", ["byte-level", "split + NFC", "prefix space"])
def test_a_long_prompt_that_fits_gets_the_ids_of_an_unbounded_encode(tiny, shape):
    tokenizer = {
        "byte-level": tiny,
        "split + NFC": variant(tiny, SPLIT_BYTE_LEVEL, {"type": "NFC"}),
        "prefix space": variant(tiny, PREFIX_SPACE),
    }[shape]
    encoder, spy = spied(tokenizer)
    assert encoder.exact_seams == (shape != "prefix space")
    text = words(80_000)
    assert len(text) > 4 * SLICE_CHARS
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    assert encoder.encode(text, limit=len(whole)) == whole
    if encoder.exact_seams:
        assert max(spy.calls) <= SLICE_CHARS  # never encoded whole
    with pytest.raises(PromptTooLong):
        encoder.encode(text, limit=len(whole) - 1)


@pytest.mark.parametrize("shape", ["byte-level", "prefix space"])
def test_a_prompt_over_the_limit_is_refused_after_a_bounded_part_was_encoded(tiny, shape):
    encoder, spy = spied(tiny if shape == "byte-level" else variant(tiny, PREFIX_SPACE))
    text = words(400_000)  # ~1.7 M characters, more tokens than characters / max_token_bytes
    limit = len(text.encode()) // encoder.max_token_bytes + 1000  # the byte bound alone cannot refuse it
    with pytest.raises(PromptTooLong) as refused:
        encoder.encode(text, limit)
    assert refused.value.at_least > limit
    assert max(spy.calls) <= SLICE_CHARS and sum(spy.calls) < len(text) // 4  # stopped early


def test_a_prompt_of_more_bytes_than_the_limit_can_cover_is_refused_unencoded(tiny, tiny_checkpoints):
    encoder, spy = spied(tiny)
    chat = load_chat_format(tiny_checkpoints["deepseek_v3"])
    huge = "a" * (4 * 2**20 - 1000)
    with pytest.raises(PromptTooLong, match="limit is 511"):
        encoder.encode(huge, 511)
    with pytest.raises(PromptTooLong, match="limit is 511"):
        encoder.encode_chat(chat, [{"role": "user", "content": huge}], limit=511)
    assert spy.calls == []


def test_the_chat_path_bounded_keeps_the_literal_special_tokens(tiny, tiny_checkpoints, monkeypatch):
    monkeypatch.setattr(chat_format, "SLICE_CHARS", 1000)  # slices even for this short conversation
    chat = load_chat_format(tiny_checkpoints["deepseek_v3"])
    encoder = PromptEncoder(tiny)
    messages = [{"role": "user", "content": words(2000) + " <eos> typed " + words(2000, seed=1)}]
    unbounded = encoder.encode_chat(chat, messages)
    assert encoder.encode_chat(chat, messages, limit=len(unbounded)) == unbounded
    assert unbounded.count(1) == 1  # the typed <eos> stayed text
