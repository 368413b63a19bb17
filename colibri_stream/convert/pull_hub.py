"""The Hugging Face Hub side of `pull`, on ``huggingface_hub``'s own API and conventions: the endpoint
(``HF_ENDPOINT``), the token (``HF_TOKEN`` or a saved login), offline mode (``HF_HUB_OFFLINE``),
``hf_hub_download`` into a local directory for the small files, and for shards its lower-level pieces
(``get_hf_file_metadata``, ``http_get``) writing into a partial file of ours that a later run continues
(``HubClient.fetch_shard``).

A revision is resolved once to a commit, and everything after is fetched at that commit, so a repo
updated midway cannot mix two versions into one container. The Hub's errors become one-line
``PullError``s that say what to do (a gated or private repo: set HF_TOKEN).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub._local_folder import get_local_download_paths
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
from tqdm.auto import tqdm

from colibri_stream.checkpoint.files import TensorInfo, header_length, parse_header
from colibri_stream.errors import ColibriError
from storage.errors import write_errors

HEADER_PREFETCH = 100_000  # bytes: most shard headers fit (huggingface_hub fetches the same first)
CHUNK = 1 << 22
PART = ".part"  # a shard's partial download, beside where it will be


class PullError(ColibriError):
    """The Hub refused or failed a request; the message says what to do."""


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int
    sha256: str | None  # LFS files (every shard: pull_source.shard_names): the content's sha256, as published

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


def endpoint() -> str:
    """HF_ENDPOINT as set now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


