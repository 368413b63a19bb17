"""Tool calls, per model family: which format a chat template speaks, and the model's tool-call text
parsed back into calls (also while it streams).

Each family writes its calls between markers (often special tokens, which text.IncrementalDecoder keeps
for this reason, see ``TOOL_MARKERS``):

* deepseek_v3 (V3, R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``
  newline, a json code fence holding ARGS, ``<｜tool▁call▁end｜>`` ... ``<｜tool▁calls▁end｜>``
* deepseek_v31 (V3.1, V3.2-Exp): the same section, each call
  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``
* glm (GLM-4.5 .. 5): ``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs,
  ``</tool_call>``; a value is JSON unless the tool's schema says the parameter is a string
* kimi_k2: ``<|tool_calls_section_begin|>``, each call ``<|tool_call_begin|>functions.NAME:IDX``
  ``<|tool_call_argument_begin|>ARGS<|tool_call_end|>``, ``<|tool_calls_section_end|>``
* deepseek_v32, deepseek_v4 (DSML, ``｜DSML｜`` is one token): ``<｜DSML｜function_calls>`` (V3.2) or
  ``<｜DSML｜tool_calls>`` (V4), each call ``<｜DSML｜invoke name="NAME">`` holding
  ``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`` lines, ``</｜DSML｜invoke>``; a value
  is taken as written when string="true", else as JSON (as GLM's, when it parses); text/dsml.py renders
  these models' conversations

A call is accepted only when it names an offered tool and its arguments are a JSON object; anything
else (bad JSON, an unknown name, a section never closed) is handed back as plain text, markers included,
so a confused model costs the client some odd text, never an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from colibri_stream.text import bounded_json


class ToolCallError(ValueError):
    """A tool-call section that does not parse (the caller turns it back into text)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str | None = None  # the model's own id (Kimi's functions.NAME:IDX); None: the API assigns one

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


class TemplateArguments(dict[str, Any]):
    """A call's arguments as chat templates want them: a mapping (GLM and DeepSeek-V3.2 iterate its
    items, Kimi writes it ``| tojson``) that also behaves as its JSON text where a template concatenates
    it as a string (DeepSeek-V3/V3.1: ``'<｜tool▁sep｜>' + arguments``)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other: Any) -> str:
        if isinstance(other, str):
            return str(self) + other
        return NotImplemented

    def __radd__(self, other: Any) -> str:
        if isinstance(other, str):
            return other + str(self)
        return NotImplemented


# ---------------------------------------------------------------------------------------- formats
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
GLM_CALL_BEGIN, GLM_CALL_END = "<tool_call>", "</tool_call>"
GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
DSML = "｜DSML｜"  # one token in DeepSeek-V3.2/V4's vocabularies
DSML_V32_BLOCK, DSML_V4_BLOCK = "function_calls", "tool_calls"  # the section's tag name per version
DSML_INVOKE, DSML_INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
DSML_PARAMETER, DSML_PARAMETER_END = f"<{DSML}parameter", f"</{DSML}parameter>"

# Every marker of every family: the special tokens the incremental decoder must not drop.
TOOL_MARKERS = frozenset(
    [DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP]
    + [GLM_CALL_BEGIN, GLM_CALL_END, GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END]
    + [KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_ARGS, KIMI_CALL_END]
    + [DSML]
)


@dataclass(frozen=True)
class Tools:
    """The tools offered to one request, by name: name -> its JSON-schema ``parameters`` ({} if none)."""

    schemas: dict[str, dict[str, Any]]

    def parameter_is_string(self, tool: str, parameter: str) -> bool:
        properties = self.schemas.get(tool, {}).get("properties")
        spec = properties.get(parameter) if isinstance(properties, dict) else None
        return isinstance(spec, dict) and spec.get("type") == "string"


@dataclass
class Steps:
    """The characters a parser has looked at, all its scans together (a marker search counts the text it
    passed over): the number tests bound to show parsing is linear in the text."""

    count: int = 0


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call text: a section opens with ``begin``, closes with ``end`` and holds calls."""

    family: str
    begin: str
    end: str
    parse_section: Callable[[str, Tools, Steps], list[ToolCall]]


# Every scan below moves forward through the text (str.find from a position, one anchored match): no
# regular expression that can backtrack, no slice of "the rest" per call, no recursion, so a section of
# n characters costs O(n) however its markers are arranged.
_SPACE = re.compile(r"\s*")


def _find(text: str, marker: str, start: int, steps: Steps) -> int:
    at = text.find(marker, start)
    steps.count += (at + len(marker) if at >= 0 else len(text)) - start
    return at


