"""What `pull` accepts as a repo id, a revision and a commit, checked before any request: each ends up in
a URL path on the Hub and in the default ``--out`` (``<name>.cstream``), so ``../../x/y`` must be a
one-line refusal, never a path.

The Hub's own rules (huggingface_hub's ``validate_repo_id``): ``owner/name``, each part of
``[A-Za-z0-9._-]`` (``_`` too), starting and ending with a letter, digit or ``_``, at most 96
characters, no ``..`` or ``--``, not ending in ``.git``. A revision is a branch, a tag, a commit or a ref
such as ``refs/pr/1``: git's ref rules (no ``..``, no control characters, spaces or ``~^:?*[\\``, no
``@{``, no empty or dot-led path component, not ending in ``.lock``), at most 256 characters. A commit the
Hub answers with is a 40- or 64-hex id.
"""

from __future__ import annotations

import re

from colibri_stream.convert.pull_http import PullError

PART_CHARS = 96
REVISION_CHARS = 256
_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?")
_REVISION_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")
_COMMIT = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if it is an ``owner/name`` the Hub accepts, else a one-line PullError."""
    shown = repr(repo_id[:120])
    parts = repo_id.split("/")
    if len(parts) != 2:
        raise PullError(f"repo id {shown}: must be owner/name, e.g. deepseek-ai/DeepSeek-V3")
    for part in parts:
        if not part or len(part) > PART_CHARS:
            raise PullError(f"repo id {shown}: each of owner and name has 1 to {PART_CHARS} characters")
        if not _PART.fullmatch(part):
            raise PullError(
                f"repo id {shown}: owner and name are letters, digits, '.', '_' and '-', starting and ending "
                "with a letter, digit or '_'"
            )
        if ".." in part or "--" in part or part.endswith(".git"):
            raise PullError(f"repo id {shown}: no '..' or '--', and no '.git' at the end")
    return repo_id


def check_revision(revision: str) -> str:
    """``revision`` if it is a branch, tag, commit or ref name git and the Hub accept, else a PullError."""
    shown = repr(revision[:120])
    if not revision or len(revision) > REVISION_CHARS:
        raise PullError(f"--revision {shown}: a branch, tag or commit of 1 to {REVISION_CHARS} characters")
    if _REVISION_FORBIDDEN.search(revision) or ".." in revision or "@{" in revision:
        raise PullError(
            f"--revision {shown}: no '..', '@{{', spaces, control characters or any of ~^:?*[\\ in a branch, "
            "tag or commit"
        )
    components = revision.split("/")
    if any(not c or c.startswith(".") or c.endswith(".lock") for c in components) or revision.endswith("."):
        raise PullError(f"--revision {shown}: empty or '.'-led path components, '.lock' or a final '.'")
    return revision


def check_commit(repo_id: str, commit: object) -> str:
    """The commit id the Hub's listing names, if it is one (hex, 40 or 64 digits)."""
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        raise PullError(f"{repo_id}: the Hub's repo info names no commit (sha {str(commit)[:80]!r})")
    return commit
