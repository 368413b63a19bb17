"""One writer per session across processes: ``<session>.lock`` beside the session's KV log, held for as
long as the session is in use (a `chat` for its whole run, a `run` for its turn, `serve` while its pool
holds the session), so a second process is refused naming the first's pid instead of both writing and
one's turn disappearing. The KV log's own flock is held only while a log is open (a turn); this lock
also covers the transcript and the time between turns.

Within one process the lock is shared: a chat holding its session opens the session's log every turn,
and serve opens sessions its pool holds. Two holders in one process are still kept apart by the KV
log's own lock. The kernel drops the lock when its process dies (even by SIGKILL): a stale lock file
is taken over.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from colibri_stream.errors import SessionError, SessionInUseError
from storage import lockfile
from storage.errors import FormatError

LOCK_SUFFIX = ".lock"


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
    holder's pid when another process has it. ``name`` must already be a checked session name."""

    def __init__(self, kv_dir: str | Path, name: str):
        self.name = name
        self.path = session_lock_path(kv_dir, name)
        self._key = self.path.parent.resolve() / self.path.name
        self._held = False
        with _GUARD:
            held = _HELD.get(self._key)
            if held is None:
                held = _HELD[self._key] = _Held(self._take(), 0)
            held.holders += 1
        self._held = True

    def _take(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return lockfile.acquire(self.path)
        except lockfile.LockHeldError as exc:
            holder = f"pid {exc.pid}" if exc.pid is not None else "another process"
            raise SessionInUseError(
                f"session {self.name!r} is in use by {holder} ({self.path}); "
                "wait for it to end, or use another --session"
            ) from None
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
