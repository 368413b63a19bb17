"""Tool calls, per family (DeepSeek-V3, DeepSeek-V3.1/V3.2-Exp, GLM, Kimi-K2; DeepSeek-V3.2/V4's DSML in
test_dsml_tool_calls): each family's tool-call text parsed exactly (whole and streamed), malformed text
kept as text, the family's tool section rendered through a small template written after the real one,
and end to end through the server with the OpenAI and the Anthropic client. The model's answers are
scripted (Server.submit replaced by one that pushes chosen token ids through the incremental decoder, as
the worker does), so no trained model is needed to produce calls; the tool markers are special tokens of
the test tokenizer, so the test also proves the decoder hands them to the parser. One round trip runs
the real tiny model."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import urllib.request
from types import SimpleNamespace

import anthropic
import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from colibri_stream.devtools.fixtures import TINY_CHAT_TEMPLATE
from colibri_stream.runtime.turn import RuntimeOptions, TurnResult, load_runtime
from colibri_stream.text.chat_format import IncrementalDecoder, load_chat_format, load_tokenizer
from colibri_stream.text.tool_calls import (
    FORMATS,
    TOOL_MARKERS,
    ToolCall,
    ToolCallParser,
    parse_tool_calls,
    tool_format_for,
    tools_from_functions,
)

MODEL = "tiny"
WAIT_S = 120
FAMILIES = ["deepseek_v3", "deepseek_v31", "glm", "kimi_k2"]
USER = [{"role": "user", "content": "Weather in Paris?"}]
DS = {
    "calls": "<｜tool▁calls▁begin｜>",
    "calls_end": "<｜tool▁calls▁end｜>",
    "call": "<｜tool▁call▁begin｜>",
    "call_end": "<｜tool▁call▁end｜>",
    "sep": "<｜tool▁sep｜>",
}

_DS_HEAD = (
    "{{ bos_token }}{% for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}"
    "{% if tools %}## Tools\n{% for tool in tools %}{{ tool['function'] | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<｜Assistant｜>{{ m['content'] }}<｜tool▁calls▁begin｜>"
    "{% for tc in m['tool_calls'] %}"
)
_DS_TAIL = (
    "{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
# DeepSeek-V3 / R1: TYPE<｜tool▁sep｜>NAME, then the arguments in a json code block (string concatenation
# of the arguments, as the real template does).
DEEPSEEK_V3 = (
    _DS_HEAD + "{{ '<｜tool▁call▁begin｜>' + tc['type'] + '<｜tool▁sep｜>' + tc['function']['name'] + '\\n```json\\n'"
    " + tc['function']['arguments'] + '\\n```<｜tool▁call▁end｜>' }}" + _DS_TAIL
)
# DeepSeek-V3.1 / V3.2: NAME<｜tool▁sep｜>ARGUMENTS
DEEPSEEK_V31 = (
    _DS_HEAD + "{{ '<｜tool▁call▁begin｜>' + tc['function']['name'] + '<｜tool▁sep｜>'"
    " + tc['function']['arguments'] + '<｜tool▁call▁end｜>' }}" + _DS_TAIL
)
# GLM-4.5 / 5: tools as JSON lines; calls as <tool_call>NAME then <arg_key>/<arg_value> pairs.
GLM = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}</tools>\nFor each function call, output <tool_call>{function-name}\n<arg_key>{arg-key}</arg_key>\n"
    "<arg_value>{arg-value}</arg_value>\n...</tool_call>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{% elif m.role == 'system' %}<|system|>\n{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}\n<tool_call>{{ tc.function.name }}"
    "{% for k, v in tc.function.arguments.items() %}\n<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v | tojson if v is not string else v }}</arg_value>{% endfor %}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<|observation|>\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Kimi-K2: tools declared as one JSON list; calls as functions.NAME:IDX with JSON arguments.
KIMI_K2 = (
    "{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{% elif m['role'] == 'system' %}<|im_system|>system<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{% elif m['role'] == 'tool' %}<|im_system|>tool<|im_middle|>## Return of {{ m['tool_call_id'] }}\n"
    "{{ m['content'] }}<|im_end|>"
    "{% elif m['role'] == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m['content'] }}"
    "{% if m['tool_calls'] %}<|tool_calls_section_begin|>{% for tc in m['tool_calls'] %}<|tool_call_begin|>"
    "{{ tc['id'] }}<|tool_call_argument_begin|>{% if tc['function']['arguments'] is string %}"
    "{{ tc['function']['arguments'] }}{% else %}{{ tc['function']['arguments'] | tojson }}{% endif %}"
    "<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)

TEMPLATES = {"deepseek_v3": DEEPSEEK_V3, "deepseek_v31": DEEPSEEK_V31, "glm": GLM, "kimi_k2": KIMI_K2}

# An answer with some text, then two calls: get_weather(city="Paris", days=3) and get_time().
ANSWERS = {
    "deepseek_v3": "Let me check."
    + DS["calls"]
    + DS["call"]
    + "function"
    + DS["sep"]
    + 'get_weather\n```json\n{"city": "Paris", "days": 3}\n```'
    + DS["call_end"]
    + DS["call"]
    + "function"
    + DS["sep"]
    + "get_time\n```json\n{}\n```"
    + DS["call_end"]
    + DS["calls_end"],
    "deepseek_v31": "Let me check."
    + DS["calls"]
    + DS["call"]
    + 'get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
    + DS["call_end"]
    + DS["call"]
    + "get_time<｜tool▁sep｜>{}"
    + DS["call_end"]
    + DS["calls_end"],
    "glm": "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>",
    "kimi_k2": "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
    "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
}

WEATHER = {
    "name": "get_weather",
    "description": "Weather by city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "description": "Now", "parameters": {"type": "object", "properties": {}}}
OPENAI_TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]} for f in (WEATHER, TIME)
]
TOOLS = tools_from_functions([WEATHER, TIME])
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
OTHER_SPECIAL = "<|other|>"  # a special token that is no tool marker: never in an answer's text


# ------------------------------------------------------------------------------------ parsing
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_parses_its_documented_format_whole_and_streamed(family):
    content, calls = parse_tool_calls(ANSWERS[family], FORMATS[family], TOOLS)
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == EXPECTED_CALLS
    parser = ToolCallParser(FORMATS[family], TOOLS)
    events = [e for ch in ANSWERS[family] for e in parser.push(ch)] + parser.finish()
    assert "".join(v for k, v in events if k == "text") == content
    assert [v for k, v in events if k == "tool_call"] == calls
    if family == "kimi_k2":
        assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]


def test_glm_arguments_follow_the_tool_schema():
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n</tool_call>"
    assert parse_tool_calls(text, FORMATS["glm"], TOOLS)[1] == [ToolCall("get_weather", {"city": "42"})]
    text = text.replace("city", "days")
    assert parse_tool_calls(text, FORMATS["glm"], TOOLS)[1] == [ToolCall("get_weather", {"days": 42})]


MALFORMED = {
    "bad json": ("deepseek_v31", ANSWERS["deepseek_v31"].replace('"Paris"', "Paris")),
    "unknown function": ("kimi_k2", ANSWERS["kimi_k2"].replace("get_time", "rm_rf")),
    "arguments not an object": ("deepseek_v3", ANSWERS["deepseek_v3"].replace("{}", "[1]")),
    "unterminated": ("glm", ANSWERS["glm"][: -len("</tool_call>")]),
    "cut mid-call": ("deepseek_v31", ANSWERS["deepseek_v31"][:40]),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_tool_call_text_is_returned_as_text(case):
    family, text = MALFORMED[case]
    content, calls = parse_tool_calls(text, FORMATS[family], TOOLS)
    if case == "unterminated":  # the first GLM call was complete and closed: only the second is text
        assert [c.name for c in calls] == ["get_weather"] and content == "Let me check.\n<tool_call>get_time"
    else:
        assert calls == [] and content == text


def test_the_template_names_the_family():
    assert {f: tool_format_for(t).family for f, t in TEMPLATES.items()} == {f: f for f in FAMILIES}
    assert tool_format_for(TINY_CHAT_TEMPLATE) is None


# ------------------------------------------------------------------------------------ family checkpoints
SPECIALS = ["<bos>", "<eos>", *sorted(TOOL_MARKERS), OTHER_SPECIAL]


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE whose special tokens include every tool marker (ids inside the model's vocab)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [json.dumps(OPENAI_TOOLS), json.dumps(ANTHROPIC_TOOLS), *ANSWERS.values(), *TEMPLATES.values()]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus * 20, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def family_checkpoints(tiny_checkpoints, tmp_path_factory):
    """family -> the tiny deepseek_v3 checkpoint with that family's template and a marker-aware tokenizer."""
    root = tmp_path_factory.mktemp("tool-families")
    source = tiny_checkpoints["deepseek_v3"]
    tokenizer = train_tokenizer(json.loads((source / "config.json").read_text())["vocab_size"])
    out = {}
    for family in FAMILIES:
        dst = shutil.copytree(source, root / family)
        tokenizer.save(str(dst / "tokenizer.json"))
        config = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": TEMPLATES[family]}
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
        out[family] = dst
    return out


