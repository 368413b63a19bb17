"""`chat`'s transcript, ``<session>.chat.json`` beside the session's KV log: the messages its chat
template renders, read back when a conversation resumes.

It is read as a file that may be damaged or planted: a regular file only (a FIFO would block, a device
never end, a symbolic link would read another file), at most ``MAX_TRANSCRIPT_BYTES``, UTF-8 JSON shaped
``{"messages": [{"role": str, "content": str}, ...]}``. Anything else (truncated, ``[]``, wrong entries,
bytes that are not UTF-8) is one SessionError naming the file and ``--reset``, and the file is left as it
is: starting over without a word would drop a conversation its owner may want to recover, and the KV log
cannot give the text back.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from colibri_stream.errors import SessionError
from storage.errors import FormatError
from storage.files.safe_read import file_kind, read_json

# The text of a conversation that fits the longest context (1M tokens, a few bytes each), with room for
# JSON escapes; a larger file is not one `chat` wrote.
MAX_TRANSCRIPT_BYTES = 64 << 20
MESSAGE_KEYS = ("role", "content")


def load_transcript(path: Path, session: str) -> list[dict[str, str]] | None:
    """The messages saved at ``path``; None when there is no transcript (a new conversation)."""
    try:
        data = read_json(path, MAX_TRANSCRIPT_BYTES, "chat transcript", follow_symlinks=False)  # stays in its dir
    except FileNotFoundError:
        return None
    except FormatError as exc:  # a directory, FIFO or device; too large; not UTF-8; not JSON
        raise _damaged(str(exc), session) from None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list):
        raise _damaged(f'{path}: chat transcript is not a {{"messages": [...]}} object', session)
    for number, message in enumerate(messages):
        if not _is_message(message):
            shown = repr(message)[:60]
            raise _damaged(f"{path}: chat transcript message {number} is not a role and content ({shown})", session)
    return messages


def remove_transcript(path: Path, session: str) -> None:
    """Forget the conversation's text (``:reset``, ``--reset``): the file, or a link planted there; a
    directory or other non-file in its place is refused rather than emptied."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise SessionError(f"{path}: chat transcript of session {session!r} is {file_kind(mode)}; remove it by hand")
    path.unlink(missing_ok=True)


def _is_message(message: Any) -> bool:
    return isinstance(message, dict) and all(isinstance(message.get(key), str) for key in MESSAGE_KEYS)


def _damaged(problem: str, session: str) -> SessionError:
    return SessionError(f"{problem}; `chat --reset` starts session {session!r} over (or move the file away)")
