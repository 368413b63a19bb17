"""Hostile state and text files (#20): budget TOML, usage history, routing traces, KV logs, chat
templates and tokenizer_config.json. Each is planted as what the fuzzer found (a directory, a FIFO,
/dev/zero, a sparse 4 GiB file, bytes that are not UTF-8, JSON nested 100k deep, a template that
amplifies) and must fail with one typed error naming the file, fast and in bounded memory. Sparse
files cost no disk; FIFOs are refused before they are opened, so nothing here can block."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from colibri_stream import cli
from colibri_stream.errors import BudgetError, ChatTemplateError, SessionError, TokenizerError
from colibri_stream.planning.budget import load_budget_file
from colibri_stream.planning.kv_bytes import kv_geometry
from colibri_stream.runtime.kv.sessions import Session, session_info
from colibri_stream.runtime.loader import model_config
from colibri_stream.text.chat_format import ChatFormat, load_chat_format
from engine.config.args import ModelArgs
from storage.errors import FormatError
from storage.files.safe_read import NotRegularFileError
from storage.kv.log import KVLog
from storage.tiers.history import UsageHistory
from storage.tiers.simulate import read_trace
from storage.tiers.trace import TraceWriter

DEEP_JSON = "[" * 100_000 + "]" * 100_000
FOUR_GIB = 4 << 30


def plant(path: Path, kind: str) -> Path:
    """Put a non-regular file (or a sparse one) where a state file is expected."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(FOUR_GIB)
    return path


SPECIAL = ["dir", "fifo", "dev-zero"]


# ------------------------------------------------------------------------------------------ budget
@pytest.mark.parametrize(
    "kind, content, message",
    [
        ("bytes", b'[memory]\nram = "8\xaeGiB"\n', r"not UTF-8 \(byte 0xae at offset 17\)"),
        ("sparse", None, "4294967296 bytes, more than the 1048576"),
        ("bytes", b"a = " + b"[" * 100_000, "nested too deeply"),
        *[(kind, None, "not a regular file") for kind in SPECIAL],
    ],
)
def test_a_hostile_budget_file_is_one_budget_error_naming_it(tmp_path, kind, content, message):
    path = tmp_path / "budget.toml"
    if content is not None:
        path.write_bytes(content)
    else:
        plant(path, kind)
    with pytest.raises(BudgetError, match=message) as error:
        load_budget_file(path)
    assert str(path) in str(error.value)


def test_a_plain_budget_file_still_loads(tmp_path):
    path = tmp_path / "budget.toml"
    path.write_text('[memory]\nram = "8GiB"\n[io]\nthreads = 2\n')
    budget = load_budget_file(path)
    assert (budget["ram"], budget["threads"]) == ("8GiB", 2)


# ----------------------------------------------------------------------------------------- history
@pytest.mark.parametrize("kind", [*SPECIAL, "sparse"])
def test_a_history_that_is_not_a_small_regular_file_is_refused(tmp_path, kind):
    path = plant(tmp_path / "history.json", kind)
    with pytest.raises(FormatError, match="not a regular file|more than the") as error:
        UsageHistory.load(path, n_experts=8)
    assert str(path) in str(error.value)


def _history(tmp_path, counts, n_experts=2) -> Path:
    path = tmp_path / "history.json"
    UsageHistory(n_experts, "fp", {0: [1.0] * n_experts}).save(path)
    data = json.loads(path.read_text())
    data["counts"] = counts
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "counts, message",
    [
        ({"0": [1, -1]}, "count -1"),
        ({"0": [1, float("nan")]}, "count nan"),
        ({"0": [1, True]}, "count True"),
        ({"99999": [1, 1]}, "layer '99999'"),
        ({"0": "ab"}, "count 'a'"),
    ],
)
def test_history_counts_must_be_finite_non_negative_numbers(tmp_path, counts, message):
    with pytest.raises(FormatError, match=message):
        UsageHistory.load(_history(tmp_path, counts), n_experts=2, fingerprint="fp")


def test_a_deeply_nested_history_is_a_format_error_and_a_good_one_loads(tmp_path):
    path = tmp_path / "history.json"
    path.write_text(DEEP_JSON[:4000] + DEEP_JSON[-4000:])  # under the size cap, over the recursion limit
    with pytest.raises(FormatError, match="too deeply"):
        UsageHistory.load(path, n_experts=2)
    good = _history(tmp_path, {"0": [3, 1], "5": [0, 2]})
    assert UsageHistory.load(good, n_experts=2, fingerprint="fp").hottest(2) == [(0, 0), (5, 1)]


# ------------------------------------------------------------------------------------------- trace
def _trace(tmp_path) -> Path:
    writer = TraceWriter(tmp_path / "trace.jsonl")
    for layer in range(3):
        writer.write(layer, [layer, layer + 1])
    writer.close()
    return writer.path


def test_a_written_trace_reads_back(tmp_path):
    assert read_trace(_trace(tmp_path)) == [(0, 0), (0, 1), (1, 1), (1, 2), (2, 2), (2, 3)]


