"""One writer per session across processes: ``<session>.lock`` beside the session's KV log, held for as
long as the session is in use (a `chat` for its whole run, a `run` for its turn, `serve` while its pool
holds the session), so a second process is refused naming the first's pid instead of both writing and
one's turn disappearing. The KV log's own flock is held only while a log is open (a turn); this lock
also covers the transcript and the time between turns.

Within one process the lock is shared: a chat holding its session opens the session's log every turn,
and serve opens sessions its pool holds. Two holders in one process are still kept apart by the KV
log's own lock. The kernel drops the lock when its process dies (even by SIGKILL): a stale lock file
is taken over.

A lease may wait for the session instead (``SessionWait``, the commands' --wait-session): it tries the
lock again every few hundred ms until the holder ends or the wait runs out, telling once whom it waits
for. It waits outside this module's guard, so other sessions of the process are not held up, and takes
a share when another thread of its own process got the lock meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from colibri_stream.errors import SessionError, SessionInUseError
from storage.errors import FormatError
from storage.files import lockfile

LOCK_SUFFIX = ".lock"
_FIRST_PAUSE_S, _LAST_PAUSE_S = 0.02, 0.5  # between tries while waiting: quick at first, then gentle


@dataclass(frozen=True)
class SessionWait:
    """What a lease does when another process holds the session: ``seconds`` 0 refuses at once (one
    line naming the holder's pid), > 0 waits up to that long, None waits for as long as it takes;
    ``notify`` hears one line when a wait begins (the CLI prints it); ``stop`` set ends a wait at once,
    refused (a server shutting down)."""

    seconds: float | None = 0.0
    notify: Callable[[str], None] | None = None
    stop: threading.Event | None = None


REFUSE = SessionWait()


@dataclass
class _Held:
    fd: int
    holders: int


_HELD: dict[Path, _Held] = {}
_GUARD = threading.Lock()


def session_lock_path(kv_dir: str | Path, name: str) -> Path:
    return Path(kv_dir) / f"{name}{LOCK_SUFFIX}"


class SessionLease:
    """Holds session ``name``'s lock (under ``kv_dir``) until ``release``; SessionInUseError naming the
    holder's pid when another process has it (after ``wait``, if it waits). ``name`` must already be a
    checked session name."""

    def __init__(self, kv_dir: str | Path, name: str, wait: SessionWait = REFUSE):
        self.name = name
        self.path = session_lock_path(kv_dir, name)
        self._key = self.path.parent.resolve() / self.path.name
        self._held = False
        deadline = None if wait.seconds is None else time.monotonic() + wait.seconds
        pause, told = _FIRST_PAUSE_S, False
        while True:
            try:
                self._hold()
                break
            except lockfile.LockHeldError as exc:
                holder = f"pid {exc.pid}" if exc.pid is not None else "another process"
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or (wait.stop is not None and wait.stop.is_set()):
                    raise SessionInUseError(self._in_use(holder, wait)) from None
                if not told and wait.notify is not None:
                    limit = "" if wait.seconds is None else f" (up to {wait.seconds:g} s)"
                    wait.notify(f"session {name!r} is in use by {holder}: waiting for it to end{limit}")
                    told = True
                nap = pause if left is None else min(pause, left)
                if wait.stop is not None:
                    wait.stop.wait(nap)  # woken at once by a shutdown
                else:
                    time.sleep(nap)
                pause = min(2 * pause, _LAST_PAUSE_S)
        self._held = True

    def _in_use(self, holder: str, wait: SessionWait) -> str:
        if wait.stop is not None and wait.stop.is_set():
            return f"session {self.name!r} is in use by {holder}; stopped waiting for it (shutting down)"
        if not wait.seconds:
            return (
                f"session {self.name!r} is in use by {holder} ({self.path}); "
                "wait for it to end (--wait-session), or use another --session"
            )
        return (
            f"session {self.name!r} is still in use by {holder} after waiting {wait.seconds:g} s ({self.path}); "
            "try again later, or use another --session"
        )

    def _hold(self) -> None:
        """Share this process's hold on the lock, or take it (LockHeldError: another process has it)."""
        with _GUARD:
            held = _HELD.get(self._key)
            if held is None:
                held = _HELD[self._key] = _Held(self._take(), 0)
            held.holders += 1

    def _take(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return lockfile.acquire(self.path)
        except lockfile.LockHeldError:
            raise
        except FormatError as exc:  # a directory, FIFO, device or link planted under the lock's name
            raise SessionError(f"session {self.name!r}: {exc}; remove it or use another --session") from None
        except OSError as exc:
            raise SessionError(f"session {self.name!r}: cannot take its lock {self.path}: {exc.strerror}") from None

    def release(self) -> None:
        """Give the lock back (idempotent); the last holder in this process releases the file's lock."""
        with _GUARD:
            if not self._held:
                return
            self._held = False
            held = _HELD[self._key]
            held.holders -= 1
            if held.holders == 0:
                del _HELD[self._key]
                lockfile.release(held.fd)

    def __enter__(self) -> SessionLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
