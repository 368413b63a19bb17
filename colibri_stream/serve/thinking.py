"""A request's thinking setting -> the chat template's thinking switch, and the reader of the answer.

Every API says "think" its own way (Anthropic ``thinking``, OpenAI chat ``reasoning_effort``; the
Responses API ``reasoning.effort``); they all come down to ``thinking``: True (on), False (off) or None
(the template's default), which becomes the template option of the model's switch
(text/template_traits.py). A model without a switch ignores it: one that always thinks (R1,
Kimi-K2-Thinking) still thinks, one that never does answers as it always does.

Whatever was asked, the answer of a model that thinks is read through a ReasoningSplitter
(text/reasoning.py), so its reasoning never reaches the text or the tool-call parser: the routes return
it as reasoning (or drop it, where the request did not ask for thinking). ``reasoning_tokens`` counts
how many of an answer's tokens were its reasoning (the Responses API's ``reasoning_tokens``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal

from tokenizers import Tokenizer

from colibri_stream.text.chat_format import hidden_special_ids
from colibri_stream.text.reasoning import ReasoningSplitter, opens_reasoning
from colibri_stream.text.template_traits import TemplateTraits

PROMPT_TAIL_TOKENS = 8  # enough to see a think block the generation prompt opens at its very end

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
OFF_EFFORTS = ("none", "minimal")  # OpenAI's "no reasoning" levels; the others turn thinking on


def effort_thinking(effort: Effort | None) -> bool | None:
    """OpenAI ``reasoning_effort`` -> thinking: none/minimal off, low..xhigh on, absent the default."""
    if effort is None:
        return None
    return effort not in OFF_EFFORTS


def reasoning_splitter(traits: TemplateTraits, tokenizer: Tokenizer, prompt: list[int]) -> ReasoningSplitter | None:
    """The splitter for an answer to ``prompt``; None for a model that does not think. The answer starts
    in its reasoning when the prompt's last tokens open a think block."""
    if not traits.thinks:
        return None
    tail = tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return ReasoningSplitter(traits.markers, opens_reasoning(tail, traits.markers))


def reasoning_tokens(
    splitter: ReasoningSplitter | None, tokenizer: Tokenizer, ids: Sequence[int], skip_ids: Collection[int] = ()
) -> int:
    """How many of an answer's ``ids`` are its reasoning: the tokens up to and including the one that
    completes the think block's closing marker, all of them when the block never closes, 0 for an answer
    with no think block (or ``splitter`` None: a model that does not think). ``splitter`` must be a fresh
    one for the answer's prompt; ``skip_ids`` (the template's stop ids) and the hidden special tokens add
    no text, as in the streamed answer (chat_format.IncrementalDecoder). Each token is decoded alone: the
    markers are ASCII, so a character cut between two tokens cannot hide one. Stops at the marker."""
    if splitter is None:
        return 0
    skip = set(skip_ids) | hidden_special_ids(tokenizer)
    thought, start = splitter.state == "reasoning", ""  # start: the text while no block is open yet
    for count, token in enumerate(ids, start=1):
        piece = "" if token in skip else tokenizer.decode([token], skip_special_tokens=False)
        splitter.push(piece)
        if not thought:
            start += piece
            thought = start.lstrip().startswith(splitter.markers.open)
        if splitter.state == "content":
            return count if thought else 0
    return len(ids) if thought else 0
