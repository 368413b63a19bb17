"""DeepSeek-V3.2 and DeepSeek-V4 conversations as prompt text, tools and tool calls in DSML.

Neither model ships a chat template: DeepSeek publishes the encoding as Python in the checkpoint's
``encoding/`` folder, and model files are untrusted input, so colibri never runs it. This module writes the
same prompt text itself, in chat mode (the answer starts after ``</think>``; ``thinking``: the answer's header
opens ``<think>`` instead, and text/reasoning.py reads the reasoning back), from the
messages chat templates get (``ChatMessage.for_template``: content text; an assistant's ``tool_calls``
with their arguments as a mapping; a tool result's ``tool_call_id``). The model's answer is parsed back
by tool_calls.FORMATS["deepseek_v32" | "deepseek_v4"].

What the two versions share: tools are described in the system message (a system message with empty
content is put first when the conversation has none); an assistant turn is its text, then its calls as
``\\n\\n<｜DSML｜BLOCK>`` + one ``invoke`` per call + ``</｜DSML｜BLOCK>``, then the end-of-sentence token.
Where they differ:

* V3.2 (BLOCK ``function_calls``): each user turn is ``<｜User｜>TEXT<｜Assistant｜></think>``; tool results
  follow the assistant's calls as ``\\n\\n<function_results>``, one ``\\n<result>R</result>`` each,
  ``\\n</function_results>\\n\\n</think>``, and the model answers from there.
* V4 (BLOCK ``tool_calls``): tool results are part of the next user turn, ``<tool_result>R</tool_result>``
  blocks (in the order of the calls they answer) joined with user text by blank lines; a user turn is
  ``<｜User｜>...`` and the answer header ``<｜Assistant｜></think>`` follows it when the assistant speaks
  next (or is asked to).

An OpenAI ``developer`` message is a system message (what OpenAI made it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from colibri_stream.text import bounded_json
from colibri_stream.text.tool_calls import DSML, DSML_V4_BLOCK, DSML_V32_BLOCK, FORMATS, ToolFormat

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, THINK_START, THINK_END = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"

# The tools' description, word for word as each model was trained on it ({schemas}: one JSON per line).
_V32_TOOLS = f"""## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{DSML}function_calls>
...
</{DSML}function_calls>
<function_results>
...
</function_results>
{THINK_START}...thinking about results{THINK_END}
Here are the functions available in JSONSchema format:
<functions>
{{schemas}}
</functions>
"""  # noqa: E501 - the model's own text

_V4_TOOLS = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501 - the model's own text


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class _Message:
    """One message, normalised: ``calls`` as (name, arguments) pairs, ``call_id`` of a tool result."""

    role: str
    content: str
    calls: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    call_ids: tuple[str, ...] = ()  # an assistant's call ids, in its calls' order (V4 sorts results by them)
    call_id: str = ""


def _arguments(raw: Any) -> Mapping[str, Any]:
    """A call's arguments as a mapping: JSON text is decoded; anything that is no object (or is nested
    too deeply to decode safely) is one ``arguments`` parameter holding it (the prompt still shows what
    the client sent)."""
    if isinstance(raw, str):
        try:
            decoded = bounded_json.loads(raw)
        except ValueError:
            decoded = None
        return decoded if isinstance(decoded, dict) else {"arguments": raw}
    return raw if isinstance(raw, Mapping) else {"arguments": raw}


def _normalise(message: Mapping[str, Any]) -> _Message:
    role = _text(message.get("role"))
    role = "system" if role == "developer" else role
    calls, ids = [], []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        calls.append((_text(function.get("name")), _arguments(function.get("arguments"))))
        ids.append(_text(call.get("id")))
    return _Message(role, _text(message.get("content")), tuple(calls), tuple(ids), _text(message.get("tool_call_id")))


def _with_tools(messages: list[_Message], tools_text: str) -> list[_Message]:
    """The tools' description appended to the first system message (one with no content put first when
    the conversation has none)."""
    if not tools_text:
        return messages
    if messages and messages[0].role == "system":
        first, rest = messages[0], messages[1:]
    else:
        first, rest = _Message("system", ""), messages
    return [_Message("system", f"{first.content}\n\n{tools_text}"), *rest]


def _invoke(name: str, arguments: Mapping[str, Any]) -> str:
    lines = [
        f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        f"{value if isinstance(value, str) else _json(value)}</{DSML}parameter>"
        for key, value in arguments.items()
    ]
    return f'<{DSML}invoke name="{name}">\n' + "\n".join(lines) + f"\n</{DSML}invoke>"


@dataclass(frozen=True)
class DsmlEncoding:
    """How DeepSeek-V3.2 (``deepseek_v32``) or V4 (``deepseek_v4``) turns a conversation into its prompt."""

    family: str

    def __post_init__(self) -> None:
        if self.family not in ("deepseek_v32", "deepseek_v4"):
            raise ValueError(f"no DSML encoding for {self.family!r}")

    @property
    def tool_format(self) -> ToolFormat:
        return FORMATS[self.family]

    @property
    def block(self) -> str:
        return DSML_V32_BLOCK if self.family == "deepseek_v32" else DSML_V4_BLOCK

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        bos_token: str = BOS,
        eos_token: str = EOS,
        thinking: bool = False,
    ) -> list[str]:
        """The prompt's parts, in order (the caller joins them, counting their size). ``thinking``: the
        answer's header opens a think block (``<think>``) instead of closing it (earlier turns keep theirs
        closed: their reasoning is not part of the prompt)."""
        template = _V32_TOOLS if self.family == "deepseek_v32" else _V4_TOOLS
        schemas = "\n".join(_json(tool.get("function", tool)) for tool in tools or [])
        normalised = _with_tools([_normalise(m) for m in messages], template.format(schemas=schemas) if tools else "")
        render = self._render_v32 if self.family == "deepseek_v32" else self._render_v4
        parts = [bos_token, *render(normalised, add_generation_prompt, eos_token)]
        if thinking and add_generation_prompt and parts[-1].endswith(THINK_END):  # the answer's own header
            parts[-1] = parts[-1][: -len(THINK_END)] + THINK_START
        return parts

    def _assistant(self, message: _Message, eos_token: str) -> list[str]:
        parts = [message.content]
        if message.calls:
            invokes = "\n".join(_invoke(name, arguments) for name, arguments in message.calls)
            parts.append(f"\n\n<{DSML}{self.block}>\n{invokes}\n</{DSML}{self.block}>")
        return [*parts, eos_token]

    def _render_v32(self, messages: list[_Message], add_generation_prompt: bool, eos_token: str) -> list[str]:
        out: list[str] = []
        for i, message in enumerate(messages):
            before = messages[i - 1].role if i > 0 else None
            after = messages[i + 1].role if i + 1 < len(messages) else None
            answer_next = after is not None or add_generation_prompt
            if message.role == "system":
                out.append(message.content)
            elif message.role == "user":
                out += [USER, message.content] + ([ASSISTANT, THINK_END] if answer_next else [])
            elif message.role == "assistant":
                out += self._assistant(message, eos_token)
            elif message.role == "tool":
                out += ["\n\n<function_results>"] if before != "tool" else []
                out.append(f"\n<result>{message.content}</result>")
                if after != "tool":
                    out += ["\n</function_results>"] + ([f"\n\n{THINK_END}"] if answer_next else [])
        return out

    def _render_v4(self, messages: list[_Message], add_generation_prompt: bool, eos_token: str) -> list[str]:
        turns = _merge_user_turns(messages)
        out: list[str] = []
        for i, turn in enumerate(turns):
            after = turns[i + 1].role if i + 1 < len(turns) else None
            if turn.role == "system":
                out.append(turn.content)
            elif turn.role == "user":
                out += [USER, turn.content]
                if after == "assistant" or (after is None and add_generation_prompt):
                    out += [ASSISTANT, THINK_END]
            elif turn.role == "assistant":
                out += self._assistant(turn, eos_token)
        return out


def _merge_user_turns(messages: list[_Message]) -> list[_Message]:
    """V4's turns: each run of user and tool messages is one user turn, tool results in the order of the
    calls they answer."""
    turns: list[_Message] = []
    current: _UserTurn | None = None
    order: dict[str, int] = {}  # call id -> its place among the last assistant turn's calls
    for message in messages:
        if message.role in ("user", "tool"):
            if current is None:
                current = _UserTurn([])
                turns.append(_Message("user", ""))  # its place; filled in when the run ends
            current.blocks.append((message.call_id if message.role == "tool" else None, message.content))
            continue
        if current is not None:
            turns[-1], current = current.as_message(order), None
        if message.role == "assistant" and message.calls:
            order = {call_id: k for k, call_id in enumerate(message.call_ids) if call_id}
        turns.append(message)
    if current is not None:
        turns[-1] = current.as_message(order)
    return turns


@dataclass
class _UserTurn:
    """A V4 user turn being merged: (call id of a tool result, or None for text; its text) per block."""

    blocks: list[tuple[str | None, str]]

    def as_message(self, order: Mapping[str, int]) -> _Message:
        """The turn as a message whose content is its blocks joined by blank lines, the tool results among
        them sorted by call order (a result naming no call of the last assistant turn goes after those that
        do; text blocks keep their places)."""
        results = sorted((b for b in self.blocks if b[0] is not None), key=lambda b: order.get(b[0] or "", len(order)))
        ordered = iter(results)
        texts = [
            text if call_id is None else f"<tool_result>{next(ordered)[1]}</tool_result>"
            for call_id, text in self.blocks
        ]
        return _Message("user", "\n\n".join(texts))