@pytest.fixture(scope="module")
def family_server(family_checkpoints, live_server, tmp_path_factory):
    started = {}

    def get(family: str):
        if family not in started:
            options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp(f"kv-{family}"), model_id=MODEL)
            started[family] = live_server(load_runtime(family_checkpoints[family], options))
        return started[family]

    return get


# ------------------------------------------------------------------------------------ rendering
HISTORY_CALL = {"city": "Paris", "days": 3}
RENDERED_CALL = {
    "deepseek_v3": 'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>',
    "deepseek_v31": '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}<｜tool▁call▁end｜>',
    "glm": "<tool_call>get_weather<arg_key>city</arg_key>\n<arg_value>Paris</arg_value><arg_key>days</arg_key>\n"
    "<arg_value>3</arg_value></tool_call>",  # trim_blocks (as in HF) eats the newline after each {% for %}
    "kimi_k2": '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}'
    "<|tool_call_end|>",
}


def openai_history(call_id: str) -> list[dict]:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(HISTORY_CALL)},
    }
    return [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21C"},
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_and_tool_history_are_rendered_in_the_family_format(family, family_checkpoints):
    from colibri_stream.serve.schemas import ChatMessage

    chat = load_chat_format(family_checkpoints[family])
    messages = [ChatMessage.model_validate(m).for_template() for m in openai_history("functions.get_weather:0")]
    prompt = chat.render(messages, True, OPENAI_TOOLS)
    assert RENDERED_CALL[family] in prompt
    assert "sunny, 21C" in prompt
    assert json.dumps(WEATHER["parameters"]) in prompt  # the tools, as HF's tojson writes them


def test_the_decoder_keeps_tool_markers_and_drops_other_special_tokens(family_checkpoints):
    tokenizer = load_tokenizer(family_checkpoints["kimi_k2"])
    ids = tokenizer.encode(OTHER_SPECIAL + ANSWERS["kimi_k2"] + OTHER_SPECIAL + "<eos>", add_special_tokens=False).ids
    assert tokenizer.token_to_id(FORMATS["kimi_k2"].begin) in ids  # the markers are special tokens here
    decoder = IncrementalDecoder(tokenizer, skip_ids=[tokenizer.token_to_id("<eos>")])
    text = "".join(decoder.push(t) for t in ids) + decoder.flush()
    assert text == ANSWERS["kimi_k2"]


def test_special_strings_inside_tool_arguments_stay_text(family_checkpoints, tmp_path):
    from colibri_stream.serve.schemas import ChatMessage

    runtime = load_runtime(family_checkpoints["deepseek_v31"], RuntimeOptions(kv_dir=tmp_path))
    history = openai_history("c1")
    history[1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "<eos><｜tool▁call▁end｜>"})
    messages = [ChatMessage.model_validate(m).for_template() for m in history]
    prompt = runtime.prompt_encoder.encode_chat(runtime.chat, messages, True, OPENAI_TOOLS)
    ids = runtime.tokenizer.token_to_id
    assert ids("<eos>") not in prompt and prompt.count(ids("<｜tool▁call▁end｜>")) == 1  # the template's own
    assert '"<eos><｜tool▁call▁end｜>"' in runtime.tokenizer.decode(prompt, skip_special_tokens=False)


