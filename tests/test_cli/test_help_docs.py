"""Every command's --help carries runnable examples and its exit statuses; the README documents them."""

from __future__ import annotations

from pathlib import Path

import pytest

from colibri_stream import cli

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = tuple(next(a for a in cli.build_parser()._actions if a.dest == "command").choices)


def test_every_command_is_covered():
    assert {"run", "demo", "convert", "verify", "plan", "kv", "bench", "serve", "chat", "doctor"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_examples_and_exit_statuses(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    examples = out.split("examples:", 1)[1]
    assert f"colibri-stream {command} " in examples
    assert "exit status: 0" in out and "2 on bad flags" in out and "exit status 3 on an internal error" in out
    assert "%%" not in out


def test_readme_documents_exit_statuses_and_the_new_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Exit status", 1)[1].split("\n## ", 1)[0]
    for code in ("`0`", "`1`", "`2`", "`3`", "`130`"):
        assert code in section
    for command in ("colibri-stream serve", "colibri-stream chat", "colibri-stream doctor"):
        assert command in readme


def test_user_errors_are_one_line_and_bugs_print_a_traceback(monkeypatch, capsys, tmp_path):
    from colibri_stream.cli import run as run_command

    assert cli.main(["run", str(tmp_path / "missing"), "--ids", "1"]) == 1  # a user error: one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "config.json" in err

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(run_command, "run", broken)
    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_handler(parser(), "run", broken))
    assert cli.main(["run", str(tmp_path), "--ids", "1"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError" in err and "internal error" in err


def _with_handler(parser, command, handler):
    next(a for a in parser._actions if a.dest == "command").choices[command].set_defaults(handler=handler)
    return parser
