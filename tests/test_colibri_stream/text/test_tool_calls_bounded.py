"""Tool-call parsing that no model output can make fail or stall: arguments nested 10,000 deep are text in
every format (never a RecursionError), and parsing is linear in the text however the markers are
arranged, measured by the parser's own count of the characters it looked at (``ToolCallParser.steps``),
never by a clock. The live-server side (hostile output streamed, /health answering while a section
parses) is in test_tool_calls."""

from __future__ import annotations

import json

import pytest

from colibri_stream.text import bounded_json
from colibri_stream.text.tool_calls import FORMATS, ToolCall, ToolCallParser, parse_tool_calls, tools_from_functions

F = {
    "name": "f",
    "parameters": {"type": "object", "properties": {"s": {"type": "string"}, "x": {"type": "array"}}},
}
TOOLS = tools_from_functions([F])
MARKER = max(len(f.end) for f in FORMATS.values())  # the longest end marker
DEEP = "[" * 10_000 + "]" * 10_000
DS = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"


def deepseek_v3(arguments: str) -> str:
    calls, call, sep, call_end, calls_end = DS
    return f"{calls}{call}function{sep}f\n```json\n{arguments}\n```{call_end}{calls_end}"


def deepseek_v31(arguments: str) -> str:
    calls, call, sep, call_end, calls_end = DS
    return f"{calls}{call}f{sep}{arguments}{call_end}{calls_end}"


def kimi_k2(arguments: str) -> str:
    return (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        f"{arguments}<|tool_call_end|><|tool_calls_section_end|>"
    )


def glm(value: str) -> str:
    return f"<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>{value}</arg_value>\n</tool_call>"


def dsml(block: str, value: str) -> str:
    return (
        f'<｜DSML｜{block}>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="false">{value}'
        f"</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜{block}>"
    )


# family -> (the answer around ARGS, whether ARGS is the whole arguments object or one value in it)
JSON_ARGUMENTS = {"deepseek_v3": deepseek_v3, "deepseek_v31": deepseek_v31, "kimi_k2": kimi_k2}
ONE_VALUE = {
    "glm": glm,
    "deepseek_v32": lambda v: dsml("function_calls", v),
    "deepseek_v4": lambda v: dsml("tool_calls", v),
}


def streamed(family: str, text: str, size: int = 7) -> tuple[str, list[ToolCall], int]:
    """(content, calls, steps) of ``text`` pushed in ``size``-character deltas, as a stream arrives."""
    parser = ToolCallParser(FORMATS[family], TOOLS)
    events = [e for at in range(0, len(text), size) for e in parser.push(text[at : at + size])] + parser.finish()
    content = "".join(v for k, v in events if k == "text")
    return content, [v for k, v in events if k == "tool_call"], parser.steps.count


# ------------------------------------------------------------------------------------ nesting
@pytest.mark.parametrize("family", sorted(JSON_ARGUMENTS))
def test_arguments_nested_10000_deep_are_text_in_each_json_format(family):
    text = "Sure. " + JSON_ARGUMENTS[family]('{"x": ' + DEEP + "}")
    assert parse_tool_calls(text, FORMATS[family], TOOLS) == (text, [])  # the section, markers and all
    content, calls, _ = streamed(family, text)
    assert (content, calls) == (text, [])
    # at the bound, the same shape is a call
    shallow = "[" * 63 + "]" * 63
    _, calls = parse_tool_calls(JSON_ARGUMENTS[family]('{"x": ' + shallow + "}"), FORMATS[family], TOOLS)
    assert [c.arguments for c in calls] == [{"x": json.loads(shallow)}]


@pytest.mark.parametrize("family", sorted(ONE_VALUE))
def test_a_value_nested_10000_deep_is_its_text_in_each_key_value_format(family):
    """GLM and DSML take a value that is not JSON as its text (a model that forgot a string's flag):
    one nested too deeply to decode is that text too."""
    content, calls = parse_tool_calls(ONE_VALUE[family](DEEP), FORMATS[family], TOOLS)
    assert content == "" and calls == [ToolCall("f", {"x": DEEP})]
    assert streamed(family, ONE_VALUE[family](DEEP))[1] == calls
    nested_64 = "[" * 64 + "]" * 64
    assert parse_tool_calls(ONE_VALUE[family](nested_64), FORMATS[family], TOOLS)[1][0].arguments == {
        "x": json.loads(nested_64)
    }


def test_the_depth_scan_counts_brackets_outside_strings_only():
    assert not bounded_json.deeper_than(json.dumps({"s": "[" * 500 + '\\"{' * 500}), 2)
    assert bounded_json.deeper_than("[" * 3 + '"x"' + "]" * 3, 2)
    assert not bounded_json.deeper_than("[" * 3, 3) and bounded_json.deeper_than("[" * 4, 3)
    assert bounded_json.deeper_than('"unterminated ' + "[" * 9, 2) is False  # inside a string to the end
    with pytest.raises(ValueError, match="nested more than 64"):
        bounded_json.loads("[" * 65 + "]" * 65)
    assert bounded_json.loads(b"[[1]]") == [[1]]