# ------------------------------------------------------------------------------------ end to end
def script(monkeypatch, served, answer: str) -> list[int]:
    """Replace served.server.submit: the job's 'model' writes ``answer`` (its ids, markers as special
    ids), decoded as the worker decodes; returns the ids. Each call records its prompt in served.prompts."""
    tokenizer, chat = served.server.runtime.text_side()
    ids = tokenizer.encode(answer, add_special_tokens=False).ids
    served.prompts = []

    async def submit(body, prompt, limit, session, owner=None, **options):  # options: e.g. logprobs
        served.prompts.append(prompt)
        job = SimpleNamespace(events=asyncio.Queue(), cancel=threading.Event())
        decoder, out = IncrementalDecoder(tokenizer, chat.stop_ids), ids[:limit]
        for token in out:
            if delta := decoder.push(token):
                job.events.put_nowait(("text", delta))
        if tail := decoder.flush():
            job.events.put_nowait(("text", tail))
        stats = {"reused_tokens": 0}  # what the routes read of a real turn's stats
        job.events.put_nowait(("done", TurnResult(out, "length" if len(ids) > limit else "stop", len(prompt), stats)))
        return job

    monkeypatch.setattr(served.server, "submit", submit)
    return ids


def openai_client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def anthropic_client(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.base, api_key="unused", max_retries=0, timeout=WAIT_S)


