"""Every command's --help carries runnable examples and its exit statuses; the README documents them."""

from __future__ import annotations

from pathlib import Path

import pytest

from colibri_stream import cli

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("run", "convert", "verify", "plan", "kv", "serve", "chat", "doctor")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_examples_and_exit_statuses(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    examples = out.split("examples:", 1)[1]
    assert f"colibri-stream {command} " in examples
    assert "exit status: 0" in out and "2 on bad flags" in out
    assert "%%" not in out


def test_readme_documents_exit_statuses_and_the_new_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Exit status", 1)[1].split("\n## ", 1)[0]
    for code in ("`0`", "`1`", "`2`", "`130`"):
        assert code in section
    for command in ("colibri-stream serve", "colibri-stream chat", "colibri-stream doctor"):
        assert command in readme
