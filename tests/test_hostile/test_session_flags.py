"""A session continued under other flags: every runtime flag changed in turn between two runs of one
session is either refused in one line naming the flag (the log is left as it was) or resumes to exactly
the tokens a fresh run under the new flags writes. Both ways: made with the flag and resumed without,
and the reverse."""

from __future__ import annotations

import json

import pytest

from colibri_stream import cli
from colibri_stream.errors import SessionError
from colibri_stream.runtime.sessions import Session
from engine.args import ModelArgs
from storage.kvlog import read_header_state

FIRST = list(range(2, 12))
SECOND = [*FIRST, 40, 41, 42]  # FIRST's prompt and more: the whole of FIRST is a stored prefix

# Flags that change a stored value: refused, naming the flag.
REFUSED = {
    "--dtype": ["--dtype", "bfloat16"],
    "--activations": ["--activations", "int8"],
    "--kv-dtype": ["--kv-dtype", "bfloat16"],
}
# Flags that decide where experts are read from, how often the log is synced, or how tokens are drawn:
# the session resumes, token for token what a fresh run computes.
EXACT = {
    "--ram": ["--ram", "30%"],
    "--policy": ["--ram", "30%", "--policy", "hybrid"],
    "--no-prefetch": ["--ram", "30%", "--no-prefetch"],
    "--prefetch-layers": ["--ram", "30%", "--prefetch-layers", "2"],
    "--io-threads": ["--ram", "30%", "--io-threads", "1"],
    "--vram": ["--ram", "30%", "--vram", "30%", "--vram-device", "cpu"],
    "--no-preload": ["--no-preload"],
    "--buffered": ["--buffered"],
    "--direct": ["--direct"],
    "--history": ["--history", "{tmp}/history.json"],
    "--trace": ["--trace", "{tmp}/trace.jsonl"],
    "--kv-sync-every": ["--kv-sync-every", "1"],
    "--temperature": ["--temperature", "0.8", "--seed", "3"],
    "--local-workers": ["--local-workers", "1"],
}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def run(capsys, path, ids, *extra: str) -> tuple[int, dict | None, str]:
    """(exit status, the --json object or None, stderr) of one in-process `run`."""
    capsys.readouterr()
    argv = ["run", str(path), "--ids", ",".join(map(str, ids)), "--max-new-tokens", "8", "--json", *extra]
    status = cli.main(argv)
    out, err = capsys.readouterr()
    return status, json.loads(out.strip().splitlines()[-1]) if status == 0 else None, err


def flags(name: str, tmp_path) -> list[str]:
    table = REFUSED if name in REFUSED else EXACT
    return [part.replace("{tmp}", str(tmp_path)) for part in table[name]]


@pytest.mark.parametrize("made_with_flag", [True, False], ids=["made-with", "resumed-with"])
# Each case is three model loads; the exact ones (about 7 s each, a worker process for --local-workers) are slow.
@pytest.mark.parametrize("name", [*REFUSED, *(pytest.param(name, marks=pytest.mark.slow) for name in EXACT)])
def test_a_flag_changed_between_runs_is_refused_naming_it_or_resumes_exactly(
    stream_container, tmp_path, capsys, name, made_with_flag
):
    changed = flags(name, tmp_path)
    first_flags, second_flags = (changed, []) if made_with_flag else ([], changed)
    session = ["--session", "s", "--kv-dir", str(tmp_path / "kv")]
    assert run(capsys, stream_container, FIRST, *session, *first_flags)[0] == 0
    log = tmp_path / "kv" / "s.kvlog"
    before = log.read_bytes()
    status, resumed, err = run(capsys, stream_container, SECOND, *session, *second_flags)
    if name in REFUSED:
        assert status == 1, f"{name}: a session made under other flags resumed silently"
        assert len(err.strip().splitlines()) == 1 and f"rerun with {changed[0]} " in err and "--reset" in err
        assert log.read_bytes() == before  # nothing written, nothing cut
        return
    assert status == 0, err
    fresh = run(capsys, stream_container, SECOND, *second_flags)[1]
    assert resumed["stats"]["reused_tokens"] == len(FIRST)  # it did resume
    assert resumed["ids"] == fresh["ids"]


def test_the_refusal_names_the_flag_and_the_value_to_rerun_with(stream_container, tmp_path, capsys):
    session = ["--session", "q8", "--kv-dir", str(tmp_path)]
    assert run(capsys, stream_container, FIRST, *session, "--activations", "int8")[0] == 0
    status, _, err = run(capsys, stream_container, SECOND, *session)
    assert status == 1
    assert "session 'q8' was made with activations (--activations) int8; this run uses float32" in err
    assert "rerun with --activations int8, or use --reset" in err
    # --reset starts it over under this run's flags; the header then records them
    assert run(capsys, stream_container, SECOND, *session, "--reset")[0] == 0
    assert "activations" not in read_header_state(tmp_path / "q8.kvlog")[2]


def test_a_log_from_before_activations_were_recorded_opens_as_float32(tiny_checkpoints, tmp_path):
    """Headers written before this field hold only the compute dtype: they open as made with the default
    (float32 activations), and are refused with int8 activations."""
    from colibri_stream.runtime.loader import model_config

    args = ModelArgs.from_hf_config(model_config(tiny_checkpoints["deepseek_v3"]))
    Session(tmp_path, "old", "fp", args).close()
    assert read_header_state(tmp_path / "old.kvlog")[2] == {"compute_dtype": "float32"}  # what old builds wrote
    Session(tmp_path, "old", "fp", args).close()
    with pytest.raises(SessionError, match=r"made with activations \(--activations\) float32; this run uses int8"):
        Session(tmp_path, "old", "fp", args, activations="int8")