@pytest.mark.parametrize(
    "line, message",
    [
        (b"0", r":2: not a trace line \('0'\)"),
        (b'{"layer": 1, "experts": [Infinity]}', ":2: not a trace line"),
        (b'{"layer": -1, "experts": [1]}', ":2: not a trace line"),
        (b'{"layer": 1, "experts": [1e300]}', ":2: not a trace line"),
        (b'{"layer": 1, "experts": [1\xcf/]}', r":2: trace line is not UTF-8 \(byte 0xcf at offset 26\)"),
        (b'{"layer": 1, "experts": ' + DEEP_JSON[:20000].encode() + b"}", ":2: trace line nests JSON"),
        (b'{"layer": 1, "experts": [1, 2', ":2: trace line is not valid JSON"),
        (b"1" * (65 << 10), ":2: trace line longer than 65536 bytes"),
    ],
)
def test_a_bad_trace_line_is_a_format_error_naming_file_and_line(tmp_path, line, message):
    path = _trace(tmp_path)
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join([lines[0], line, *lines[1:]]) + b"\n")
    with pytest.raises(FormatError, match=message) as error:
        read_trace(path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize("kind", ["sparse", "dev-zero", "dir", "fifo"])
def test_an_endless_or_special_trace_fails_at_once(tmp_path, kind):
    path = plant(tmp_path / "trace.jsonl", kind)
    with pytest.raises(FormatError, match="1: trace line longer than|not a regular file"):
        read_trace(path)


# ------------------------------------------------------------------------------------------- kvlog
@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v4"])
def model(request, tiny_checkpoints):
    """An MLA model's and DeepSeek-V4's checkpoint (their logs have either record geometry)."""
    checkpoint = (
        request.getfixturevalue("tiny_v4_checkpoint")
        if request.param == "deepseek_v4"
        else tiny_checkpoints[request.param]
    )
    return checkpoint, ModelArgs.from_hf_config(model_config(checkpoint))


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_session_log_that_is_not_a_regular_file_is_refused_naming_it(tmp_path, model, kind):
    log = plant(tmp_path / "kv" / "s.kvlog", kind)
    for reset in (False, True):  # not even --reset writes to it
        with pytest.raises(SessionError, match="s.kvlog: KV log is a .*, not a regular file") as error:
            Session(tmp_path / "kv", "s", "fp", model[1], reset=reset)
        assert "'s'" in str(error.value)
    assert log.is_symlink() or not log.is_file()  # untouched
    with pytest.raises(NotRegularFileError):
        KVLog(log, "fp", kv_geometry(model[1], "float32"))


def test_kv_ls_lists_a_non_regular_session_and_info_refuses_it(tmp_path, model, capsys):
    kv = tmp_path / "kv"
    Session(kv, "good", "fp", model[1]).close()
    plant(kv / "dir.kvlog", "dir")
    plant(kv / "zero.kvlog", "dev-zero")
    assert session_info(kv / "dir.kvlog", model[1])["header"] == "not a regular file (a directory)"
    assert cli.main(["kv", "ls", str(model[0]), "--kv-dir", str(kv)]) == 0
    listed = dict(line.split("\t")[:2] for line in capsys.readouterr().out.splitlines())
    assert listed == {
        "dir": "not a regular file (a directory)",
        "good": "0 tokens",
        "zero": "not a regular file (a symbolic link)",  # to /dev/zero: never followed out of the directory
    }
    assert cli.main(["kv", "info", str(model[0]), "zero", "--kv-dir", str(kv)]) == 1
    assert "zero.kvlog: session 'zero' is not a regular file" in capsys.readouterr().err


def test_a_session_log_cut_inside_its_header_is_one_error_with_the_way_out(tmp_path, model):
    Session(tmp_path, "s", "fp", model[1]).close()
    path = tmp_path / "s.kvlog"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SessionError, match=r"corrupt or unreadable KV log header .*--reset"):
        Session(tmp_path, "s", "fp", model[1])
    assert session_info(path, model[1])["header"].startswith("corrupt header")
    Session(tmp_path, "s", "fp", model[1], reset=True).close()
    with Session(tmp_path, "s", "fp", model[1]).log as log:  # readable again after the reset
        assert log.length == 0


# ----------------------------------------------------------------------------------- chat template
MESSAGES = [{"role": "user", "content": "hello"}]
BIG = "{% set x = 'y' * 16000000 %}"


@pytest.mark.parametrize(
    "template",
    [
        "{{ '{:>999999999}'.format(1) }}",
        "{{ '{:{}}'.format(1, 999999999) }}",
        "{{ '%0999999999d' % 1 }}",
        "{{ '%*d' % (999999999, 1) }}",
        "{{ '%s' | format('x' * 60000000) }}",
        "{{ 'a'.ljust(999999999) }}",
        "{{ messages[0]['content'] | wordwrap(1) * 100000000 }}",
        "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        BIG + "{{ ([x] * 1000) | join }}",
        BIG + "{{ [x] * 1000 }}",
        BIG + "{{ ','.join([x] * 100) }}",
        BIG + "{{ x | batch(1) | list | length }}",
        "{% for a in messages[0]['content'] * 3000 %}{% for b in messages[0]['content'] * 3000 %}"
        "{% endfor %}{% endfor %}",
        "{% for x in [1] recursive %}{{ loop([1, 1]) }}{% endfor %}",
        "{% for i in range(10000) %}{% set y %}{{ 'x' * 10000 }}{% endset %}{% endfor %}",
        "{{ lipsum(1000000000) }}",
        "{{ messages | tojson(indent=10**9) }}",
        "{{ '\U0001f600' * 2000000 }}",  # 2M characters, 8 MB of UTF-8: over the tokenizer's share
    ],
)
def test_amplifying_templates_are_refused_before_the_work(template):
    with pytest.raises(ChatTemplateError, match="chat template"):
        ChatFormat(template).render(MESSAGES)


def test_bounds_leave_real_prompts_alone():
    chat = ChatFormat("{% for m in messages %}{{ '<' ~ m['role'] ~ '>' + m['content'] | trim }}{% endfor %}")
    content = "word " * 600_000  # 3 MB of content: rendered, not refused
    assert chat.render([{"role": "user", "content": content}]) == "<user>" + content.strip()


def test_a_deep_tokenizer_config_is_a_tokenizer_error_naming_it(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ' + DEEP_JSON + "}")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: this file nests JSON"):
        load_chat_format(tmp_path)