def _skip_space(text: str, start: int, steps: Steps) -> int:
    end = _SPACE.match(text, start)
    at = end.end() if end is not None else start
    steps.count += at - start + 1
    return at


def _json_object(text: str, where: str, steps: Steps) -> dict[str, Any]:
    steps.count += len(text)  # the depth scan, then the decoder: each linear
    text = text.strip()
    if not text:
        return {}
    try:
        value = bounded_json.loads(text)
    except bounded_json.TooDeep:
        raise ToolCallError(f"{where}: arguments nested too deeply") from None
    except ValueError:
        raise ToolCallError(f"{where}: arguments are not JSON") from None
    if not isinstance(value, dict):
        raise ToolCallError(f"{where}: arguments are not a JSON object")
    return value


def _between(section: str, begin: str, end: str, steps: Steps, empty_ok: bool = False) -> list[str]:
    """The bodies of ``begin``...``end`` pairs; only whitespace may lie around and between them."""
    bodies, at = [], _skip_space(section, 0, steps)
    while at < len(section):
        body, end_at = _pair(section, at, begin, end, steps)
        bodies.append(body)
        at = _skip_space(section, end_at, steps)
    if not bodies and not empty_ok:
        raise ToolCallError("an empty tool-call section")
    return bodies


def _known(name: str, tools: Tools) -> str:
    if name not in tools.schemas:
        raise ToolCallError(f"unknown tool {name!r}")
    return name


_WORD = re.compile(r"\w+")
_FENCE = "\n```"


def _parse_deepseek_v3(section: str, tools: Tools, steps: Steps) -> list[ToolCall]:
    """Each call: TYPE<｜tool▁sep｜>NAME, a newline, then ```json, a newline, ARGS, a closing ```."""
    calls = []
    for body in _between(section, DS_CALL_BEGIN, DS_CALL_END, steps):
        steps.count += len(body)  # partition, rstrip
        kind, sep, rest = body.partition(DS_SEP)
        rest = rest.rstrip()
        fence = _find(rest, _FENCE, 0, steps)
        if not sep or not _WORD.fullmatch(kind.lstrip()) or fence <= 0 or not rest.endswith("```"):
            raise ToolCallError("expected TYPE<｜tool▁sep｜>NAME and a json code block")
        name = _known(rest[:fence].strip(), tools)
        at = fence + len(_FENCE)
        at += 4 if rest.startswith("json", at) else 0
        opened = _skip_space(rest, at, steps)
        if "\n" not in rest[at:opened] or opened > len(rest) - 3:  # the fence's line ends; the code follows
            raise ToolCallError(f"{name}: expected a json code block")
        calls.append(ToolCall(name, _json_object(rest[opened:-3], name, steps)))
    return calls


def _parse_deepseek_v31(section: str, tools: Tools, steps: Steps) -> list[ToolCall]:
    calls = []
    for body in _between(section, DS_CALL_BEGIN, DS_CALL_END, steps):
        sep = _find(body, DS_SEP, 0, steps)
        if sep < 0:
            raise ToolCallError("expected NAME<｜tool▁sep｜>ARGUMENTS")
        name = _known(body[:sep].strip(), tools)
        calls.append(ToolCall(name, _json_object(body[sep + len(DS_SEP) :], name, steps)))
    return calls


def _typed_value(text: str, string_typed: bool, steps: Steps) -> Any:
    """A parameter declared a string is taken as written; others are JSON when they parse (the template
    writes non-strings ``| tojson``), else the text itself (a model that forgot a string's flag; JSON nested
    too deeply to decode safely is that text too)."""
    if string_typed:
        return text
    steps.count += len(text)
    try:
        return bounded_json.loads(text)
    except ValueError:
        return text


def _pair(section: str, at: int, begin: str, end: str, steps: Steps) -> tuple[str, int]:
    """The text of the ``begin``...``end`` pair at ``at`` (after whitespace) and where it ends."""
    at = _skip_space(section, at, steps)
    steps.count += len(begin)
    if not section.startswith(begin, at):
        raise ToolCallError(f"expected {begin}")
    close = _find(section, end, at + len(begin), steps)
    if close < 0:
        raise ToolCallError(f"{begin} without {end}")
    return section[at + len(begin) : close], close + len(end)


def _parse_glm(section: str, tools: Tools, steps: Steps) -> list[ToolCall]:
    """NAME, then <arg_key>K</arg_key> <arg_value>V</arg_value> pairs with only whitespace around them."""
    first = _find(section, GLM_KEY, 0, steps)
    first = len(section) if first < 0 else first
    name = _known(section[:first].strip(), tools)
    arguments, at = {}, _skip_space(section, first, steps)
    while at < len(section):
        key, at = _pair(section, at, GLM_KEY, GLM_KEY_END, steps)
        value, at = _pair(section, at, GLM_VALUE, GLM_VALUE_END, steps)
        key = key.strip()
        arguments[key] = _typed_value(value, tools.parameter_is_string(name, key), steps)
        at = _skip_space(section, at, steps)
    return [ToolCall(name, arguments)]