@pytest.mark.parametrize("family", FAMILIES)
def test_openai_tool_calls_json_and_streamed(family, family_server, monkeypatch):
    served = family_server(family)
    ids = script(monkeypatch, served, ANSWERS[family])
    assert served.server.runtime.tokenizer.token_to_id(FORMATS[family].begin) in ids
    kwargs = dict(model=MODEL, messages=USER, tools=OPENAI_TOOLS, max_tokens=200)
    whole = openai_client(served).chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert message.content == "Let me check." and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == EXPECTED_CALLS
    assert len({c.id for c in message.tool_calls}) == 2
    chunks = list(openai_client(served).chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (i, *call) for i, call in enumerate(EXPECTED_CALLS)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert served.prompts[0] == served.prompts[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_anthropic_tool_use_json_and_streamed(family, family_server, monkeypatch):
    served = family_server(family)
    script(monkeypatch, served, ANSWERS[family])
    kwargs = dict(model=MODEL, messages=USER, tools=ANTHROPIC_TOOLS, max_tokens=200)
    whole = anthropic_client(served).messages.create(**kwargs)
    with anthropic_client(served).messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
        assert message.content[0].text == "Let me check." and message.stop_reason == "tool_use"
        assert [(b.name, b.input) for b in message.content[1:]] == EXPECTED_CALLS
    assert events.count("content_block_start") == 3 and events[-1] == "message_stop"
    assert served.prompts[0] == served.prompts[1]


def test_malformed_calls_through_the_server_are_text(family_server, monkeypatch):
    served = family_server("deepseek_v31")
    bad = ANSWERS["deepseek_v31"].replace("get_time", "rm_rf")
    script(monkeypatch, served, bad)
    chat = openai_client(served).chat.completions.create(model=MODEL, messages=USER, tools=OPENAI_TOOLS)
    assert chat.choices[0].message.content == bad and chat.choices[0].message.tool_calls is None
    assert chat.choices[0].finish_reason == "stop"
    message = anthropic_client(served).messages.create(model=MODEL, messages=USER, tools=ANTHROPIC_TOOLS, max_tokens=9)
    assert [b.type for b in message.content] == ["text"] and message.stop_reason == "max_tokens"
    assert bad.startswith(message.content[0].text)  # cut mid-call: the unterminated section is text too


def test_tools_are_refused_where_they_cannot_work(tiny_checkpoints, family_server, live_server, tmp_path):
    plain = live_server(load_runtime(tiny_checkpoints["deepseek_v3"], RuntimeOptions(kv_dir=tmp_path, model_id=MODEL)))
    with pytest.raises(openai.BadRequestError, match="no tool-call format"):
        openai_client(plain).chat.completions.create(model=MODEL, messages=USER, tools=OPENAI_TOOLS)
    with pytest.raises(anthropic.BadRequestError, match="no tool-call format"):
        anthropic_client(plain).messages.create(model=MODEL, messages=USER, tools=ANTHROPIC_TOOLS, max_tokens=5)
    glm = family_server("glm")  # a forced call of a tool not offered (serve/constrained.py forces offered ones)
    with pytest.raises(openai.BadRequestError, match="tool_choice.function.name"):
        openai_client(glm).chat.completions.create(
            model=MODEL, messages=USER, tools=OPENAI_TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}
        )
    with pytest.raises(anthropic.BadRequestError, match="tool_choice.name"):
        anthropic_client(glm).messages.create(
            model=MODEL, messages=USER, tools=ANTHROPIC_TOOLS, max_tokens=5, tool_choice={"type": "tool", "name": "x"}
        )


def test_a_tool_round_trip_on_the_real_model(family_server, monkeypatch):
    """Tools in, tool result back, on the tiny model (real generation): each prompt holds what it must,
    and the Anthropic form of the conversation is the same prompt as the OpenAI form."""
    served = family_server("deepseek_v31")
    runtime, prompts = served.server.runtime, []
    real_submit = served.server.submit

    async def spy(body, prompt, limit, session, owner=None, **options):
        prompts.append(prompt)
        return await real_submit(body, prompt, limit, session, owner, **options)

    monkeypatch.setattr(served.server, "submit", spy)
    ask = dict(model=MODEL, max_tokens=2, temperature=0)
    openai_client(served).chat.completions.create(**ask, messages=USER, tools=OPENAI_TOOLS)
    openai_client(served).chat.completions.create(**ask, messages=openai_history("c1"), tools=OPENAI_TOOLS)
    anthropic_history = [
        *USER,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "c1", "name": "get_weather", "input": HISTORY_CALL}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny, 21C"}]},
    ]
    anthropic_client(served).messages.create(
        model=MODEL, max_tokens=2, messages=anthropic_history, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0}
    )
    first, with_result, anthropic_form = (runtime.tokenizer.decode(p, skip_special_tokens=False) for p in prompts)
    assert json.dumps(WEATHER["parameters"]) in first and first.endswith("<｜User｜>Weather in Paris?<｜Assistant｜>")
    assert RENDERED_CALL["deepseek_v31"] in with_result
    assert with_result.endswith("<｜tool▁output▁begin｜>sunny, 21C<｜tool▁output▁end｜><｜Assistant｜>")
    assert prompts[2] == prompts[1] and anthropic_form == with_result


