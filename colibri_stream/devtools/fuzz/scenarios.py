"""Multi-step fuzz surfaces: state that one run leaves and the next one meets.

    state-change  two turns of one session, runtime flags changed between them (compute dtype,
                  activations, KV dtype, budget, prefix cache, sync, reset): the second must be refused
                  in one line naming the flag, or give exactly the tokens of the same two turns run with
                  its flags in a fresh session (else BAD wrong-resume); a long first prompt leaves a
                  prefix-cache block, which a reset second turn under other flags must not restore
    concurrent    two real `chat` processes on one session at once, with or without --wait-session: each
                  answers every line or is refused in one line naming the holder; every acknowledged turn
                  is in the transcript, in its process's order, and the KV log holds the last one's prompt
                  (else BAD lost-turn)
    full-disk     a small tmpfs (2-8 MiB) mounted for the case under the KV directory, a trace or a
                  convert output, filled to a drawn number of bytes between turns: one-line errors only,
                  and the acknowledged first turn resumes with every position and the same tokens

Each case runs in the fuzz child (``Case.kind`` "call": a function of this module), its steps in-process
through the CLI (the audit hook sees their paths) or, for ``concurrent``, as real processes. A function
returns the case's exit status: 0 (every step as it must be), 1 after printing the first step's one-line
refusal, 3 after a step's traceback, SCENARIO_BAD_EXIT after "BAD <kind>: <detail>", or
SCENARIO_SKIP_EXIT when the machine cannot make what the case needs (a tmpfs without root).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from colibri_stream.devtools.fuzz.bases import PROMPT_IDS, copy_case
from colibri_stream.devtools.fuzz.harness import (
    BAD_HANG,
    BAD_LOST,
    BAD_RESUME,
    SCENARIO_BAD_EXIT,
    SCENARIO_SKIP_EXIT,
    Case,
)

RUN = ["run", "container", "--max-new-tokens", "3", "--buffered", "--json"]
CHAT = ["chat", "ckpt", "--max-new-tokens", "2", "--kv-dir", "kv", "--session", "talk"]
PROMPT = [int(i) for i in PROMPT_IDS.split(",")]
# Past one prefix-cache block (64 tokens): turn 1 leaves a block a reset turn 2 may restore
LONG_PROMPT = [*PROMPT, *range(10, 74)]
SCENARIO_TIMEOUT_S = 240.0  # several turns (concurrent: two processes importing torch on busy cores)

# Runtime flags a second turn may change: (flag, values); None as a value: the flag left out.
FLAGS: dict[str, tuple[str | None, ...]] = {
    "--dtype": (None, "float32", "bfloat16"),
    "--activations": (None, "float32", "int8"),
    "--kv-dtype": (None, "float32", "bfloat16"),
    "--ram": ("50%", "100%", "8MiB"),
    "--prefix-cache": (None, "on", "off"),
    "--kv-sync-every": (None, "1", "2"),
    "--reset": (None, "yes"),
}


@dataclass
class Step:
    argv: list[str]
    code: int
    out: str
    err: str

    @property
    def crashed(self) -> bool:
        return self.code == 3 or "Traceback (most recent call last)" in self.err

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if ": error: " in line]

    @property
    def refused(self) -> bool:
        """Ended with exactly one typed error line (chat's banner and footers beside it allowed)."""
        chatty = bool(self.argv) and self.argv[0] == "chat"
        lines = self.error_lines if chatty else [line for line in self.err.splitlines() if line.strip()]
        warnings = [line for line in lines if ": warning: " in line or ": note: " in line]
        return self.code == 1 and len(self.error_lines) == 1 and len(lines) - len(warnings) == 1

    def json(self) -> dict[str, Any]:
        return json.loads(self.out.strip().splitlines()[-1])


class Verdict(Exception):
    """Ends a scenario with ``status`` after printing ``text`` on stderr."""

    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status, self.text = status, text


def _step(argv: list[str], stdin: str = "") -> Step:
    from colibri_stream.devtools.fuzz.child import run_cli_captured

    code, out, err = run_cli_captured(argv, stdin)
    return Step(argv, code, out, err)


def _refused_after_checks(*steps: Step) -> None:
    """Once every check passed: a step refused on the way (a full disk, a held session) makes the case a
    clean refusal, so the counts tell refusals from runs that went through."""
    for step in steps:
        if step.code != 0:
            raise Verdict(1, step.error_lines[0])


def _must_not_break(step: Step) -> Step:
    """The step, unless it crashed or failed other than in one line (ends the scenario as that)."""
    if step.crashed:
        raise Verdict(3, step.err)
    if step.code != 0 and not step.refused:
        raise Verdict(step.code or 1, step.err)  # judged as the command's own output: not one line
    return step


def _ok_or_refused(step: Step) -> Step:
    """The step if it ran; its refusal ends the scenario as a clean one-line refusal."""
    _must_not_break(step)
    if step.code != 0:
        raise Verdict(1, step.error_lines[0])
    return step


def _bad(kind: str, detail: str) -> Verdict:
    return Verdict(SCENARIO_BAD_EXIT, f"BAD {kind}: {detail}")


def _finish(run: Any) -> int:
    try:
        run()
    except Verdict as verdict:
        print(verdict.text, file=sys.stderr)
        return verdict.status
    return 0


# ---------------------------------------------------------------------------------- state-change


def _flag_args(flags: dict[str, str | None]) -> list[str]:
    args: list[str] = []
    for flag, value in sorted(flags.items()):
        if value is None:
            continue
        if flag == "--prefix-cache":
            args.append("--prefix-cache" if value == "on" else "--no-prefix-cache")
        elif flag == "--reset":
            args.append("--reset")
        else:
            args += [flag, value]
    return args


def state_change(case_dir: str, params_json: str, canary: str) -> int:
    """Turn 1 under flags A, turn 2 under flags B on one session; then the reference, in a fresh session:
    turn 2 alone under B when B computes and logs in float32 (a resume is exact: warm restart ==
    uninterrupted) or resets the session (nothing is resumed), else both turns under B (bfloat16 rounds
    what a resume restores, the same way each time). Turn 2 must be refused in one line or give the
    reference's tokens."""
    params = json.loads(params_json)
    first, second = params["first"], params["second"]
    a = _flag_args({**first, "--reset": None})
    b = _flag_args(second)
    # a long prompt only where a restored block is exact (float32), so a reset turn 2 must match a fresh one
    prompt1 = LONG_PROMPT if params.get("long") and "bfloat16" not in b else PROMPT
    prompt2 = prompt1 + params["extra"] if params["extend"] else prompt1[:2] + params["extra"]

    def run() -> None:
        os.chdir(case_dir)
        ids = lambda p: ["--ids", ",".join(map(str, p))]  # noqa: E731
        _ok_or_refused(_step([*RUN, *ids(prompt1), "--kv-dir", "kv-a", "--session", "s", *a]))
        turn = _ok_or_refused(_step([*RUN, *ids(prompt2), "--kv-dir", "kv-a", "--session", "s", *b]))
        reference = [x for x in b if x != "--reset"]
        if "bfloat16" in reference and "--reset" not in b:  # a reset turn 2 is computed whole: so is its reference
            _must_not_break(_step([*RUN, *ids(prompt1), "--kv-dir", "kv-r", "--session", "s", *reference]))
        fresh = _must_not_break(_step([*RUN, *ids(prompt2), "--kv-dir", "kv-r", "--session", "s", *reference]))
        if fresh.code != 0:
            return  # the reference itself is refused (e.g. a budget): nothing to compare
        got, want = turn.json()["ids"], fresh.json()["ids"]
        if got != want:
            raise _bad(
                BAD_RESUME, f"turn 2 under {b} after turn 1 under {a} gave {got}; the same turns under {b}: {want}"
            )

    return _finish(run)


def _flags() -> st.SearchStrategy[dict[str, str | None]]:
    return st.fixed_dictionaries({flag: st.sampled_from(values) for flag, values in FLAGS.items()})


def _state_change_params() -> st.SearchStrategy[dict[str, Any]]:
    def second_of(first: dict[str, str | None]) -> st.SearchStrategy[dict[str, Any]]:
        changes = st.dictionaries(st.sampled_from(sorted(FLAGS)), st.none(), max_size=3).flatmap(
            lambda keys: st.fixed_dictionaries({k: st.sampled_from(FLAGS[k]) for k in keys})
        )
        return changes.map(lambda changed: {**first, **changed})

    return _flags().flatmap(
        lambda first: st.fixed_dictionaries(
            {
                "first": st.just(first),
                "second": second_of(first),
                "extend": st.booleans(),
                "long": st.booleans(),
                "extra": st.lists(st.integers(1, 120), min_size=1, max_size=4),
            }
        )
    )


# ------------------------------------------------------------------------------------ concurrent


def concurrent(case_dir: str, params_json: str, canary: str) -> int:
    """Two chat processes on one session, started ``stagger_ms`` apart."""
    params = json.loads(params_json)

    def run() -> None:
        os.chdir(case_dir)
        _ok_or_refused(_step([*CHAT], "hello\n"))  # an acknowledged turn before the race
        processes: list[tuple[str, list[str], subprocess.Popen[str]]] = []
        try:
            for name in ("a", "b"):
                lines = [f"{name}{i}" for i in range(params[f"lines_{name}"])]
                script = Path(f"stdin-{name}.txt")  # all of a process's input up front: a holder never
                script.write_text("".join(f"{line}\n" for line in lines))  # waits on us while the other waits on it
                argv = [sys.executable, "-m", "colibri_stream", *CHAT]
                if params[f"wait_{name}"]:
                    argv.append("--wait-session=120")
                with open(script) as stdin:
                    # in the worker's process group: a worker killed on a hang takes them along
                    process = subprocess.Popen(
                        argv, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                    )
                processes.append((name, lines, process))
                if name == "a":
                    time.sleep(params["stagger_ms"] / 1000)
            results = [(name, lines, _wait_for(name, process)) for name, lines, process in processes]
        finally:
            for _, _, process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        answered: dict[str, list[str]] = {}
        for _, _, step in results:  # a traceback or a stray line first: it is the finding
            _must_not_break(step)
        for name, lines, step in results:
            _must_not_break(step)
            if step.code != 0 and "in use by" not in step.error_lines[0]:
                raise Verdict(1, step.error_lines[0])  # a clean refusal of another kind: reported as typed
            answered[name] = lines[: step.err.count(" tok at ")]
        _check_transcript_and_log(answered)
        _refused_after_checks(*(step for _, _, step in results))

    return _finish(run)


def _wait_for(name: str, process: subprocess.Popen[str]) -> Step:
    try:
        _, err = process.communicate(timeout=SCENARIO_TIMEOUT_S / 2)
    except subprocess.TimeoutExpired:
        raise _bad(BAD_HANG, f"chat process {name} did not end in {SCENARIO_TIMEOUT_S / 2:.0f} s") from None
    return Step(CHAT, process.returncode, "", err)


def _check_transcript_and_log(answered: dict[str, list[str]]) -> None:
    messages = json.loads(Path("kv/talk.chat.json").read_text())["messages"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    orders = [["hello", *answered["a"], *answered["b"]], ["hello", *answered["b"], *answered["a"]]]
    if users not in orders:
        raise _bad(BAD_LOST, f"transcript has {users}; the processes acknowledged {answered} after 'hello'")
    from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
    from storage.kv.log import KVLog, read_header_state

    runtime = load_runtime("ckpt", RuntimeOptions(kv_dir="kv"))
    try:
        prompt = runtime.encode_chat(messages[:-1])  # the last turn's prompt: every turn before it
        fingerprint, geometry, state = read_header_state("kv/talk.kvlog")
        with KVLog("kv/talk.kvlog", fingerprint, geometry, state=state) as log:
            held = log.read()[0].tolist()
    finally:
        runtime.close()
    if held[: len(prompt)] != list(prompt):
        raise _bad(BAD_LOST, f"the KV log's {len(held)} positions do not start with the last turn's {len(prompt)}")


def _concurrent_params() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "lines_a": st.integers(1, 4),
            "lines_b": st.integers(1, 4),
            "wait_a": st.booleans(),
            "wait_b": st.booleans(),
            "stagger_ms": st.integers(0, 1500),
        }
    )


