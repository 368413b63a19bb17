"""A thinking model's answer split into its reasoning and its content, incrementally.

Reasoning models (DeepSeek-R1/V3.1+/V3.2/V4, GLM-4.5/5, Kimi-K2-Thinking) write their reasoning first,
between think markers (``<think>`` ... ``</think>`` in every family colibri serves), then the answer.
A template that opens the block in its generation prompt (DeepSeek-V3.1+ in thinking mode) makes the
answer start inside it (``reasoning_first``; ``opens_reasoning`` tells from the prompt's text); others
let the model write the opening marker itself.

Use::

    splitter = ReasoningSplitter(reasoning_first=opens_reasoning(prompt_tail))
    for delta in text_deltas:
        reasoning, content = splitter.push(delta)   # either may be ""
    reasoning, content = splitter.finish()          # what was held back

Rules: one think block, at the start of the answer (leading whitespace before its opening marker is
dropped); whitespace right after either marker is dropped (models write ``<think>\\n`` and
``</think>\\n\\n``); a block never closed is reasoning to the end. Text that could still become a marker
is held back until the next delta decides (so a marker cut across deltas never leaks), and the split
of a text is the same however it is cut into deltas. A later ``<think>`` in the content is content.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkMarkers:
    open: str = THINK_OPEN
    close: str = THINK_CLOSE


DEFAULT_MARKERS = ThinkMarkers()
THINK_MARKERS = frozenset([THINK_OPEN, THINK_CLOSE])  # special tokens the decoder must keep in the text


def opens_reasoning(prompt_text: str, markers: ThinkMarkers = DEFAULT_MARKERS) -> bool:
    """Whether a rendered prompt (or its tail) ends by opening a think block: its answer starts in it."""
    return prompt_text.rstrip().endswith(markers.open)


def _held(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that starts ``marker`` (it may be cut there)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """Text deltas in, (reasoning delta, content delta) out; see the module docstring."""

    def __init__(self, markers: ThinkMarkers = DEFAULT_MARKERS, reasoning_first: bool = False):
        self.markers = markers
        self.state = "reasoning" if reasoning_first else "start"  # start -> reasoning -> content
        self.pending = ""  # text not yet given out: a possible marker, or whitespace to drop
        self.strip = reasoning_first  # drop whitespace at the start of the current part

    def push(self, delta: str) -> tuple[str, str]:
        self.pending += delta
        reasoning, content = [], []
        while True:
            if self.state == "start":
                if not self._decide_start():
                    break
            elif self.state == "reasoning":
                done, out = self._reasoning()
                reasoning.append(out)
                if not done:
                    break
            else:
                content.append(self._lstrip(self.pending))
                self.pending = ""
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held back: reasoning inside an unclosed block, else content."""
        rest, self.pending = self.pending, ""
        if self.state == "reasoning":
            return self._lstrip(rest), ""
        return "", (rest if self.state == "start" else self._lstrip(rest))

    def _decide_start(self) -> bool:
        """At the answer's start: True once decided (reasoning or content), False while undecided."""
        text = self.pending.lstrip()
        if text.startswith(self.markers.open):
            self.pending, self.state, self.strip = text[len(self.markers.open) :], "reasoning", True
            return True
        if self.markers.open.startswith(text):  # empty, or a cut marker: wait for more
            return False
        self.state = "content"
        return True

    def _reasoning(self) -> tuple[bool, str]:
        """(whether the block closed, the reasoning text given out now)."""
        close = self.markers.close
        at = self.pending.find(close)
        if at >= 0:
            out = self._lstrip(self.pending[:at])
            self.pending, self.state, self.strip = self.pending[at + len(close) :], "content", True
            return True, out
        keep = _held(self.pending, close)
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return False, self._lstrip(out)

    def _lstrip(self, text: str) -> str:
        """``text``, its leading whitespace dropped while the current part has shown nothing else yet."""
        if not self.strip:
            return text
        stripped = text.lstrip()
        self.strip = not stripped
        return stripped


def split_reasoning(
    text: str, reasoning_first: bool = False, markers: ThinkMarkers = DEFAULT_MARKERS
) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    splitter = ReasoningSplitter(markers, reasoning_first)
    reasoning, content = splitter.push(text)
    more_reasoning, more_content = splitter.finish()
    return reasoning + more_reasoning, content + more_content
