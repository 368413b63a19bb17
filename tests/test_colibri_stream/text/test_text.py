"""Chat templates and stop ids: rendering in a sandbox, the sources a model may ship, the fallback."""

from __future__ import annotations

import json

import pytest

from colibri_stream.devtools import fixtures
from colibri_stream.text import chat_format as text
from colibri_stream.text.chat_format import (
    FALLBACK_CHAT_TEMPLATE,
    ChatFormat,
    ChatTemplateError,
    IncrementalDecoder,
    PromptEncoder,
    load_chat_format,
    load_tokenizer,
    stop_token_ids,
)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_the_fixture_template_renders_with_its_special_tokens(tiny_checkpoints):
    chat = load_chat_format(tiny_checkpoints["deepseek_v3"])
    assert not chat.is_fallback and chat.stop_ids == (1,)
    assert chat.render(MESSAGES) == "<bos>system: Be brief.<eos>user: Hi<eos>assistant:"
    assert chat.render(MESSAGES, add_generation_prompt=False).endswith("user: Hi<eos>")


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config"}))
    assert load_chat_format(tmp_path).render([]) == "config"
    (tmp_path / "chat_template.jinja").write_text("file")
    assert load_chat_format(tmp_path).render([]) == "file"


def test_named_template_list_picks_default(tmp_path):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    config = {"chat_template": templates, "bos_token": {"content": "<s>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    chat = load_chat_format(tmp_path)
    assert chat.render([]) == "plain" and chat.bos_token == "<s>"


def test_no_template_uses_the_documented_fallback(tmp_path):
    chat = load_chat_format(tmp_path)
    assert chat.is_fallback and chat.template == FALLBACK_CHAT_TEMPLATE
    assert chat.render(MESSAGES) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{% set _ = messages.append(1) %}",
        "{{ raise_exception('no system role') }}",
        "{% for %}",
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_untrusted_templates_cannot_escape_the_sandbox(tmp_path, template):
    (tmp_path / "chat_template.jinja").write_text(template)
    with pytest.raises(ChatTemplateError):
        load_chat_format(tmp_path).render(MESSAGES)


def test_stop_ids_merge_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9, "x", True, -1]}))
    assert stop_token_ids(tmp_path) == (7, 9)


def test_incremental_decoding_equals_whole_decoding(tmp_path):
    fixtures.write_tiny_tokenizer(tmp_path, 512)
    tokenizer = load_tokenizer(tmp_path)
    ids = tokenizer.encode("Placement changes speed, never tokens. é ü 🙂").ids + [1]
    decoder = IncrementalDecoder(tokenizer, skip_ids=[1])
    text = "".join(decoder.push(t) for t in ids) + decoder.flush()
    assert text == tokenizer.decode(ids[:-1])


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(10**9) %}{% endfor %}",
        "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
        "{% set r = range(5000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
        "{{ 'x' * 10**9 }}",
        "{{ [1] * 10**9 }}",
        "{{ 9 ** 100000000 }}",  # jinja reads 9 ** 10 ** 8 as (9 ** 10) ** 8
    ],
)
def test_runaway_templates_fail_instead_of_stalling(template):
    with pytest.raises(ChatTemplateError):
        ChatFormat(template).render(MESSAGES)


def test_rendered_output_is_bounded(monkeypatch):
    monkeypatch.setattr(text, "MAX_RENDERED_BYTES", 100)
    chat = ChatFormat("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat.render([{"role": "user", "content": "y" * 100}]) == "y" * 100
    with pytest.raises(ChatTemplateError, match="output over 100"):
        chat.render([{"role": "user", "content": "y" * 101}])


def test_message_content_is_text_never_special_tokens(tiny_checkpoints):
    checkpoint = tiny_checkpoints["deepseek_v3"]
    tokenizer, chat = load_tokenizer(checkpoint), load_chat_format(checkpoint)
    encoder = PromptEncoder(tokenizer)
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world! é"}]
    assert encoder.encode_chat(chat, plain) == encoder.encode(chat.render(plain))  # unchanged without specials
    typed = "<bos>stop<eos> \ue0000\ue001 <eos"
    ids = encoder.encode_chat(chat, [{"role": "user", "content": typed}])
    assert ids.count(0) == 1 and ids.count(1) == 1  # the template's own <bos> and <eos>, nothing else
    assert tokenizer.decode(ids, skip_special_tokens=False) == f"<bos>user: {typed}<eos>assistant:"
