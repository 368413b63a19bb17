"""A session continued under other flags: every runtime flag changed in turn between two runs of one
session is either refused in one line naming the flag (the log is left as it was) or resumes to exactly
the tokens a fresh run writes. Refused flags both ways (made with the flag and resumed without, and the
reverse); flags that change no stored value one way each (see EXACT).

Every run is `colibri-stream run` in this process (cli.main: the flags go through the real parser); the
session made under the default flags and the fresh default run are made once for the module."""

from __future__ import annotations

import argparse
import io
import json
import shutil
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from colibri_stream import cli
from colibri_stream.errors import SessionError
from colibri_stream.runtime.kv.sessions import Session
from engine.config.args import ModelArgs
from storage.kv.log import read_header_state

FIRST = list(range(2, 12))
SECOND = [*FIRST, 40, 41, 42]  # FIRST's prompt and more: the whole of FIRST is a stored prefix

# Flags that change a stored value: refused, naming the flag, whichever run has it.
REFUSED = {
    "--dtype": ["--dtype", "bfloat16"],
    "--activations": ["--activations", "int8"],
    "--kv-dtype": ["--kv-dtype", "bfloat16"],
}
# Flags that decide where experts are read from, how often the log is synced, or how tokens are drawn:
# the session resumes, token for token what a fresh run computes. One direction each: none of them is
# recorded in the log's header, so a flag wrongly recorded would be refused whichever run has it. Those
# that shape how the log is written go on the run that makes it; the rest on the run that resumes.
EXACT = {
    "--ram": ["--ram", "30%"],
    "--policy": ["--ram", "30%", "--policy", "hybrid"],
    "--half-life": ["--ram", "30%", "--half-life", "4"],  # the frequent policy forgets faster: placement only
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
    "--top-p": ["--temperature", "0.8", "--seed", "3", "--top-p", "0.5"],
    "--context": ["--context", "64"],
    "--no-prefix-cache": ["--no-prefix-cache"],
    "--prefix-cache": ["--prefix-cache", "--prefix-ram", "1MiB", "--prefix-disk", "0"],
    "--shared-prefix-cache": ["--shared-prefix-cache"],  # which tenants' blocks a turn sees: placement only
    "--wait-session": ["--wait-session", "5"],
    "--local-workers": ["--local-workers", "1"],
    "--worker-timeout": ["--local-workers", "1", "--worker-timeout", "30"],
    "--mtp": ["--mtp", "off"],  # this model has no MTP module: `on` is refused (tests/test_engine/test_mtp.py)
}
MADE_WITH = {"--kv-sync-every", "--history", "--no-preload", "--direct", "--local-workers", "--no-prefix-cache"}
DRAWS_OTHER_TOKENS = {"--temperature", "--top-p"}  # compared with a fresh run under the flag, the rest with the default
# What is not changed between the two runs here, and why: what the turn is, which session, or the wiring
# of a cluster across machines (tests/test_colibri_stream/experts/cluster checks its tokens against one process).
NOT_RUNTIME = {
    "--help": "no run",
    "-h": "no run",
    "--ids": "the prompt itself",
    "--prompt": "the prompt itself (text: needs a tokenizer)",
    "--max-new-tokens": "how many tokens, not which",
    "--json": "output format",
    "--mtp-depth": "drafts need an MTP module; a drafting session's log: tests/test_engine/test_mtp.py",
    "--seed": "with --temperature above",
    "--session": "which session",
    "--kv-dir": "which session",
    "--reset": "starts the session over",
    "--budget": "a file of --ram/--vram/--io-threads/--context values, each changed above",
    "--prefix-ram": "with --prefix-cache above",
    "--prefix-disk": "with --prefix-cache above",
    "--vram-device": "with --vram above",
    "--prefetch": "--no-prefetch above",
    "--no-shared-prefix-cache": "--shared-prefix-cache above",
    "--preload": "--no-preload above",
    "--world-size": "a multi-machine cluster (tests/test_colibri_stream/experts/cluster)",
    "--master-addr": "a multi-machine cluster (tests/test_colibri_stream/experts/cluster)",
    "--master-port": "a multi-machine cluster (tests/test_colibri_stream/experts/cluster)",
    "--expert-map": "which worker computes an expert (tests/test_colibri_stream/experts/cluster)",
    "--replicas": "which worker computes an expert (tests/test_colibri_stream/experts/cluster)",
    "--cluster-key-file": "who may join a cluster (tests/test_colibri_stream/experts/cluster/test_cluster_key.py)",
}


