"""JSON-schema grammars for constrained decoding, on llguidance (chosen by measurement against xgrammar:
tools/bench_grammar.py, docs/benchmarks.md "Constrained decoding").

``json_constraint(tokenizer, vocab_size, stop_ids, schema)`` is a ``TokenConstraint``
(runtime/constraint.py) whose answers are JSON valid against ``schema``, written as ``json.dumps`` writes
it (", " and ": ", no other whitespace: a model cannot spin in whitespace until max_tokens). The library's
view of a tokenizer (every token's bytes, the slicing it precomputes: ~1 s for a 129k vocabulary) is
built once per tokenizer and kept. A schema the library cannot enforce (a keyword it does not implement,
such as ``uniqueItems`` or ``not``, a dangling ``$ref``, an unsatisfiable range) is a ``GrammarError``
saying why: never a grammar that would let through what the schema forbids.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
import torch
from tokenizers import Tokenizer

from colibri_stream.errors import RequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KEPT_VOCABS = 4  # tokenizers whose library view is kept (a server has one)


class GrammarError(RequestError):
    """A schema that cannot be turned into a grammar; the message says why."""


class GrammarConstraint:
    """A TokenConstraint over an llguidance matcher: the mask is the matcher's bitmask, unpacked."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int, stop_ids: Sequence[int]):
        self.matcher = matcher
        self.words = np.zeros(words, dtype=np.int32)  # bit i of the mask: id i allowed
        self.stop_ids = list(stop_ids)

    def allowed(self, vocab_size: int) -> torch.Tensor:
        if not self.matcher.is_error():
            self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        # one pass, viewed as bool without a copy (~10 us for 129k ids; slicing and astype took ~1.3 ms)
        bits = np.unpackbits(self.words.view(np.uint8), count=vocab_size, bitorder="little").view(np.bool_)
        if self.matcher.is_error() or not bits.any():  # a dead end (cannot happen while masked): end the answer
            bits[:] = False
            bits[[i for i in self.stop_ids if i < vocab_size]] = True
        return torch.from_numpy(bits)

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)  # a refused token leaves the matcher in error: only stops follow

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_stopped())


_vocabs: dict[tuple[int, int, tuple[int, ...]], tuple[Tokenizer, llguidance.LLTokenizer]] = {}
_vocabs_lock = threading.Lock()


def library_vocab(tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The library's view of ``tokenizer`` for a model scoring ``vocab_size`` ids that ends on
    ``stop_ids``; built once (the tokenizer is kept with it, so its id names it while cached)."""
    if not stop_ids:
        raise GrammarError("this model has no stop token, so a constrained answer could not end")
    key = (id(tokenizer), vocab_size, tuple(stop_ids))
    with _vocabs_lock:
        if key in _vocabs:
            return _vocabs[key][1]
    n_vocab = max(vocab_size, tokenizer.get_vocab_size())
    built = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=n_vocab, eos_token=list(stop_ids))
    with _vocabs_lock:
        if len(_vocabs) >= KEPT_VOCABS:
            del _vocabs[next(iter(_vocabs))]
        _vocabs[key] = (tokenizer, built)
    return built


def json_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON valid against ``schema``, checked; GrammarError naming what the library refuses."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"not a usable JSON schema: {exc}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError("; ".join(messages))
    return grammar


def json_constraint(
    tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int], schema: dict[str, Any]
) -> GrammarConstraint:
    """A fresh constraint (one per generation) whose answers are JSON valid against ``schema``."""
    vocab = library_vocab(tokenizer, vocab_size, stop_ids)
    matcher = llguidance.LLMatcher(vocab, json_grammar(schema), log_level=0)
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    return GrammarConstraint(matcher, (max(vocab_size, vocab.vocab_size) + 31) // 32, stop_ids)
