"""The Hugging Face Hub side of `pull`, on huggingface_hub's conventions (``HF_ENDPOINT``, ``HF_TOKEN`` or
a saved login, ``HF_HUB_OFFLINE``, its URLs and HTTP session), every byte through convert/pull_http.py:
streamed, bounded by the listing, with stall and overall deadlines.

A revision is resolved once to a commit (the listing, ``/api/models/REPO/revision/REV?blobs=true``: every
file's size and, for LFS files, its sha256), and everything after is fetched at that commit, so a repo
updated midway cannot mix two versions into one container. The listing is checked as input: a commit id
that is one, sizes that are non-negative integers, sha256s that are 64 hex digits (anything else counts as
not listed: a shard without a size or a sha256 is refused by pull_source.shard_names). The small files
(config, tokenizer, template, index) are bounded by their listed size, and by ``SIDE_FILE_CAP`` whether
listed or not; a shard by its listed size, into ``SHARD.part``, which a later run continues unless it is
longer than listed (then it is deleted). The Hub's refusals are one-line ``PullError``s that say what to
do (a gated or private repo: set HF_TOKEN).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from huggingface_hub import hf_hub_url
from huggingface_hub.utils import build_hf_headers

from colibri_stream.checkpoint.files import TensorInfo, header_length, parse_header
from colibri_stream.convert.pull_http import OFFLINE, Deadlines, HubHttp, OnBytes, PullError, endpoint, offline
from colibri_stream.convert.pull_ids import check_commit, check_repo_id, check_revision
from storage.errors import write_errors

__all__ = ["HubClient", "HubFile", "PullError", "RepoSnapshot", "endpoint", "parse_shard_header"]

HEADER_PREFETCH = 100_000  # bytes: most shard headers fit (huggingface_hub fetches the same first)
CHUNK = 1 << 22
PART = ".part"  # a download in progress, beside where it will be
# The most pull takes for a config, tokenizer, chat template or shard index, listed or not: DeepSeek-V3's
# index is 9 MB; the largest tokenizer.json of a well-known model (Gemma 3) is 33 MB.
SIDE_FILE_CAP = 64 << 20
LISTING_CAP = 64 << 20  # the repo listing's JSON (DeepSeek-V3's, with its 163 shards: ~40 KB)
MAX_FILE_BYTES = 1 << 50  # a listed size past this (1 PiB) is not a file's size
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int  # bytes, as listed (0 when the listing gives none: see ``sized``)
    sha256: str | None  # LFS files (every shard: pull_source.shard_names): the content's sha256, as published
    sized: bool = True  # the listing gave a size

    def check(self, path: Path) -> str | None:
        """Why the file at ``path`` is not this one (size, then sha256), or None when it is."""
        size = path.stat().st_size
        if size != self.size:
            return f"{size} bytes, the Hub lists {self.size}"
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != self.sha256:
            return f"sha256 {digest.hexdigest()[:16]}..., the Hub publishes {str(self.sha256)[:16]}..."
        return None


@dataclass(frozen=True)
class RepoSnapshot:
    repo_id: str
    commit: str
    files: dict[str, HubFile]
    modified_ns: int  # the commit's date: pull stamps downloaded files with it (reproducible containers)


def parse_listing(repo_id: str, raw: bytes) -> RepoSnapshot:
    """The Hub's repo info (JSON), checked: a commit id, a file list; sizes and sha256s kept only when valid."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise PullError(f"{repo_id}: the Hub's repo info is not JSON") from None
    if not isinstance(data, dict):
        raise PullError(f"{repo_id}: the Hub's repo info is not a JSON object")
    commit = check_commit(repo_id, data.get("sha"))
    siblings = data.get("siblings")
    if not isinstance(siblings, list):
        raise PullError(f"{repo_id}: the Hub's repo info has no file list ('siblings')")
    files = {}
    for sibling in siblings:
        name = sibling.get("rfilename") if isinstance(sibling, dict) else None
        if not isinstance(name, str):
            raise PullError(f"{repo_id}: the Hub's file list has an entry without a file name ('rfilename')")
        size, lfs = sibling.get("size"), sibling.get("lfs")
        sha = lfs.get("sha256") if isinstance(lfs, dict) else None
        sized = type(size) is int and 0 <= size <= MAX_FILE_BYTES
        signed = isinstance(sha, str) and _SHA256.fullmatch(sha) is not None
        files[name] = HubFile(name, int(size) if sized else 0, str(sha) if signed else None, sized)
    return RepoSnapshot(repo_id, commit, files, _modified_ns(data.get("lastModified")))


