"""Text in and out: the checkpoint's tokenizer.json via `tokenizers`, its chat template rendered in a
sandboxed jinja2 environment, and its stop ids. Model files are untrusted input: no Python code from
the model is imported, and the template can neither touch attributes outside the sandbox nor mutate
the conversation it renders, nor run away: its ranges, its loops over them, its string repetition and
its output are bounded, so a hostile template fails with ChatTemplateError instead of stalling.

Message content is text, never control: a user who types the eos token's string gets those characters
encoded as text, not the eos id (``PromptEncoder``); only the template's own special tokens are special."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from tokenizers import Encoding, Tokenizer

from colibri_stream.errors import ChatTemplateError, RequestError, TokenizerError
from colibri_stream.text.dsml import BOS as DEEPSEEK_BOS
from colibri_stream.text.dsml import EOS as DEEPSEEK_EOS
from colibri_stream.text.dsml import DsmlEncoding
from colibri_stream.text.reasoning import THINK_MARKERS
from colibri_stream.text.template_sandbox import BoundedSandbox, end_render, start_render
from colibri_stream.text.tool_calls import DSML, TOOL_MARKERS, ToolFormat, tool_format_for
from storage.errors import FormatError
from storage.files.safe_read import decode_utf8, read_bounded, read_json

# The rendered prompt's size. The tokenizer holds hundreds of bytes per token while it encodes
# (docs/benchmarks-log.md, "Figures behind the code") and aborts the process when an allocation fails, and a
# token covers at least one byte, so the prompt is capped before encoding: 4 MiB, the largest request
# body (template_sandbox bounds the work of making it).
MAX_RENDERED_BYTES = 4 * 2**20
# A prompt with a token limit (serve: the context) is never encoded whole when long: the bytes first
# (more than limit x the longest token's bytes cannot fit), then at most SLICE_CHARS per encode call,
# refused as soon as the count passes the limit. Slices are cut where the tokenizer's pre-tokenizer
# always splits (a newline before a non-space, a space between a non-space and a letter), checked on
# PROBE_TEXT when the encoder is made; elsewhere a cut is an estimate, allowed CUT_SLACK_TOKENS of error,
# and a prompt estimated to fit is then encoded whole for its exact ids.
SLICE_CHARS = 64 * 2**10
CUT_SLACK_TOKENS = 64
NORMALIZER_SLACK = 4  # a normalizer may shorten text: NFC composes up to 3 code points into one
_SEAM = re.compile(r"(?<=\n)(?=\S)|(?<=\S)(?= [^\W\d_])")
PROBE_TEXT = (
    "Hello world, this is a probe.\nSecond line:  two  spaces\n\tTabbed\n123 4567 x\n"
    "\u00dcber caf\u00e9 na\u00efve \u6f22\u5b57 \u0442\u0435\u043a\u0441\u0442\n"
    "<b>tag</b> end!\n  indented\nx?\n\u00e9."
)
# tokenizer_config.json, generation_config.json, chat_template.jinja (real ones: a few KB to a few MB)
MAX_MODEL_TEXT_BYTES = 64 * 2**20

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
    """A model's optional JSON file (tokenizer_config.json, generation_config.json): {} when absent or not
    a regular file (never opened then: a FIFO would block), a TokenizerError naming it when unreadable."""
    if not path.is_file():
        return {}
    try:
        data = read_json(path, MAX_MODEL_TEXT_BYTES, "this file")
    except FormatError as exc:  # too large, not UTF-8, not JSON, nested too deeply
        raise TokenizerError(str(exc)) from None
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
        try:
            raw = read_bounded(jinja_file, MAX_MODEL_TEXT_BYTES, "the chat template")
            return decode_utf8(raw, jinja_file, "the chat template")
        except FormatError as exc:
            raise ChatTemplateError(str(exc)) from None
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


_TEMPLATE_VARIABLES = frozenset(["messages", "add_generation_prompt", "bos_token", "eos_token", "tools"])


@dataclass(frozen=True)
class ChatFormat:
    """How one model turns a conversation into a prompt string, and which ids end an answer: its chat
    template, or (DeepSeek-V3.2/V4, which ship none) its DSML ``encoding``."""

    template: str
    bos_token: str = ""
    eos_token: str = ""
    stop_ids: tuple[int, ...] = ()
    is_fallback: bool = False
    encoding: DsmlEncoding | None = None  # set: renders instead of ``template``

    @property
    def tool_format(self) -> ToolFormat | None:
        """The tool-call format the prompt teaches (the answer is parsed with it); None: no tools."""
        if self.encoding is not None:
            return self.encoding.tool_format
        return None if self.is_fallback else tool_format_for(self.template)

    @cached_property
    def _compiled(self) -> Template:
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            return env.from_string(self.template)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        options: Mapping[str, bool] | None = None,
    ) -> str:
        """``tools``: as Hugging Face passes them, [{"type": "function", "function": {name, ...}}].
        ``options``: extra template switches (chat_template_kwargs), e.g. {"enable_thinking": True}; the
        DSML encoding reads ``thinking``."""
        options = dict(options or {})
        if self.encoding is not None:
            bos, eos, thinking = self.bos_token, self.eos_token, bool(options.get("thinking"))
            return _bounded_join(self.encoding.render(messages, add_generation_prompt, tools, bos, eos, thinking))
        budget = start_render()
        try:
            parts = self._compiled.generate(
                **{name: value for name, value in options.items() if name not in _TEMPLATE_VARIABLES},
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=list(tools) if tools else None,
            )
            return _bounded_join(parts)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template is untrusted input: any failure is the model file's
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            end_render(budget)


def _bounded_join(parts: Iterable[str]) -> str:
    """The rendered prompt, refused once over MAX_RENDERED_BYTES of UTF-8 (counted as it is made)."""
    out: list[str] = []
    size = 0
    for part in parts:
        size += len(part) if part.isascii() else len(part.encode("utf-8", "surrogatepass"))
        if size > MAX_RENDERED_BYTES:
            raise ChatTemplateError(f"chat template: output over {MAX_RENDERED_BYTES} bytes")
        out.append(part)
    return "".join(out)


def load_chat_format(checkpoint: str | Path) -> ChatFormat:
    """The model's chat template; without one, DeepSeek-V3.2/V4's DSML encoding when the checkpoint is
    one of them (dsml_family), else the fallback template."""
    checkpoint = Path(checkpoint)
    config = _read_json(checkpoint / "tokenizer_config.json")
    template = load_chat_template(checkpoint)
    family = dsml_family(checkpoint) if template is None else None
    encoding = DsmlEncoding(family) if family else None
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    return ChatFormat(
        template=template or ("" if encoding else FALLBACK_CHAT_TEMPLATE),
        bos_token=bos or (DEEPSEEK_BOS if encoding else ""),
        eos_token=eos or (DEEPSEEK_EOS if encoding else ""),
        stop_ids=stop_token_ids(checkpoint),
        is_fallback=template is None and encoding is None,
        encoding=encoding,
    )


# DeepSeek-V4's tokenizer has tokens of its own chat encoding that V3.2's has not.
_V4_ONLY_TOKEN = "<｜latest_reminder｜>"


def dsml_family(checkpoint: Path) -> str | None:
    """The DSML family of a checkpoint without a chat template (V3.2-Exp ships DeepSeek-V3.1's and keeps
    it), by what it ships, not its name: "deepseek_v32" or "deepseek_v4" when config.json's model_type says
    so; under another model_type (a derived checkpoint) when its tokenizer has the ``｜DSML｜`` token, V4
    if the tokenizer also has V4's own tokens, else V3.2; None otherwise."""
    model_type = _read_json(checkpoint / "config.json").get("model_type")
    if model_type in ("deepseek_v32", "deepseek_v4"):
        return str(model_type)
    tokens = _added_tokens(checkpoint)
    if DSML not in tokens:
        return None
    return "deepseek_v4" if _V4_ONLY_TOKEN in tokens else "deepseek_v32"


