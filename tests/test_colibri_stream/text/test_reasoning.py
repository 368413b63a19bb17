"""A thinking model's answer split into reasoning and content (text/reasoning.py), and what templates do with
thinking and later system messages (text/template_traits.py)."""

from __future__ import annotations

import pytest

from colibri_stream.devtools.fixtures import TINY_CHAT_TEMPLATE, TINY_THINKING_TEMPLATE
from colibri_stream.text.chat_format import ChatFormat
from colibri_stream.text.dsml import DsmlEncoding
from colibri_stream.text.reasoning import ReasoningSplitter, ThinkMarkers, opens_reasoning, split_reasoning
from colibri_stream.text.template_traits import place_system_messages, template_traits

# (answer, reasoning_first) -> (reasoning, content)
SPLITS = [
    (("<think>\nI weigh it.</think>\n\nThe answer.", False), ("I weigh it.", "The answer.")),
    (("  <think>a<b</think>c </think> d", False), ("a<b", "c </think> d")),  # one block, at the start only
    (("No thinking here <think>x</think>", False), ("", "No thinking here <think>x</think>")),
    (("\nstill thinking </thin", True), ("still thinking </thin", "")),  # never closed: reasoning to the end
    (("plan</think>\n\nanswer <think>", True), ("plan", "answer <think>")),
    (("<thin", False), ("", "<thin")),  # a marker cut off at the end was text
    (("\n\nplain", False), ("", "\n\nplain")),
    (("", True), ("", "")),
    (("<think></think>", False), ("", "")),
]


def pieces(text: str, cuts: tuple[int, ...]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize(("case", "expected"), SPLITS)
def test_the_split_is_the_same_however_the_text_is_cut_into_deltas(case, expected):
    text, first = case
    assert split_reasoning(text, first) == expected
    n = len(text)
    cuttings = [(i, j) for i in range(n + 1) for j in range(i, n + 1)] + [tuple(range(1, n))]  # and char by char
    for cuts in cuttings:
        splitter = ReasoningSplitter(reasoning_first=first)
        out = [splitter.push(piece) for piece in pieces(text, cuts)] + [splitter.finish()]
        assert ("".join(r for r, _ in out), "".join(c for _, c in out)) == expected, cuts


def test_a_marker_cut_across_deltas_is_held_back_not_leaked():
    splitter = ReasoningSplitter(reasoning_first=True)
    assert splitter.push("thought </th") == ("thought ", "")  # "</th" may be the marker: held
    assert splitter.push("ink>Answer") == ("", "Answer")
    other = ReasoningSplitter(ThinkMarkers("[R]", "[/R]"))
    assert other.push("[R]why[/") == ("why", "") and other.push("R]so") == ("", "so")


def test_a_prompt_that_ends_by_opening_a_think_block_starts_the_answer_in_it():
    assert opens_reasoning("<｜Assistant｜><think>") and opens_reasoning("assistant:<think>\n")
    assert not opens_reasoning("assistant:<think></think>") and not opens_reasoning("user: <think> me</think>")


def chat(template: str) -> ChatFormat:
    return ChatFormat(template, "<bos>", "<eos>")


def test_the_thinking_switch_is_found_by_rendering():
    traits = template_traits(chat(TINY_THINKING_TEMPLATE))
    assert traits.thinking_switch == "enable_thinking" and traits.thinks
    assert traits.options(True) == {"enable_thinking": True} and traits.options(None) == {}
    on = chat(TINY_THINKING_TEMPLATE).render([{"role": "user", "content": "Hi"}], options=traits.options(True))
    assert on.endswith("assistant:<think>")
    deepseek = "{% if add_generation_prompt %}<A>{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}"
    assert template_traits(chat(deepseek)).thinking_switch == "thinking"
    always = "{% for m in messages %}{{ m['content'].split('</think>')[-1] }}{% endfor %}<A>"  # R1's way
    assert (template_traits(chat(always)).thinking_switch, template_traits(chat(always)).thinks) == (None, True)
    plain = template_traits(chat(TINY_CHAT_TEMPLATE))
    assert (plain.thinking_switch, plain.thinks, plain.options(True)) == (None, False, {})


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_the_dsml_encoding_opens_the_think_block_in_thinking_mode(family):
    dsml = ChatFormat("", encoding=DsmlEncoding(family))
    traits = template_traits(dsml)
    assert traits.thinking_switch == "thinking" and traits.thinks
    ask = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "?"}]
    off, on = dsml.render(ask), dsml.render(ask, options={"thinking": True})
    assert off.endswith("</think>") and on == off.removesuffix("</think>") + "<think>"
    assert on.count("</think>") == 1  # the earlier turn's header stays closed


LATER_SYSTEM = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "system", "content": "Agents: a, b."},
    {"role": "user", "content": "Go"},
]


def test_a_later_system_message_stays_where_the_template_renders_it():
    traits = template_traits(chat(TINY_CHAT_TEMPLATE))
    assert traits.system_in_place and place_system_messages(LATER_SYSTEM, traits) == LATER_SYSTEM


@pytest.mark.parametrize(
    "template",
    [
        # keeps only the first system message (as DeepSeek-V3's keeps only one)
        "{% for m in messages %}{% if m['role'] != 'system' or loop.first %}{{ m['content'] }}|{% endif %}{% endfor %}",
        # refuses a system message after the first
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('system first') }}{% endif %}{{ m['content'] }}{% endfor %}",
    ],
)
def test_a_later_system_message_is_merged_where_the_template_would_lose_it(template):
    traits = template_traits(chat(template))
    assert not traits.system_in_place
    merged = place_system_messages(LATER_SYSTEM, traits)
    assert merged[0] == {"role": "system", "content": "Be brief.\n\nAgents: a, b."}
    assert [m["role"] for m in merged] == ["system", "user", "user"]
    assert "Agents: a, b." in chat(template).render(merged)
    no_leading = place_system_messages(LATER_SYSTEM[1:], traits)
    assert no_leading[0] == {"role": "system", "content": "Agents: a, b."} and len(no_leading) == 3