def test_every_run_flag_is_changed_here_or_says_why_not():
    """A flag added to `run` later must be added to REFUSED or EXACT (or NOT_RUNTIME, with its reason)."""
    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    flags = {flag for action in commands.choices["run"]._actions for flag in action.option_strings}
    classified = set(REFUSED) | set(NOT_RUNTIME) | {part for parts in EXACT.values() for part in parts}
    assert sorted(flags - classified) == []


@dataclass(frozen=True)
class Plain:
    kv_dir: Path  # holds session "s", made from FIRST under the default flags
    fresh_ids: list[int]  # SECOND's tokens from a fresh run under the default flags


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def run(path, ids, *extra: str) -> tuple[int, dict | None, str]:
    """(exit status, the --json object or None, stderr) of one in-process `run`."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["run", str(path), "--ids", ",".join(map(str, ids)), "--max-new-tokens", "8", "--json", *extra]
    with redirect_stdout(out), redirect_stderr(err):
        status = cli.main(argv)
    return status, json.loads(out.getvalue().strip().splitlines()[-1]) if status == 0 else None, err.getvalue()


@pytest.fixture(scope="module")
def plain(stream_container, tmp_path_factory) -> Plain:
    root = tmp_path_factory.mktemp("plain")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        made = run(stream_container, FIRST, "--session", "s", "--kv-dir", str(root / "kv"))
        fresh = run(stream_container, SECOND)
    assert made[0] == 0 and fresh[0] == 0 and fresh[1] is not None, made[2] + fresh[2]
    return Plain(root / "kv", fresh[1]["ids"])


def flags(table: dict[str, list[str]], name: str, tmp_path) -> list[str]:
    return [part.replace("{tmp}", str(tmp_path)) for part in table[name]]


def make_session(stream_container, plain: Plain, tmp_path, first_flags: list[str]) -> list[str]:
    """Session "s" made from FIRST under ``first_flags`` in tmp_path/kv (the module's copy when there are
    none); returns the --session flags that continue it."""
    session = ["--session", "s", "--kv-dir", str(tmp_path / "kv")]
    if first_flags:
        status, _, err = run(stream_container, FIRST, *session, *first_flags)
        assert status == 0, err
    else:
        shutil.copytree(plain.kv_dir, tmp_path / "kv")
    return session


@pytest.mark.parametrize("made_with_flag", [True, False], ids=["made-with", "resumed-with"])
@pytest.mark.parametrize("name", REFUSED)
def test_a_flag_that_changes_a_stored_value_is_refused_naming_it(
    stream_container, plain, tmp_path, name, made_with_flag
):
    changed = flags(REFUSED, name, tmp_path)
    first_flags, second_flags = (changed, []) if made_with_flag else ([], changed)
    session = make_session(stream_container, plain, tmp_path, first_flags)
    log = tmp_path / "kv" / "s.kvlog"
    before = log.read_bytes()
    status, _, err = run(stream_container, SECOND, *session, *second_flags)
    assert status == 1, f"{name}: a session made under other flags resumed silently"
    assert len(err.strip().splitlines()) == 1 and f"rerun with {changed[0]} " in err and "--reset" in err
    assert log.read_bytes() == before  # nothing written, nothing cut


# --local-workers (--worker-timeout with it) starts a worker process (a torch import): marked slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if "worker" in n else n for n in EXACT])
def test_a_flag_that_changes_no_stored_value_resumes_exactly(stream_container, plain, tmp_path, name):
    changed = flags(EXACT, name, tmp_path)
    first_flags, second_flags = (changed, []) if name in MADE_WITH else ([], changed)
    session = make_session(stream_container, plain, tmp_path, first_flags)
    status, resumed, err = run(stream_container, SECOND, *session, *second_flags)
    assert status == 0 and resumed is not None, err
    assert resumed["stats"]["reused_tokens"] == len(FIRST)  # it did resume
    if name in DRAWS_OTHER_TOKENS:
        fresh = run(stream_container, SECOND, *second_flags)[1]
        assert fresh is not None and fresh["ids"] != plain.fresh_ids  # the flag is in force
        assert resumed["ids"] == fresh["ids"]
    else:  # placement changes speed, never tokens: the default run's tokens
        assert resumed["ids"] == plain.fresh_ids


def test_the_refusal_names_the_flag_and_the_value_to_rerun_with(stream_container, tmp_path):
    session = ["--session", "q8", "--kv-dir", str(tmp_path)]
    assert run(stream_container, FIRST, *session, "--activations", "int8")[0] == 0
    status, _, err = run(stream_container, SECOND, *session)
    assert status == 1
    assert "session 'q8' was made with activations (--activations) int8; this run uses float32" in err
    assert "rerun with --activations int8, or use --reset" in err
    # --reset starts it over under this run's flags; the header then records them
    assert run(stream_container, SECOND, *session, "--reset")[0] == 0
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