@contextlib.contextmanager
def hub_errors(repo_id: str, what: str) -> Iterator[None]:
    """The Hub's exceptions, as one line each that says what to do."""
    try:
        yield
    except GatedRepoError:
        raise PullError(
            f"{repo_id} is gated: accept its terms on its Hub page, then set HF_TOKEN to a token of that account "
            "(or run `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise PullError(
            f"{repo_id}: no such repo on {endpoint()}, or it is private or gated: if you have access, set HF_TOKEN "
            "(or run `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise PullError(f"{repo_id}: {what}: no such revision") from None
    except EntryNotFoundError:
        raise PullError(f"{repo_id}: {what}: not in the repo") from None
    except OfflineModeIsEnabled:
        raise PullError("HF_HUB_OFFLINE is set: pull downloads from the Hub; unset it to continue") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise PullError(f"{repo_id}: {what}: the Hub answered {status}; run the same command again to resume") from None
    except HTTPError as exc:
        raise PullError(
            f"{repo_id}: {what}: network error talking to {endpoint()} ({type(exc).__name__}: {exc}); "
            "run the same command again to resume"
        ) from None


class HubClient:
    def __init__(self, repo_id: str, token: str | None = None):
        self.repo_id = repo_id
        self.token = token  # None: huggingface_hub's own lookup (HF_TOKEN, then the saved login)

    def snapshot(self, revision: str | None) -> RepoSnapshot:
        """The repo at ``revision`` (default: main) resolved to a commit, with every file's size and checksum."""
        if offline():
            raise PullError("HF_HUB_OFFLINE is set: pull downloads from the Hub; unset it to continue")
        with hub_errors(self.repo_id, f"revision {revision or 'main'}"):
            info = HfApi(endpoint=endpoint(), token=self.token).model_info(
                self.repo_id, revision=revision, files_metadata=True
            )
        if not info.sha or info.siblings is None:
            raise PullError(f"{self.repo_id}: the Hub's repo info has no commit or file list")
        files = {
            s.rfilename: HubFile(s.rfilename, int(s.size or 0), s.lfs.sha256 if s.lfs else None) for s in info.siblings
        }
        modified = int(info.last_modified.timestamp() * 1e9) if info.last_modified else 0
        return RepoSnapshot(self.repo_id, info.sha, files, modified)

    def download(self, snapshot: RepoSnapshot, name: str, local_dir: Path) -> Path:
        """A small file (config, tokenizer, index) at the snapshot's commit into ``local_dir/name``, by
        ``hf_hub_download``, stamped with the commit's date."""
        with hub_errors(self.repo_id, name), write_errors(local_dir, "the download directory"):
            path = Path(
                hf_hub_download(
                    self.repo_id,
                    name,
                    revision=snapshot.commit,
                    local_dir=local_dir,
                    endpoint=endpoint(),
                    token=self.token,
                )
            )
        os.utime(path, ns=(snapshot.modified_ns, snapshot.modified_ns))
        return path

    def fetch_shard(
        self, snapshot: RepoSnapshot, name: str, local_dir: Path, counter: type[tqdm] | None = None
    ) -> Path:
        """A shard into ``local_dir/name``, continuing ``name.part`` where an earlier run (or a dropped
        connection) left it, with huggingface_hub's own HEAD (redirects, commit and size headers) and
        ``http_get`` (Range from the partial size, retries). ``hf_hub_download`` itself would start over:
        since huggingface_hub 1.x each process downloads into a file of its own and deletes it on failure."""
        target = local_dir / name
        if target.is_file():
            return target
        part = target.with_name(target.name + PART)
        url = hf_hub_url(self.repo_id, name, revision=snapshot.commit, endpoint=endpoint())
        headers = build_hf_headers(token=self.token)
        with hub_errors(self.repo_id, name), write_errors(local_dir, "the download directory"):
            meta = get_hf_file_metadata(url, token=self.token, endpoint=endpoint(), retry_on_errors=True)
            location = meta.location or url
            if urlsplit(location).netloc != urlsplit(url).netloc:  # a CDN: the token stays with the Hub
                headers.pop("authorization", None)
            part.parent.mkdir(parents=True, exist_ok=True)
            with open(part, "ab") as f:
                http_get(
                    location, f, resume_size=f.tell(), headers=headers, expected_size=meta.size, tqdm_class=counter
                )
            os.replace(part, target)
        os.utime(target, ns=(snapshot.modified_ns, snapshot.modified_ns))
        return target

    @staticmethod
    def delete(local_dir: Path, name: str) -> None:
        """A downloaded file, its partial download and huggingface_hub's bookkeeping of it."""
        paths = get_local_download_paths(local_dir, name)
        part = paths.file_path.with_name(paths.file_path.name + PART)
        for path in (paths.file_path, part, paths.metadata_path, paths.lock_path):
            path.unlink(missing_ok=True)

    def header(self, snapshot: RepoSnapshot, name: str) -> bytes:
        """A shard's safetensors header (its JSON, without the 8-byte length), by Range requests."""
        size = snapshot.files[name].size
        url = hf_hub_url(self.repo_id, name, revision=snapshot.commit, endpoint=endpoint())
        headers = build_hf_headers(token=self.token)
        with hub_errors(self.repo_id, f"{name} (header)"):
            first = self._get(url, headers, 0, min(size, HEADER_PREFETCH) - 1)
            length = header_length(Path(name), first[:8], size)
            if 8 + length <= len(first):
                return first[8 : 8 + length]
            return self._get(url, headers, 8, 8 + length - 1)

    @staticmethod
    def _get(url: str, headers: dict[str, str], start: int, end: int) -> bytes:
        response = get_session().get(url, headers={**headers, "Range": f"bytes={start}-{end}"}, follow_redirects=True)
        hf_raise_for_status(response)
        data = response.content
        if response.status_code == 200:  # a server that ignores Range: take the span from the whole body
            data = data[start : end + 1]
        return data


def parse_shard_header(name: str, raw: bytes, size: int, local: Path) -> dict[str, TensorInfo]:
    """A fetched header, checked as a shard on disk would be (every span inside a file of ``size`` bytes)."""
    return parse_header(local / name, raw, size)


def counting_tqdm(add: Callable[[int], Any]) -> type[tqdm]:
    """A silent tqdm class that reports each downloaded chunk to ``add`` (huggingface_hub's progress hook)."""

    class Counting(tqdm):
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            add(int(n or 0))
            return super().update(n)

    return Counting