def _added_tokens(checkpoint: Path) -> set[str]:
    """The added tokens' text in tokenizer.json; none when it cannot be read (load_tokenizer reports that)."""
    try:
        added = _read_json(checkpoint / "tokenizer.json").get("added_tokens")
    except TokenizerError:
        return set()
    if not isinstance(added, list):
        return set()
    return {t["content"] for t in added if isinstance(t, dict) and isinstance(t.get("content"), str)}


def hidden_special_ids(tokenizer: Tokenizer) -> set[int]:
    """The special tokens an answer's text leaves out: all but the tool-call markers (TOOL_MARKERS),
    which the tool-call parser must see (Kimi's and GLM's markers are special tokens), and the think
    markers, which the reasoning splitter must see (text/reasoning.py)."""
    added = tokenizer.get_added_tokens_decoder()
    kept = TOOL_MARKERS | THINK_MARKERS
    return {i for i, t in added.items() if t.special and t.content not in kept}


class IncrementalDecoder:
    """Text of a growing id list, emitted as deltas. Byte-level tokens can split a UTF-8 character;
    a delta ending in U+FFFD is held back until the next token completes it. Special tokens are left
    out (``skip_ids`` too), except the tool-call and think markers."""

    def __init__(self, tokenizer: Tokenizer, skip_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip = set(skip_ids) | hidden_special_ids(tokenizer)
        self.ids: list[int] = []
        self.text = ""

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=False)

    def push(self, token: int) -> str:
        if token in self.skip:
            return ""
        self.ids.append(token)
        full = self._decode()
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return ""
        delta, self.text = full[len(self.text) :], full
        return delta

    def flush(self) -> str:
        full = self._decode()
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        return delta


