"""Text in and out: the checkpoint's tokenizer.json via `tokenizers`, its chat template rendered in a
sandboxed jinja2 environment, and its stop ids. Model files are untrusted input: no Python code from
the model is imported, and the template can neither touch attributes outside the sandbox nor mutate
the conversation it renders."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from colibri_stream.errors import ChatTemplateError, TokenizerError

# Used when the model ships no chat template: one header line per message, then the answer's header.
# Plain text, so any tokenizer encodes it; documented in README "Chat templates".
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def load_tokenizer(checkpoint: str | Path) -> Tokenizer:
    path = Path(checkpoint) / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{path}: not found; pass token ids with --ids instead of --prompt")
    return Tokenizer.from_file(str(path))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: invalid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def load_chat_template(checkpoint: str | Path) -> str | None:
    """chat_template.jinja if present, else tokenizer_config.json's ``chat_template`` (a string, or a
    list of {name, template} where "default" wins); None when the model has none."""
    checkpoint = Path(checkpoint)
    jinja_file = checkpoint / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = _read_json(checkpoint / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def stop_token_ids(checkpoint: str | Path) -> tuple[int, ...]:
    """Every ``eos_token_id`` (an int or a list) from config.json and generation_config.json."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        value = _read_json(Path(checkpoint) / name).get("eos_token_id")
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and not isinstance(item, bool) and item >= 0 and item not in ids:
                ids.append(item)
    return tuple(ids)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(frozen=True)
class ChatFormat:
    """How one model turns a conversation into a prompt string, and which ids end an answer."""

    template: str
    bos_token: str = ""
    eos_token: str = ""
    stop_ids: tuple[int, ...] = ()
    is_fallback: bool = False

    @cached_property
    def _compiled(self):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            return env.from_string(self.template)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self._compiled.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template is untrusted input: any failure is the model file's
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def load_chat_format(checkpoint: str | Path) -> ChatFormat:
    checkpoint = Path(checkpoint)
    config = _read_json(checkpoint / "tokenizer_config.json")
    template = load_chat_template(checkpoint)
    return ChatFormat(
        template=template or FALLBACK_CHAT_TEMPLATE,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        stop_ids=stop_token_ids(checkpoint),
        is_fallback=template is None,
    )


class IncrementalDecoder:
    """Text of a growing id list, emitted as deltas. Byte-level tokens can split a UTF-8 character;
    a delta ending in U+FFFD is held back until the next token completes it."""

    def __init__(self, tokenizer: Tokenizer, skip_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip = set(skip_ids)
        self.ids: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        if token in self.skip:
            return ""
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return ""
        delta, self.text = full[len(self.text) :], full
        return delta

    def flush(self) -> str:
        full = self.tokenizer.decode(self.ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        return delta
