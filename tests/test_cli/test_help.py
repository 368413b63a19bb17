from __future__ import annotations

import shutil
import subprocess
import sys

from colibri_stream import cli


def test_console_script_help_names_the_product():
    exe = shutil.which("colibri-stream")
    assert exe is not None, "console script not installed: pip install -e '.[dev]'"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    assert "usage: colibri-stream" in out
    assert "Mixture-of-Experts" in out


def test_module_entry_point_prints_version():
    out = subprocess.run(
        [sys.executable, "-m", "colibri_stream", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("colibri-stream ")


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: colibri-stream" in capsys.readouterr().err


def test_bench_help_lists_every_section(capsys):
    """The --sections help is written out (the CLI does not import the bench suite to build its parser)."""
    import pytest

    from colibri_stream.bench.suite import SECTIONS

    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    # argparse wraps the help text, and breaks a list wider than the terminal inside it: compare without spaces
    listed = "".join(capsys.readouterr().out.split())
    assert f"comma-separatedsubsetof{','.join(SECTIONS)}(default" in listed
