"""A request's thinking setting -> the chat template's thinking switch, and the reader of the answer.

Every API says "think" its own way (Anthropic ``thinking``, OpenAI chat ``reasoning_effort``; the
Responses API ``reasoning.effort``); they all come down to ``thinking``: True (on), False (off) or None
(the template's default), which becomes the template option of the model's switch
(text/template_traits.py). A model without a switch ignores it: one that always thinks (R1,
Kimi-K2-Thinking) still thinks, one that never does answers as it always does.

Whatever was asked, the answer of a model that thinks is read through a ReasoningSplitter
(text/reasoning.py), so its reasoning never reaches the text or the tool-call parser: the routes return
it as reasoning (or drop it, where the request did not ask for thinking).
"""

from __future__ import annotations

from typing import Literal

from tokenizers import Tokenizer

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