# ------------------------------------------------------------------------------------ hostile output
NESTED = "[" * 10_000 + "]" * 10_000
HOSTILE_ANSWERS = {  # family -> (what the model writes, the content and calls the client must get)
    # 16,000 keys that never close (parsed in quadratic time before), then a value nested 10,000 deep
    "glm": (
        "<tool_call>get_weather" + "<arg_key>" * 16_000 + "</tool_call>"
        f"<tool_call>get_weather<arg_key>days</arg_key><arg_value>{NESTED}</arg_value></tool_call>",
        "<tool_call>get_weather" + "<arg_key>" * 16_000 + "</tool_call>",
        [("get_weather", {"days": NESTED})],
    ),
    # arguments nested 10,000 deep (a RecursionError, a 500, before): the section is text
    "deepseek_v31": (
        f'{DS["calls"]}{DS["call"]}get_weather{DS["sep"]}{{"days": {NESTED}}}{DS["call_end"]}{DS["calls_end"]}',
        f'{DS["calls"]}{DS["call"]}get_weather{DS["sep"]}{{"days": {NESTED}}}{DS["call_end"]}{DS["calls_end"]}',
        [],
    ),
}


def script_text(monkeypatch, served, answer: str, size: int = 16) -> None:
    """Replace served.server.submit: the job's 'model' writes ``answer`` as ``size``-character text deltas
    (hostile output longer than the tiny model's context, so not as its token ids)."""

    async def submit(body, prompt, limit, session, owner=None, **options):
        job = SimpleNamespace(events=asyncio.Queue(), cancel=threading.Event())
        for at in range(0, len(answer), size):
            job.events.put_nowait(("text", answer[at : at + size]))
        job.events.put_nowait(("done", TurnResult([0], "stop", len(prompt), {"reused_tokens": 0})))
        return job

    monkeypatch.setattr(served.server, "submit", submit)