# A masked special-token string in message content: SENTINEL, its index, SENTINEL_END. The sentinel
# itself is masked too, so every sentinel in a rendered prompt is one of ours.
_SENTINEL, _SENTINEL_END = "\ue000", "\ue001"
_MASKED = re.compile(f"{_SENTINEL}([0-9]+){_SENTINEL_END}")


class PromptTooLong(RequestError):
    """A prompt with more tokens than its limit, found before it was encoded whole."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"the prompt has at least {at_least} tokens; the limit is {limit}")
        self.at_least, self.limit = at_least, limit


def _utf8_bytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class PromptEncoder:
    """Text -> ids. ``encode`` lets special-token strings in the text become their ids (a raw prompt
    may spell the template out); ``encode_chat`` renders a conversation so that only the template's own
    special tokens do: each special string inside message content is swapped for a placeholder before
    rendering and encoded afterwards as plain text. Without such strings in the content the ids are
    exactly ``encode(render(messages))``. Encoding goes through ``encode_batch``, which releases the
    GIL, so a huge prompt tokenised in a worker thread does not stall the server's event loop."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.literal = Tokenizer.from_str(tokenizer.to_str())  # the same tokenizer, specials as plain text
        self.literal.encode_special_tokens = True
        specials = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content]
        self.masked = [*sorted(set(specials), key=len, reverse=True), _SENTINEL]
        self.pattern = re.compile("|".join(re.escape(s) for s in self.masked))

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """``limit``: PromptTooLong as soon as the text is known to have more tokens (never encoded whole
        when long, see SLICE_CHARS)."""
        if limit is None:
            return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return self._encode_bounded([text], [], limit)

    @cached_property
    def max_token_bytes(self) -> int:
        """An upper bound of the input bytes one token covers: its vocabulary string's UTF-8 length (a
        byte-level token's characters are 1-2 bytes each for one input byte), loosened when a normalizer
        may shorten the input."""
        longest = max((_utf8_bytes(s) for s in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
        return max(1, longest) * (NORMALIZER_SLACK if self.tokenizer.normalizer is not None else 1)

    @cached_property
    def exact_seams(self) -> bool:
        """Whether text encodes to the same ids cut at _SEAM positions: tried at each one in PROBE_TEXT
        (a Metaspace or prefix-space tokenizer fails: each slice would start a word), and no added token
        may span a seam."""
        added = (t.content for t in self.tokenizer.get_added_tokens_decoder().values())
        if any(re.search(r"\n\S|\S ", content) for content in added):
            return False
        whole = self.encode(PROBE_TEXT)
        for seam in (m.start() for m in _SEAM.finditer(PROBE_TEXT)):
            if self.encode(PROBE_TEXT[:seam]) + self.encode(PROBE_TEXT[seam:]) != whole:
                return False
        return True

    def _cut(self, text: str, start: int) -> tuple[int, bool]:
        """Where the slice from ``start`` ends, and whether the cut is exact (a seam, or the end)."""
        end = start + SLICE_CHARS
        if end >= len(text):
            return len(text), True
        if self.exact_seams and (seams := [m.start() for m in _SEAM.finditer(text, end - SLICE_CHARS // 2, end)]):
            return seams[-1], True
        return end, False

    def _encode_bounded(self, texts: list[str], literals: list[list[int]], limit: int) -> list[int]:
        """``texts`` (template text) encoded with ``literals`` between them, at most ``limit`` ids."""
        at_least = -(-sum(map(_utf8_bytes, texts)) // self.max_token_bytes)
        if at_least > limit:
            raise PromptTooLong(at_least, limit)
        if sum(map(len, texts)) <= SLICE_CHARS:
            ids = _interleave(self.tokenizer.encode_batch(texts, add_special_tokens=False), literals)
        else:
            ids = self._encode_slices(texts, literals, limit)
        if len(ids) > limit:
            raise PromptTooLong(len(ids), limit)
        return ids

    def _encode_slices(self, texts: list[str], literals: list[list[int]], limit: int) -> list[int]:
        """The ids, one slice per encode call; refused once past ``limit`` (less CUT_SLACK_TOKENS per
        inexact cut); re-encoded whole only when an inexact cut was made and the estimate fits."""
        ids: list[int] = []
        inexact = 0
        for k, text in enumerate(texts):
            start = 0
            while start < len(text):
                end, exact = self._cut(text, start)
                inexact += not exact
                ids += self.tokenizer.encode_batch([text[start:end]], add_special_tokens=False)[0].ids
                if len(ids) - inexact * CUT_SLACK_TOKENS > limit:
                    raise PromptTooLong(len(ids) - inexact * CUT_SLACK_TOKENS, limit)
                start = end
            ids += literals[k] if k < len(literals) else []
        if inexact:
            return _interleave(self.tokenizer.encode_batch(texts, add_special_tokens=False), literals)
        return ids

    def _mask(self, text: str) -> str:
        index = {s: i for i, s in enumerate(self.masked)}
        return self.pattern.sub(lambda m: f"{_SENTINEL}{index[m.group(0)]}{_SENTINEL_END}", text)

    def _mask_all(self, value: Any) -> Any:
        """``value`` with every string in it (keys too; tool arguments, tool schemas) masked; a dict
        subclass (tool_calls.TemplateArguments) keeps its type."""
        if isinstance(value, str):
            return self._mask(value)
        if isinstance(value, dict):
            return type(value)({self._mask_all(k): self._mask_all(v) for k, v in value.items()})
        if isinstance(value, list | tuple):
            return [self._mask_all(v) for v in value]
        return value

    def encode_chat(
        self,
        chat: ChatFormat,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        limit: int | None = None,
        options: Mapping[str, bool] | None = None,
    ) -> list[int]:
        """``limit``: as in ``encode``; ``options``: as in ChatFormat.render."""
        masked = [{**m, **{k: self._mask_all(v) for k, v in m.items() if k != "role"}} for m in messages]
        masked_tools = self._mask_all(list(tools)) if tools else None
        pieces = _MASKED.split(chat.render(masked, add_generation_prompt, masked_tools, options))
        # pieces alternate: template text (specials are special), a masked index (plain text), ...
        literals = [self.masked[int(i)] if int(i) < len(self.masked) else "" for i in pieces[1::2]]
        literal_parts = self.literal.encode_batch(literals, add_special_tokens=False) if literals else []
        literal_ids = [part.ids for part in literal_parts]
        if limit is not None:
            return self._encode_bounded(pieces[0::2], literal_ids, limit)
        return _interleave(self.tokenizer.encode_batch(pieces[0::2], add_special_tokens=False), literal_ids)


def _interleave(template_parts: Sequence[Encoding], literals: list[list[int]]) -> list[int]:
    """Template parts' ids with the literal ids between them: part 0, literal 0, part 1, ..."""
    ids: list[int] = []
    for k, part in enumerate(template_parts):
        ids += part.ids
        if k < len(literals):
            ids += literals[k]
    return ids
