"""The demo's chat fine-tune data (colibri_stream/devtools/chat_corpus.py): each answer is learned from the
very ids `serve` puts before it (the generation prompt, thinking switch included), and only the answer
and its end-of-turn id are targets."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.devtools.chat_corpus import (
    IGNORE,
    ConversationMaker,
    Documented,
    documented,
    encode_conversation,
    first_sentence,
)
from colibri_stream.text.chat_format import PromptEncoder, load_chat_format, load_tokenizer

EOS = 1


@pytest.fixture(scope="module")
def demo_chat():
    return load_chat_format(demo_model_dir()), PromptEncoder(load_tokenizer(demo_model_dir()))


def test_first_sentence_stops_at_the_first_full_stop_of_the_first_paragraph():
    assert first_sentence("Return the  sum.\nOf all.\n\nMore.") == "Return the sum."
    assert first_sentence("No stop here\n\nSecond paragraph.") == "No stop here"
    assert first_sentence("Version 3.11 is new. Really.") == "Version 3.11 is new."


def test_documented_keeps_public_items_with_a_sentence_of_a_docstring(tmp_path):
    source = textwrap.dedent('''
        def load(path, mode):
            """Read the file at path and return its records."""

        def _hidden():
            """A private helper that is never asked about."""

        class Reader:
            """Short."""

            def close(self):
                """Close the reader and release its file handle."""
    ''')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(source)
    (tmp_path / "broken.py").write_text("def (:\n")
    found = documented([tmp_path / "pkg" / "mod.py", tmp_path / "broken.py"], tmp_path)
    assert [(d.module, d.name, d.args) for d in found] == [
        ("pkg/mod.py", "load", ("path", "mode")),
        ("pkg/mod.py", "close", ()),
    ]
    assert found[0].summary == "Read the file at path and return its records."


def _items() -> list[Documented]:
    names = ("load", "close", "parse", "dump", "open_url", "walk")
    return [
        Documented(f"m{i}.py", n, ("x", "y"), f"Do the {n} thing for x and y.", f"Do the {n} thing.\n\nMore.")
        for i, n in enumerate(names)
    ]


def test_an_answer_is_learned_after_the_prompt_serve_renders(demo_chat):
    chat, encoder = demo_chat
    maker = ConversationMaker(_items(), seed=3)
    seen_thinking = seen_tools = 0
    for _ in range(40):
        messages, tools = maker.conversation(preamble_chars=maker.rng.choice((0, 300)))
        example = encode_conversation(chat, encoder, messages, tools)
        assert example is not None and len(example.ids) == len(example.targets)
        answers = [m for m in messages if m["role"] == "assistant"]
        # each answer: the ids right after its generation prompt, up to and including its end of turn
        target_ids = [t for t in example.targets if t != IGNORE]
        assert target_ids.count(EOS) == len(answers)
        last = answers[-1]
        thinking = {"enable_thinking": bool(last.get("reasoning_content"))}
        prompt = encoder.encode(chat.render(messages[:-1], add_generation_prompt=True, tools=tools, options=thinking))
        assert example.ids[: len(prompt)] == prompt
        tail = example.targets[len(prompt) - 1 :]
        assert IGNORE not in tail[:-1] and tail[-2] == EOS and tail[-1] == IGNORE  # nothing follows the last id
        assert example.targets[len(prompt) - 2] == IGNORE  # the prompt itself is context, never a target
        text = encoder.tokenizer.decode(example.ids[len(prompt) :], skip_special_tokens=False)
        assert text.rstrip().endswith(last["content"] + "<eos>")
        seen_thinking += "reasoning_content" in last
        seen_tools += tools is not None
    assert seen_thinking and seen_tools  # both shapes were made


def test_the_same_seed_makes_the_same_conversations():
    first, again = (ConversationMaker(_items(), seed=7).conversation(200) for _ in range(2))
    assert first == again != ConversationMaker(_items(), seed=8).conversation(200)


def test_the_fine_tune_data_comes_from_the_training_split_only():
    """The held-out modules (the perplexity text) give no training question or answer."""
    import sysconfig

    from colibri_stream.devtools.train_demo import split_files, stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = split_files(stdlib_files(root))
    held_modules = {p.relative_to(root).as_posix() for p in held}
    assert held_modules and not held_modules & {d.module for d in documented(train[:60], root)}