@pytest.mark.parametrize("family", HOSTILE_ANSWERS)
def test_hostile_tool_output_streams_as_text_and_calls_never_a_5xx(family, family_server, monkeypatch):
    served = family_server(family)
    answer, content, calls = HOSTILE_ANSWERS[family]
    script_text(monkeypatch, served, answer)
    kwargs = dict(model=MODEL, messages=USER, tools=OPENAI_TOOLS, max_tokens=20)
    chunks = list(openai_client(served).chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == content
    streamed = [(c.function.name, json.loads(c.function.arguments)) for d in deltas for c in d.tool_calls or []]
    assert streamed == calls
    whole = openai_client(served).chat.completions.create(**kwargs).choices[0].message
    assert whole.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls or []] == calls


def test_health_answers_while_a_tool_section_parses(family_server, monkeypatch):
    """The parser runs off the event loop: with a section's parse held, /health still answers, and the
    stream finishes once the parse goes on (order of events, not timing)."""
    served = family_server("glm")
    script(monkeypatch, served, ANSWERS["glm"])
    entered, release, order = threading.Event(), threading.Event(), []
    real_parsed = ToolCallParser._parsed

    def held(self, section):
        if not entered.is_set():
            order.append("parse started")
            entered.set()
            release.wait(4 * WAIT_S)  # longer than /health's timeout: on the loop, /health would fail first
        return real_parsed(self, section)

    monkeypatch.setattr(ToolCallParser, "_parsed", held)
    result = {}
    kwargs = dict(model=MODEL, messages=USER, tools=OPENAI_TOOLS, max_tokens=200, stream=True)
    client = threading.Thread(
        target=lambda: result.update(chunks=list(openai_client(served).chat.completions.create(**kwargs)))
    )
    client.start()
    try:
        assert entered.wait(WAIT_S), "the section never reached the parser"
        with urllib.request.urlopen(served.base + "/health", timeout=WAIT_S) as response:
            order.append(f"health {response.status}")
    finally:
        order.append("parse released")
        release.set()
        client.join(WAIT_S)
    assert order == ["parse started", "health 200", "parse released"]
    calls = [c for chunk in result["chunks"] for c in chunk.choices[0].delta.tool_calls or []]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED_CALLS
