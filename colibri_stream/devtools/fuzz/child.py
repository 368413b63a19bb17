"""The child side of a fuzz case: limits, an audit hook that records every path the case touches,
and the case itself run in-process — a CLI command exactly as ``python -m colibri_stream ARGS`` runs
it (``runpy``, so the CLI's own error printing and exit status are what gets judged), or one library
function for surfaces with no command (traces).

Two modes, one code path per case:
    python -m colibri_stream.devtools.fuzz.child --case CASE.json --out RESULT.json
    python -m colibri_stream.devtools.fuzz.child --worker RFD WFD     (JSON lines in, JSON lines out)
The worker keeps torch imported across cases (a fresh interpreter costs ~5 s on 2 cores); the parent
kills it on a hang and starts another.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import resource
import runpy
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Audit events whose first argument is a path the case reads, writes, lists or deletes.
_PATH_EVENTS = frozenset(
    {
        "open",
        "os.listdir",
        "os.scandir",
        "os.remove",
        "os.rename",
        "os.rmdir",
        "os.mkdir",
        "os.truncate",
        "os.chmod",
        "os.symlink",
        "os.link",
        "shutil.rmtree",
        "shutil.copyfile",
    }
)


# Events that act on a link itself, never on what it points to: their path's last component is not
# resolved when judging where the case reached (an unlink of a planted symlink stays inside the inputs).
_LINK_EVENTS = frozenset({"os.remove", "os.rename", "os.rmdir", "os.symlink", "os.link"})


class _Recorder:
    """Collects the paths of audit events while armed (only during a case: imports are not its doing),
    each with whether its last component is followed if it is a symbolic link (an open with O_NOFOLLOW
    or an unlink does not follow it: refusing a planted link is no escape)."""

    def __init__(self) -> None:
        self.armed = False
        self.paths: list[tuple[str, bool]] = []

    def hook(self, event: str, args: tuple) -> None:
        if not self.armed or event not in _PATH_EVENTS or not args:
            return
        path = args[0]
        if isinstance(path, int | type(None)):
            return
        flags = args[2] if event == "open" and len(args) > 2 and isinstance(args[2], int) else 0
        follows = event not in _LINK_EVENTS and not flags & os.O_NOFOLLOW
        try:
            self.paths.append((os.fsdecode(path), follows))
        except (TypeError, ValueError):
            pass


def _where(cwd: str, path: str, follows: bool) -> str:
    """The real path an event reached: the last component resolved only when the event follows it."""
    joined = os.path.join(cwd, path)
    if follows:
        return os.path.realpath(joined)
    head, name = os.path.split(joined)
    return os.path.join(os.path.realpath(head), name)


_RECORDER = _Recorder()


def set_memory_limit(limit_bytes: int) -> None:
    if limit_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def _run_cli(argv: list[str]) -> int:
    saved = sys.argv
    sys.argv = ["colibri-stream", *argv]
    try:
        runpy.run_module("colibri_stream", run_name="__main__", alter_sys=False)
    except SystemExit as stop:
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0


def _run_call(target: str, args: list[Any]) -> int:
    """A library function: a typed error (the surface's ``typed`` exception classes) is printed as the
    CLI would print it, anything else as a traceback (exit 3), mirroring the CLI's contract."""
    module_name, _, function = target.partition(":")
    typed = _typed_errors()
    try:
        status = getattr(importlib.import_module(module_name), function)(*args)
    except typed as exc:
        print(f"colibri-stream {function}: error: {exc}", file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 3
    return status if isinstance(status, int) else 0  # a scenario returns its own exit status


def run_cli_captured(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``python -m colibri_stream ARGV`` run in this process, as a case
    runs it (a scenario's step; the audit hook, when armed, sees its paths)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), _stdin(stdin):
        try:
            code = _run_cli(argv)
        except MemoryError:
            print("MemoryError (outside the CLI's handler)", file=sys.stderr)
            code = 3
        except BaseException:
            traceback.print_exc()
            code = 3
    return code, stdout.getvalue(), stderr.getvalue()


def _typed_errors() -> tuple[type[BaseException], ...]:
    from colibri_stream.errors import USER_ERRORS

    return USER_ERRORS


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Run one case in this process; return its exit status, output tails and the paths it touched."""
    stdout, stderr = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    started = time.monotonic()
    _RECORDER.paths = []
    os.chdir(case["cwd"])
    _RECORDER.armed = True
    try:
        with (
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
            _stdin(case.get("stdin", "")),
        ):
            try:
                if case["kind"] == "cli":
                    code = _run_cli(case["argv"])
                else:
                    code = _run_call(case["target"], case["args"])
            except MemoryError:
                print("MemoryError (outside the CLI's handler)", file=sys.stderr)
                code = 3
            except BaseException:  # a bug that escaped the CLI wrapper itself (e.g. KeyboardInterrupt, SystemExit)
                traceback.print_exc()
                code = 3
    finally:
        _RECORDER.armed = False
        os.chdir(cwd)
    return {
        "exit": code,
        "stdout": stdout.getvalue()[-4000:],
        "stderr": stderr.getvalue()[-8000:],
        "stderr_head": stderr.getvalue()[:2000],
        "stderr_chars": len(stderr.getvalue()),
        "stderr_lines": len([line for line in stderr.getvalue().splitlines() if line.strip()]),
        "paths": sorted({_where(case["cwd"], p, follows) for p, follows in _RECORDER.paths}),
        "seconds": round(time.monotonic() - started, 3),
    }


@contextlib.contextmanager
def _stdin(text: str):
    saved = sys.stdin
    sys.stdin = io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = saved


def _worker(rfd: int, wfd: int) -> None:
    reader = os.fdopen(rfd, "r", encoding="utf-8")
    writer = os.fdopen(wfd, "w", encoding="utf-8")
    for line in reader:
        result = run_case(json.loads(line))
        writer.write(json.dumps(result) + "\n")
        writer.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", nargs=2, type=int, metavar=("RFD", "WFD"))
    parser.add_argument("--memory-bytes", type=int, default=0)
    args = parser.parse_args(argv)
    set_memory_limit(args.memory_bytes)
    import torch  # noqa: F401  (imported before the hook is armed: its files are not the case's)

    sys.addaudithook(_RECORDER.hook)
    if args.worker:
        _worker(*args.worker)
        return
    result = run_case(json.loads(args.case.read_text()))
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