def _parse_kimi(section: str, tools: Tools, steps: Steps) -> list[ToolCall]:
    calls = []
    for body in _between(section, KIMI_CALL_BEGIN, KIMI_CALL_END, steps):
        sep = _find(body, KIMI_ARGS, 0, steps)
        call_id = body[:sep].strip() if sep >= 0 else ""
        if not call_id:
            raise ToolCallError("expected functions.NAME:IDX<|tool_call_argument_begin|>ARGUMENTS")
        name = _known(call_id.removeprefix("functions.").rsplit(":", 1)[0], tools)
        calls.append(ToolCall(name, _json_object(body[sep + len(KIMI_ARGS) :], name, steps), id=call_id))
    return calls


# after <｜DSML｜invoke / <｜DSML｜parameter: the attributes (DSML writes names unescaped, so no quote in them);
# anchored, and no two of their repeats can match the same characters, so a match is one pass
_DSML_INVOKE_HEAD = re.compile(r'\s+name="([^"]*)"\s*>')
_DSML_PARAMETER_HEAD = re.compile(r'\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>')


def _parse_dsml(section: str, tools: Tools, steps: Steps) -> list[ToolCall]:
    calls = []
    for body in _between(section, DSML_INVOKE, DSML_INVOKE_END, steps):
        steps.count += len(body)  # the head's match
        head = _DSML_INVOKE_HEAD.match(body)
        if head is None:
            raise ToolCallError(f'expected {DSML_INVOKE} name="NAME">')
        name = _known(head.group(1), tools)
        arguments: dict[str, Any] = {}
        for parameter in _between(body[head.end() :], DSML_PARAMETER, DSML_PARAMETER_END, steps, empty_ok=True):
            steps.count += len(parameter)
            match = _DSML_PARAMETER_HEAD.match(parameter)
            if match is None:
                raise ToolCallError(f'{name}: expected {DSML_PARAMETER} name="KEY" string="true|false">')
            key, string = match.group(1), match.group(2)
            if key in arguments:
                raise ToolCallError(f"{name}: parameter {key!r} given twice")
            # no string flag (a model's slip): the tool's schema says whether the value is a string
            string_typed = string == "true" if string else tools.parameter_is_string(name, key)
            arguments[key] = _typed_value(parameter[match.end() :], string_typed, steps)
        calls.append(ToolCall(name, arguments))
    return calls


def _dsml_format(family: str, block: str) -> ToolFormat:
    return ToolFormat(family, f"<{DSML}{block}>", f"</{DSML}{block}>", _parse_dsml)


FORMATS = {
    "deepseek_v3": ToolFormat("deepseek_v3", DS_CALLS_BEGIN, DS_CALLS_END, _parse_deepseek_v3),
    "deepseek_v31": ToolFormat("deepseek_v31", DS_CALLS_BEGIN, DS_CALLS_END, _parse_deepseek_v31),
    "glm": ToolFormat("glm", GLM_CALL_BEGIN, GLM_CALL_END, _parse_glm),
    "kimi_k2": ToolFormat("kimi_k2", KIMI_SECTION_BEGIN, KIMI_SECTION_END, _parse_kimi),
    "deepseek_v32": _dsml_format("deepseek_v32", DSML_V32_BLOCK),
    "deepseek_v4": _dsml_format("deepseek_v4", DSML_V4_BLOCK),
}


def tool_format_for(template: str) -> ToolFormat | None:
    """The tool format a chat template renders (its own markers say which), None when it has none.
    DeepSeek-V3.2/V4 ship no template (text/dsml.py encodes them); a DSML template someone wrote for
    them is recognised by its token, the section's tag name telling the version."""
    if DSML in template:
        return FORMATS["deepseek_v32" if DSML_V32_BLOCK in template else "deepseek_v4"]
    if KIMI_CALL_BEGIN in template or "tool_declare" in template:
        return FORMATS["kimi_k2"]
    if GLM_CALL_BEGIN in template and GLM_KEY in template:
        return FORMATS["glm"]
    if DS_CALL_BEGIN in template:
        return FORMATS["deepseek_v3" if "```json" in template else "deepseek_v31"]
    return None


# ---------------------------------------------------------------------------------------- parsing
Event = tuple[str, Any]  # ("text", str) or ("tool_call", ToolCall)


