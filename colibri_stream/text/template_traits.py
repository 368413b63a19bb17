"""What a model's chat template does with thinking and with system messages, found by rendering it.

Templates differ in ways the APIs must know, and their source says it only loosely, so each trait is
read off probe renders (once per ChatFormat; a probe the template refuses counts as "no"):

* the thinking switch: the template variable that turns the model's thinking mode on and off, the one
  of THINKING_SWITCHES whose True and False render different generation prompts (DeepSeek-V3.1+:
  ``thinking``; GLM-4.5/5 and Qwen3: ``enable_thinking``; the DSML encoding of V3.2/V4: ``thinking``);
* whether the model thinks: it has a switch, or its template knows the closing think marker (R1 and
  Kimi-K2-Thinking always think);
* whether a system message after the first message is rendered where it stands (GLM, Kimi, the DSML
  encoding); where not (a template that keeps only the last one, drops or refuses it) such messages
  are merged into the leading system message (``place_system_messages``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from colibri_stream.errors import ChatTemplateError
from colibri_stream.text.chat_format import ChatFormat
from colibri_stream.text.reasoning import DEFAULT_MARKERS, ThinkMarkers

THINKING_SWITCHES = ("enable_thinking", "thinking")
_PROBE_USER, _PROBE_SYSTEM, _PROBE_LAST = "\ue010probe-user\ue011", "\ue010probe-system\ue011", "\ue010probe-last\ue011"


@dataclass(frozen=True)
class TemplateTraits:
    thinking_switch: str | None  # the template variable that turns thinking on (True) and off (False)
    thinks: bool  # the model writes its reasoning between ``markers`` (by switch, or always)
    system_in_place: bool  # a later system message is rendered where it stands
    markers: ThinkMarkers = DEFAULT_MARKERS

    def options(self, thinking: bool | None) -> dict[str, bool]:
        """The template options for a request's thinking setting (None: the template's default)."""
        if thinking is None or self.thinking_switch is None:
            return {}
        return {self.thinking_switch: thinking}


def _render(chat: ChatFormat, messages: Sequence[dict[str, Any]], options: Mapping[str, bool] | None = None) -> str:
    try:
        return chat.render(messages, True, None, options)
    except ChatTemplateError:
        return ""


def template_traits(chat: ChatFormat) -> TemplateTraits:
    """The traits of ``chat`` (see the module docstring)."""
    user = [{"role": "user", "content": _PROBE_USER}]
    switch = next(
        (name for name in THINKING_SWITCHES if _render(chat, user, {name: True}) != _render(chat, user, {name: False})),
        None,
    )
    markers = DEFAULT_MARKERS
    thinks = switch is not None or (chat.encoding is None and not chat.is_fallback and markers.close in chat.template)
    mixed = [*user, {"role": "system", "content": _PROBE_SYSTEM}, {"role": "user", "content": _PROBE_LAST}]
    rendered = _render(chat, mixed)
    in_place = _PROBE_USER in rendered and rendered.find(_PROBE_USER) < rendered.find(_PROBE_SYSTEM)
    in_place = in_place and rendered.find(_PROBE_SYSTEM) < rendered.find(_PROBE_LAST)
    return TemplateTraits(switch, thinks, in_place, markers)


def place_system_messages(messages: list[dict[str, Any]], traits: TemplateTraits) -> list[dict[str, Any]]:
    """``messages`` with every system message after the first message merged into the leading system
    message (one is put first when there is none; contents joined by a blank line), unless the template
    renders them where they stand."""
    if traits.system_in_place or not any(m["role"] == "system" for m in messages[1:]):
        return messages
    leading = messages[:1] if messages and messages[0]["role"] == "system" else []
    later = [m for m in messages[len(leading) :] if m["role"] == "system"]
    text = "\n\n".join(str(m["content"]) for m in [*leading, *later] if m["content"])
    rest = [m for m in messages[len(leading) :] if m["role"] != "system"]
    return [{"role": "system", "content": text}, *rest]
