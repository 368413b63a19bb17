"""Log-probabilities in the shapes the OpenAI APIs return them.

The values are those of the model's own distribution at each position: log_softmax of its float32
logits before temperature and top-p (runtime/sampling.py ``token_logprobs``), as OpenAI reports them;
a sampled answer's logprobs are therefore those of the model, not of the tempered distribution drawn
from. Every generated token has an entry, a stop token included (``usage.completion_tokens`` of them).
A token's text is its own decoding with special tokens written out; a byte-level token that holds part
of a UTF-8 character decodes to U+FFFD, and ``bytes`` are the UTF-8 bytes of that text.

- chat (``logprobs: true``, ``top_logprobs: N``): ``choices[].logprobs = {"content": [{token, logprob,
  bytes, top_logprobs: [{token, logprob, bytes}] x N}], "refusal": null}``;
- completions (``logprobs: N``): ``{tokens, token_logprobs, top_logprobs, text_offset}``, where each
  ``top_logprobs`` entry maps the N likeliest tokens' texts, and the chosen token's, to their logprobs;
  with ``echo`` the prompt's tokens come first, the first of them with null logprob and alternatives
  (nothing predicts it). ``text_offset`` is each token's character offset in the returned ``text``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from colibri_stream.runtime.sampling import TokenLogprob


class TokenTexts:
    """Token id -> its text (special tokens written out), decoded once per id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.known: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.known.get(token)
        if text is None:
            text = self.known[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenTexts) -> dict[str, Any]:
    return {"content": [_chat_entry(e.token, e.logprob, text, e.top) for e in entries], "refusal": None}


def _chat_entry(
    token: int, logprob: float, text: TokenTexts, top: Sequence[tuple[int, float]] | None = None
) -> dict[str, Any]:
    piece = text(token)
    entry: dict[str, Any] = {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}
    if top is not None:
        entry["top_logprobs"] = [_chat_entry(i, lp, text) for i, lp in top]
    return entry


# A legacy entry: the token, and its logprob (None for a prompt's first token: nothing predicts it).
Scored = tuple[int, TokenLogprob | None]


def scored_prompt(prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> list[Scored]:
    """The prompt's entries: its first token unscored, then one per later prompt token."""
    return [(prompt_ids[0], None), *((e.token, e) for e in logprobs)]


class CompletionLogprobs:
    """The legacy ``logprobs`` object, built in pieces (a streamed chunk's tokens at a time) with the
    running character offset into the returned text."""

    def __init__(self, text: TokenTexts, offset: int = 0):
        self.text, self.offset = text, offset

    def piece(self, entries: Sequence[Scored]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, scored in entries:
            piece = self.text(token)
            out["tokens"].append(piece)
            out["token_logprobs"].append(scored.logprob if scored is not None else None)
            out["top_logprobs"].append(self._top(scored) if scored is not None else None)
            out["text_offset"].append(self.offset)
            self.offset += len(piece)
        return out

    def _top(self, scored: TokenLogprob) -> dict[str, float]:
        top = {self.text(i): lp for i, lp in scored.top}
        top.setdefault(self.text(scored.token), scored.logprob)  # the chosen token is always listed
        return top


class ChatShape:
    """A chat stream's logprobs: the tokens' entries (chat never echoes its prompt)."""

    def __init__(self, text: TokenTexts):
        self.text = text

    def tokens(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        return chat_logprobs(entries, self.text)

    def prompt(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        raise AssertionError("chat requests never ask for their prompt's logprobs")


class CompletionShape:
    """A completion's logprobs: the echoed prompt's (``echo``: the prompt's text as returned), then its
    tokens', with offsets into the returned text."""

    def __init__(self, text: TokenTexts, prompt_ids: Sequence[int], echo: str | None):
        self.prompt_ids, self.echo = prompt_ids, echo
        self.built = CompletionLogprobs(text)

    def prompt(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        out = self.built.piece(scored_prompt(self.prompt_ids, entries))
        self.built.offset = len(self.echo or "")  # the answer's offsets count the echoed text as returned
        return out

    def tokens(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        return self.built.piece([(e.token, e) for e in entries])


def joined(first: dict[str, list[Any]], second: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Two legacy logprobs objects as one (the echoed prompt's, then the answer's)."""
    return {key: first[key] + second[key] for key in first}