def _modified_ns(value: Any) -> int:
    """The commit's date in ns since the epoch; 0 when the listing gives none that a file can carry."""
    try:
        stamp = int(datetime.fromisoformat(value).timestamp() * 1e9) if isinstance(value, str) else 0
    except (ValueError, OverflowError, OSError):
        return 0
    return stamp if 0 <= stamp < 1 << 62 else 0


class HubClient:
    def __init__(self, repo_id: str, token: str | None = None, deadlines: Deadlines | None = None):
        self.repo_id = check_repo_id(repo_id)
        self.token = token  # None: huggingface_hub's own lookup (HF_TOKEN, then the saved login)
        self.deadlines = deadlines or Deadlines()

    def _http(self) -> HubHttp:
        return HubHttp(self.repo_id, build_hf_headers(token=self.token), self.deadlines)

    def _url(self, snapshot: RepoSnapshot, name: str) -> str:
        return hf_hub_url(self.repo_id, name, revision=snapshot.commit, endpoint=endpoint())

    def snapshot(self, revision: str | None) -> RepoSnapshot:
        """The repo at ``revision`` (default: main) resolved to a commit, with every file's size and checksum."""
        if offline():
            raise PullError(OFFLINE)
        url = f"{endpoint()}/api/models/{self.repo_id}"
        if revision is not None:
            url += f"/revision/{quote(check_revision(revision), safe='')}"
        raw = self._http().read(url + "?blobs=true", f"revision {revision or 'main'}", LISTING_CAP)
        return parse_listing(self.repo_id, raw)

    def download(self, snapshot: RepoSnapshot, name: str, local_dir: Path) -> Path:
        """A small file (config, tokenizer, index) at the snapshot's commit into ``local_dir/name``, bounded
        by its listed size and SIDE_FILE_CAP, stamped with the commit's date."""
        file = snapshot.files[name]
        if file.size > SIDE_FILE_CAP:
            raise PullError(
                f"{self.repo_id}: {name}: the Hub lists {file.size} bytes, more than the {SIDE_FILE_CAP} pull "
                "takes for a config, tokenizer or index file"
            )
        target = local_dir / name
        part = target.with_name(target.name + PART)
        with write_errors(local_dir, "the download directory"):
            target.parent.mkdir(parents=True, exist_ok=True)
            part.unlink(missing_ok=True)  # small: fetched whole each run
            size = file.size if file.sized else None
            self._http().download(self._url(snapshot, name), name, part, size, SIDE_FILE_CAP, lambda n: None)
            os.replace(part, target)
        os.utime(target, ns=(snapshot.modified_ns, snapshot.modified_ns))
        return target

    def fetch_shard(self, snapshot: RepoSnapshot, name: str, local_dir: Path, on_bytes: OnBytes) -> Path:
        """A shard into ``local_dir/name``, continuing ``name.part`` where an earlier run (or a dropped
        connection) left it, unless that holds more than the listed size (then it starts over); never
        more than the listed size on disk (pull_http.HubHttp.download)."""
        target = local_dir / name
        if target.is_file():
            return target
        size = snapshot.files[name].size
        part = target.with_name(target.name + PART)
        with write_errors(local_dir, "the download directory"):
            part.parent.mkdir(parents=True, exist_ok=True)
            if part.is_file() and part.stat().st_size > size:
                part.unlink()  # longer than listed: never continued
            self._http().download(self._url(snapshot, name), name, part, size, size, on_bytes)
            os.replace(part, target)
        os.utime(target, ns=(snapshot.modified_ns, snapshot.modified_ns))
        return target

    @staticmethod
    def delete(local_dir: Path, name: str) -> None:
        """A downloaded file and its partial download."""
        target = local_dir / name
        for path in (target, target.with_name(target.name + PART)):
            path.unlink(missing_ok=True)

    def header(self, snapshot: RepoSnapshot, name: str) -> bytes:
        """A shard's safetensors header (its JSON, without the 8-byte length), by Range requests; never
        more than the header's bytes in memory, whatever the server sends."""
        size = snapshot.files[name].size
        url = self._url(snapshot, name)
        what = f"{name} (header)"
        first = self._http().read(url, what, HEADER_PREFETCH, 0, max(8, min(size, HEADER_PREFETCH)) - 1)
        length = header_length(Path(name), first[:8], size)
        if 8 + length <= len(first):
            return first[8 : 8 + length]
        raw = self._http().read(url, what, length, 8, 8 + length - 1)
        if len(raw) != length:
            raise PullError(
                f"{self.repo_id}: {what}: {len(raw)} of its {length} bytes came; run the same command again"
            )
        return raw


def parse_shard_header(name: str, raw: bytes, size: int, local: Path) -> dict[str, TensorInfo]:
    """A fetched header, checked as a shard on disk would be (every span inside a file of ``size`` bytes)."""
    return parse_header(local / name, raw, size)