# ------------------------------------------------------------------------------------- full-disk


def _fill(directory: Path, leave: int) -> Path:
    """One file filling ``directory``'s filesystem up to ``leave`` free bytes."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                stat = os.statvfs(directory)
                free = stat.f_bavail * stat.f_frsize
                if free <= leave:
                    break
                f.write(b"\xff" * min(1 << 16, free - leave))
                f.flush()
        except OSError:
            pass  # ENOSPC: full
    return filler


def full_disk(case_dir: str, params_json: str, canary: str) -> int:
    """A tmpfs of ``size_kib`` for the KV directory, a trace or a convert output; filled to ``leave``
    bytes before the second step."""
    from colibri_stream.devtools.fuzz.disks import DiskUnavailable, Tmpfs

    params = json.loads(params_json)

    def run() -> None:
        os.chdir(case_dir)
        try:
            disk = Tmpfs(f"{params['size_kib']}k", parent=case_dir)
        except DiskUnavailable as exc:
            raise Verdict(SCENARIO_SKIP_EXIT, f"skipped: no tmpfs to fill ({exc})") from None
        with disk:
            disk_dir = Path(os.path.relpath(disk.path, case_dir))
            if params["what"] == "kv":
                _full_kv(disk_dir, params)
            elif params["what"] == "trace":
                _fill(disk.path, params["leave"])
                _ok_or_refused(_step([*RUN, "--ids", PROMPT_IDS, "--trace", str(disk_dir / "trace.jsonl")]))
            else:
                _fill(disk.path, params["leave"])
                _ok_or_refused(_step(["convert", "ckpt", str(disk_dir / "out.cstream"), "--no-progress"]))

    return _finish(run)


def _full_kv(disk: Path, params: dict[str, Any]) -> None:
    kv = ["--kv-dir", str(disk / "kv"), "--session", "s", "--kv-sync-every", str(params["sync_every"])]
    first = _ok_or_refused(_step([*RUN, "--ids", PROMPT_IDS, *kv]))
    filler = _fill(disk, params["leave"])
    extra = ",".join(map(str, params["extra"]))
    second = _must_not_break(_step([*RUN, "--ids", f"{PROMPT_IDS},{extra}", *kv]))
    filler.unlink()
    again = _must_not_break(_step([*RUN, "--ids", PROMPT_IDS, *kv]))
    if again.code != 0:
        raise _bad(BAD_LOST, f"the acknowledged turn does not resume once the disk has room: {again.error_lines[0]}")
    reused, want = again.json()["stats"]["reused_tokens"], len(PROMPT) - 1
    if reused < want:
        raise _bad(BAD_LOST, f"the acknowledged turn's prompt resumed with {reused} stored positions, not {want}")
    if again.json()["ids"] != first.json()["ids"]:
        raise _bad(BAD_RESUME, f"resumed {again.json()['ids']}, acknowledged {first.json()['ids']}")
    _refused_after_checks(second)


def _full_disk_params() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "size_kib": st.integers(2048, 8192),
            "leave": st.sampled_from([0, 1, 100, 4096, 9000, 65536, 300_000]),
            "what": st.sampled_from(["kv", "kv", "trace", "convert"]),
            "sync_every": st.sampled_from([0, 1]),
            "extra": st.lists(st.integers(1, 120), min_size=1, max_size=6),
        }
    )


# -------------------------------------------------------------------------------------- surfaces


@dataclass(frozen=True)
class Scenario:
    """A multi-step surface: draws its parameters, runs ``function`` of this module in the child."""

    name: str
    entries: tuple[str, ...]
    function: str
    params: Any  # () -> the hypothesis strategy of the parameters
    module: str = __name__  # where ``function`` is (hub_surface.py's and pack_scenario.py's live there)

    def draw(self) -> st.SearchStrategy[dict[str, Any]]:
        strategy: st.SearchStrategy[dict[str, Any]] = self.params()
        return strategy

    def prepare(self, base: Path, case_dir: Path, drawn: dict[str, Any], canary: str) -> Case:
        copy_case(base, case_dir, self.entries)
        (case_dir / "home").mkdir()
        return Case(
            surface=self.name,
            cwd=str(case_dir),
            mutation=[drawn],
            mutated=sorted({str(k) for k in _flag_names(drawn)}),
            kind="call",
            target=f"{self.module}:{self.function}",
            args=[str(case_dir), json.dumps(drawn), canary],
            timeout_s=SCENARIO_TIMEOUT_S,
        )


def _flag_names(drawn: dict[str, Any]) -> list[str]:
    """What a refusal may name: the flags a state change set (the session's name too)."""
    names = ["talk", "'s'", "kv", "colibri-tmpfs", "pack.kvpack"]  # session, its directory, small disk, pack
    for side in ("first", "second"):
        names += [flag for flag, value in drawn.get(side, {}).items() if value is not None]
    return names


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("state-change", ("container",), "state_change", _state_change_params),
        Scenario("concurrent", ("ckpt",), "concurrent", _concurrent_params),
        Scenario("full-disk", ("ckpt", "container"), "full_disk", _full_disk_params),
    )
}