@dataclass
class ToolCallParser:
    """Model text in (as deltas), events out: ("text", str) and ("tool_call", ToolCall), in order.

    Text that could be the start of the section marker is held back until it cannot; a section is held
    until it closes, then becomes its calls (or, when it does not parse, its text, with every character the
    model wrote). Whitespace-only text before a call (the newlines between GLM's calls, the blank line before
    a DSML section) or after an answer's last call is dropped, so it makes no empty text blocks.

    Linear in the text: each delta is searched once (a marker cut between deltas is found in the held
    marker-sized tail), a section is kept as its deltas and joined once when it closes, and ``steps`` counts
    the characters looked at."""

    format: ToolFormat
    tools: Tools
    in_section: bool = False
    calls: list[ToolCall] = field(default_factory=list)
    steps: Steps = field(default_factory=Steps)
    _partial: str = ""  # outside a section: text that may start the begin marker
    _section: list[str] = field(default_factory=list)  # inside: the section's text so far, as pushed
    _tail: str = ""  # inside: the section's last len(end) - 1 characters (where a cut end marker starts)
    _space: list[str] = field(default_factory=list)  # whitespace-only text held until real text follows

    def push(self, delta: str) -> list[Event]:
        events: list[Event] = []
        text, at, self._partial = self._partial + delta, 0, ""
        while at < len(text):
            at = self._in_section(text, at, events) if self.in_section else self._outside(text, at, events)
        return events

    def finish(self) -> list[Event]:
        """What is left; a section never closed is text, markers included."""
        if self.in_section:
            events, self.in_section = self._text(self.format.begin + "".join(self._section)), False
        else:
            events = self._text(self._partial)
        self._partial, self._section, self._tail = "", [], ""
        if self._space and not self.calls:
            events.append(("text", "".join(self._space)))
        self._space = []
        return events

    def _outside(self, text: str, at: int, events: list[Event]) -> int:
        """Text from ``at`` up to the next begin marker; returns where the section's text starts."""
        begin = _find(text, self.format.begin, at, self.steps)
        if begin < 0:
            keep = min(_partial_suffix(text, self.format.begin), len(text) - at)
            events += self._text(text[at : len(text) - keep])
            self._partial = text[len(text) - keep :]
            return len(text)
        events += self._text(text[at:begin])  # whitespace before it waits in self._space
        self.in_section, self._section, self._tail = True, [], ""
        return begin + len(self.format.begin)

    def _in_section(self, text: str, at: int, events: list[Event]) -> int:
        """The section's text from ``at``: held, or (once its end marker shows) parsed; returns where the
        text after the section starts."""
        end, size = self.format.end, len(self.format.end)
        joint = self._tail + text[at : at + size - 1]  # an end marker begun in the held text
        cut = _find(joint, end, 0, self.steps) if self._tail else -1
        if cut >= 0:
            held = "".join(self._section)
            section, after = held[: len(held) - len(self._tail) + cut], at + cut + size - len(self._tail)
        else:
            close = _find(text, end, at, self.steps)
            if close < 0:
                piece = text[at:]
                self._section.append(piece)
                self._tail = (self._tail + piece[-(size - 1) :])[-(size - 1) :] if size > 1 else ""
                return len(text)
            section, after = "".join(self._section) + text[at:close], close + size
        self.in_section, self._section, self._tail = False, [], ""
        events += self._parsed(section)
        return after

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        self.steps.count += len(text)
        if not text.strip():
            self._space.append(text)
            return []
        stripped = text.rstrip()
        out = "".join(self._space) + stripped
        self._space = [text[len(stripped) :]] if len(stripped) < len(text) else []
        return [("text", out)]

    def _parsed(self, section: str) -> list[Event]:
        try:
            calls = self.format.parse_section(section, self.tools, self.steps)
        except ToolCallError:
            return self._text(self.format.begin + section + self.format.end)
        self.calls += calls
        self._space = []  # whitespace before a call is dropped
        return [("tool_call", call) for call in calls]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def parse_tool_calls(text: str, format: ToolFormat, tools: Tools) -> tuple[str, list[ToolCall]]:
    """A whole answer: its text (without the calls) and its calls."""
    parser = ToolCallParser(format, tools)
    events = parser.push(text) + parser.finish()
    content = "".join(value for kind, value in events if kind == "text")
    return content, [value for kind, value in events if kind == "tool_call"]


def tools_from_functions(functions: Sequence[dict[str, Any]]) -> Tools:
    """Tools from OpenAI function definitions ({name, description, parameters})."""
    return Tools({f["name"]: f.get("parameters") or {} for f in functions})