# ------------------------------------------------------------------------------------ linear time
def glm_open_keys(n: int) -> str:  # the report's case: markers that never close (was quadratic: 13.4 s at 16,000)
    return "<tool_call>f" + "<arg_key>" * n + "</tool_call>"


def glm_keys_without_values(n: int) -> str:  # every key closes, no value follows: a lazy regex rescanned all
    return "<tool_call>f" + "<arg_key>k</arg_key>x" * n + "</tool_call>"


def glm_many_calls(n: int) -> str:  # n complete calls: n sections in one text
    return "<tool_call>f\n<arg_key>s</arg_key><arg_value>v</arg_value>\n</tool_call>\n" * n


def glm_never_closed(n: int) -> str:  # one section that never ends, held across every delta
    return "<tool_call>f" + "<arg_key>k</arg_key><arg_value>v</arg_value>" * n


def v31_many_calls(n: int) -> str:
    calls, call, sep, call_end, calls_end = DS
    return calls + f"{call}f{sep}{{}}{call_end}\n" * n + calls_end


def v3_many_fences(n: int) -> str:  # a name followed by many fences: the old regex tried each
    calls, call, sep, call_end, calls_end = DS
    return f"{calls}{call}function{sep}f" + "\n```x" * n + f"\n```{call_end}{calls_end}"


def dsml_many_parameters(n: int) -> str:
    parameter = '<｜DSML｜parameter name="s" string="true">v</｜DSML｜parameter>\n'
    return f'<｜DSML｜tool_calls><｜DSML｜invoke name="f">\n{parameter * n}</｜DSML｜invoke></｜DSML｜tool_calls>'


def whitespace(n: int) -> str:  # whitespace held until real text follows
    return "\n" * (8 * n) + "done"


HOSTILE = {
    "glm_open_keys": ("glm", glm_open_keys),
    "glm_keys_without_values": ("glm", glm_keys_without_values),
    "glm_many_calls": ("glm", glm_many_calls),
    "glm_never_closed": ("glm", glm_never_closed),
    "v31_many_calls": ("deepseek_v31", v31_many_calls),
    "v3_many_fences": ("deepseek_v3", v3_many_fences),
    "dsml_many_parameters": ("deepseek_v4", dsml_many_parameters),
    "whitespace": ("kimi_k2", whitespace),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_parsing_work_grows_linearly_with_the_markers(case):
    """Twice the markers, about twice the characters looked at (quadratic would be four times), and a
    small constant per character of text plus a marker-sized look at each delta's edges (where a marker
    can be cut), both for the whole text and for a stream of small deltas."""
    family, make = HOSTILE[case]
    small, large = make(8_000), make(16_000)
    for size in (7, len(large)):  # token-sized deltas; the whole text in one push
        steps_small, steps_large = streamed(family, small, size)[2], streamed(family, large, size)[2]
        deltas = -(-len(large) // size)
        assert steps_large <= 2.2 * steps_small, (case, size, steps_small, steps_large)
        assert steps_large <= 6 * len(large) + 2 * MARKER * deltas, (case, size, steps_large, len(large))


def test_sixteen_thousand_glm_markers_parse_to_the_right_shape():
    text = glm_open_keys(16_000)
    assert parse_tool_calls(text, FORMATS["glm"], TOOLS) == (text, [])  # unclosed keys: text
    content, calls = parse_tool_calls(glm_many_calls(16_000), FORMATS["glm"], TOOLS)
    assert content == "" and calls == [ToolCall("f", {"s": "v"})] * 16_000
    content, calls, _ = streamed("glm", glm_never_closed(16_000))
    assert content == glm_never_closed(16_000) and calls == []  # never closed: text, every character


def test_an_end_marker_cut_between_deltas_is_found():
    text = glm_many_calls(3)
    for size in range(1, 14):
        content, calls, _ = streamed("glm", text, size)
        assert content == "" and calls == [ToolCall("f", {"s": "v"})] * 3, size


def test_client_sent_arguments_nested_10000_deep_are_refused_as_not_json():
    """A client's own tool-call arguments (OpenAI's JSON text; DSML's rendering): a ValueError (the API's
    400), never a RecursionError (a 500)."""
    from colibri_stream.serve.schemas import FunctionCall
    from colibri_stream.text.dsml import DsmlEncoding

    deep = '{"x": ' + DEEP + "}"
    with pytest.raises(ValueError, match="must be the JSON text of an object"):
        FunctionCall(name="f", arguments=deep).parsed_arguments()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prompt = "".join(DsmlEncoding("deepseek_v4").render(messages))
    assert '<｜DSML｜parameter name="arguments" string="true">' + deep in prompt  # kept as the text it was
