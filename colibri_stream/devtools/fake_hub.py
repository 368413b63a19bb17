"""A Hugging Face Hub on 127.0.0.1 for the `pull` tests: the file API ``huggingface_hub`` speaks, served
from checkpoint directories, with faults to inject.

What it answers (as huggingface.co does, for what `pull` asks):
- ``GET /api/models/{repo}[/revision/{rev}][?blobs=true]``: repo info, ``sha`` (the commit) and
  ``siblings``; with ``blobs`` each sibling's ``size``, ``blobId`` (git sha1) and, for LFS files
  (*.safetensors), ``lfs: {sha256, size}``;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag`` (the git sha1, or the
  sha256 for LFS files, which also get ``X-Linked-Etag``/``X-Linked-Size``), ``Accept-Ranges``, and
  ``Range: bytes=a-b`` answered with 206;
- errors with the Hub's ``X-Error-Code``: RepoNotFound (404), RevisionNotFound, EntryNotFound, and
  GatedRepo (401) for a gated repo asked without its token.

Faults (``Faults``), on whole-file GETs (not Range requests such as header probes): drop the
connection after N bytes of a file's body (the first K times it is fetched), serve a file with one byte
flipped (the first K times), throttle the body rate so a kill lands
mid-download (whole-file GETs only). Every request is logged with the body bytes it sent, so a test can count what was
downloaded and see that no weight file was asked for.

Hostile modes (a Hub that does not keep to its own listing; `pull` must stay within it): answer Range
requests with 200 and the whole body (``ignore_range``); send a file as a longer body than listed, or an
endless one, without a Content-Length (``oversize``); list a file at another size or with none
(``listed``); drip a file's body one byte at a time (``drip``, seconds per byte; whole-file GETs); answer a
file's URL with a redirect to a given Location (``redirect``); answer a file with a status
(``status``). The bodies are generated as they are sent, never held whole.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from huggingface_hub import constants as hf_constants

CHUNK = 16 << 10
# `python -c SCALED_CHUNK_CLI <command> ...`: the CLI with huggingface_hub's DOWNLOAD_CHUNK_SIZE at 1 KiB.
# pull's downloads (convert/pull_http.py) now write every read as it arrives, so a killed pull keeps what it
# received whatever that constant is; the kill tests keep the launcher so they run as before.
SCALED_CHUNK_CLI = (
    "import sys; import huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 1024; "
    "from colibri_stream.cli import main; sys.exit(main(sys.argv[1:]))"
)
LFS_SUFFIXES = (".safetensors", ".bin")
LAST_MODIFIED = "2026-01-02T03:04:05.000Z"


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str
    token: str | None = None  # a gated repo: requests without "Authorization: Bearer <token>" get 401

    @classmethod
    def from_dir(cls, path: str | Path, token: str | None = None) -> FakeRepo:
        path = Path(path)
        files = {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
        commit = hashlib.sha1(b"".join(hashlib.sha256(d).digest() for d in files.values())).hexdigest()
        return cls(files, commit, token)


@dataclass
class Faults:
    drop_after: dict[str, tuple[int, int]] = field(default_factory=dict)  # file -> (body bytes sent, times)
    corrupt: dict[str, int] = field(default_factory=dict)  # file -> times served with a flipped byte
    bytes_per_s: float | None = None  # body rate of every response (None: as fast as it goes)
    ignore_range: bool = False  # Range requests answered 200 with the whole body
    oversize: dict[str, int | None] = field(default_factory=dict)  # file -> body bytes sent (None: endless)
    listed: dict[str, int | None] = field(default_factory=dict)  # file -> size the listing gives (None: none)
    drip: dict[str, float] = field(default_factory=dict)  # file -> seconds per body byte (whole-file GETs)
    redirect: dict[str, str] = field(default_factory=dict)  # file -> Location of a 302 answering its URL
    status: dict[str, int] = field(default_factory=dict)  # file -> status its URL answers with, no body


@dataclass(frozen=True)
class Logged:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


class FakeHub:
    def __init__(self, repos: dict[str, FakeRepo], faults: Faults | None = None):
        self.repos = repos
        self.faults = faults or Faults()
        self.log: list[Logged] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def record(self, entry: Logged) -> None:
        with self._lock:
            self.log.append(entry)

    def take_fault(self, table: dict[str, Any], name: str) -> Any:
        """The fault armed for ``name`` (its count decremented), or None."""
        with self._lock:
            value = table.get(name)
            if value is None:
                return None
            count = value[1] if isinstance(value, tuple) else value
            if count <= 0:
                return None
            table[name] = (value[0], count - 1) if isinstance(value, tuple) else count - 1
            return value

    def body_bytes(self, name: str) -> int:
        """Body bytes sent for ``name`` (GETs of its resolve URL), over the whole log."""
        return sum(e.body_bytes for e in self.log if e.method == "GET" and e.path.endswith("/" + name))

    def files_requested(self) -> set[str]:
        """Files whose resolve URL was asked for (HEAD or GET)."""
        return {e.path.split("/resolve/", 1)[1].split("/", 1)[1] for e in self.log if "/resolve/" in e.path}


class HubEnv:
    """HF_ENDPOINT at a fake Hub and a private HF_HOME, for this process and its children; online even
    where an earlier test of the session left huggingface_hub offline (lm-eval's check runs offline)."""

    def __init__(self, hub: FakeHub, root: Path, token: str | None = None):
        self.values = {"HF_ENDPOINT": hub.url, "HF_HOME": str(root / "hf-home"), "HF_TOKEN": token}
        self.values["HF_HUB_OFFLINE"] = None
        self.saved: dict[str, str | None] = {}
        self.offline = hf_constants.HF_HUB_OFFLINE

    def __enter__(self) -> None:
        hf_constants.HF_HUB_OFFLINE = False
        for key, value in self.values.items():
            self.saved[key] = os.environ.get(key)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def __exit__(self, *exc: object) -> None:
        hf_constants.HF_HUB_OFFLINE = self.offline
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the test reads hub.log
            pass

        def handle(self) -> None:
            try:
                super().handle()
            except ConnectionError:  # a client killed mid-request (the kill -9 tests)
                pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            split = urlsplit(self.path)
            path = unquote(split.path)
            self.sent, status = 0, 500  # body bytes written, counted as they go (a killed client cuts a body short)
            try:
                if match := _INFO.match(path):
                    status = self._info(match["repo"], match["rev"] or "main", "blobs=true" in split.query)
                elif match := _RESOLVE.match(path):
                    status = self._resolve(match["repo"], match["rev"], match["path"], body)
                else:
                    status = self._error(404, "EntryNotFound", "no such route")
            finally:
                hub.record(Logged(self.command, path, self.headers.get("Range"), status, self.sent))

        def _repo(self, repo_id: str, rev: str) -> FakeRepo | int:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}.")
            if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
                return self._error(
                    401,
                    "GatedRepo",
                    f"Access to model {repo_id} is restricted. You must have access to it and be authenticated.",
                )
            if rev not in ("main", repo.commit):
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return repo

        def _info(self, repo_id: str, rev: str, blobs: bool) -> int:
            repo = self._repo(repo_id, rev)
            if isinstance(repo, int):
                return repo
            siblings = []
            for name, data in repo.files.items():
                sibling: dict[str, Any] = {"rfilename": name}
                if blobs:
                    size = hub.faults.listed.get(name, len(data))
                    sibling.update(blobId=git_blob_sha1(data), **({} if size is None else {"size": size}))
                    if is_lfs(name):
                        sha = hashlib.sha256(data).hexdigest()
                        sibling["lfs"] = {"sha256": sha, "size": size, "pointerSize": 134}
                siblings.append(sibling)
            info = {
                "_id": repo.commit[:24],
                "id": repo_id,
                "modelId": repo_id,
                "sha": repo.commit,
                "lastModified": LAST_MODIFIED,
                "private": False,
                "gated": "auto" if repo.token else False,
                "disabled": False,
                "tags": [],
                "siblings": siblings,
            }
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, True)
            return 200

        def _resolve(self, repo_id: str, rev: str, name: str, body: bool) -> int:
            repo = self._repo(repo_id, rev)
            if isinstance(repo, int):
                return repo
            data = repo.files.get(name)
            if data is None:
                return self._error(404, "EntryNotFound", f"{name} does not exist on {rev}")
            if name in hub.faults.redirect:
                self._send(302, b"", {"Location": hub.faults.redirect[name]}, False)
                return 302
            if name in hub.faults.status:
                self._send(hub.faults.status[name], b"", {}, False)
                return hub.faults.status[name]
            if name in hub.faults.oversize:
                return self._hostile_body(data, hub.faults.oversize[name], body)
            headers = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes", "ETag": f'"{git_blob_sha1(data)}"'}
            if is_lfs(name):
                sha = hashlib.sha256(data).hexdigest()
                headers.update({"ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data))})
            whole = body and "Range" not in self.headers  # faults hit downloads, not header probes
            if whole and hub.take_fault(hub.faults.corrupt, name) is not None:
                flipped = bytearray(data)
                flipped[len(data) // 2] ^= 0x40
                data = bytes(flipped)
            start, end, status = 0, len(data), 200
            wanted = None if hub.faults.ignore_range else self.headers.get("Range")
            if wanted and (match := re.fullmatch(r"bytes=(\d+)-(\d*)", wanted.strip())):
                start = int(match[1])
                end = min(len(data), int(match[2]) + 1) if match[2] else len(data)
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            drop = hub.take_fault(hub.faults.drop_after, name) if whole else None
            if whole and name in hub.faults.drip:
                self._drip(data, hub.faults.drip[name], headers)
                return status
            self._send(status, data[start:end], headers, body, drop[0] if drop else None, whole)
            return status

        def _hostile_body(self, data: bytes, total: int | None, body: bool) -> int:
            """``data`` then filler, ``total`` bytes in all (None: until the client hangs up), from the
            Range's start unless ``ignore_range``; no Content-Length: the body ends when the connection does."""
            start, status = 0, 200
            wanted = None if hub.faults.ignore_range else self.headers.get("Range")
            if wanted and (match := re.fullmatch(r"bytes=(\d+)-(\d*)", wanted.strip())):
                start, status = int(match[1]), 206
            self.send_response(status)
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{(total or 1 << 40) - 1}/*")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            position = start
            filler = bytes(range(256)) * (CHUNK // 256)
            while body and (total is None or position < total):
                chunk = data[position : position + CHUNK] if position < len(data) else filler
                if total is not None:
                    chunk = chunk[: total - position]
                self.wfile.write(chunk)
                position += len(chunk)
                self.sent += len(chunk)
            return status

        def _drip(self, data: bytes, seconds_per_byte: float, headers: dict[str, str]) -> None:
            self.send_response(200)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            for i in range(len(data)):
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                self.sent += 1
                time.sleep(seconds_per_byte)

        def _error(self, status: int, code: str, message: str) -> int:
            payload = json.dumps({"error": message}).encode()
            headers = {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message}
            self._send(status, payload, headers, self.command != "HEAD")
            return status

        def _send(
            self,
            status: int,
            data: bytes,
            headers: dict[str, str],
            body: bool,
            drop_after: int | None = None,
            throttled: bool = False,
        ) -> int:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not body:
                return 0
            while self.sent < len(data):
                chunk = data[self.sent : self.sent + (1024 if throttled and hub.faults.bytes_per_s else CHUNK)]
                if drop_after is not None and self.sent + len(chunk) > drop_after:
                    self.wfile.write(chunk[: max(0, drop_after - self.sent)])
                    self.wfile.flush()
                    self.sent = drop_after
                    self.close_connection = True  # the client sees the body end short: a dropped connection
                    return self.sent
                self.wfile.write(chunk)
                self.sent += len(chunk)
                if throttled and hub.faults.bytes_per_s:
                    time.sleep(len(chunk) / hub.faults.bytes_per_s)
            return self.sent

    return Handler


def main() -> None:
    """Serve checkpoint directories until interrupted: ``python -m colibri_stream.devtools.fake_hub org/name=DIR``."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("repos", nargs="+", help="org/name=checkpoint-directory")
    parser.add_argument("--bytes-per-s", type=float, default=None)
    args = parser.parse_args()
    repos = {spec.split("=", 1)[0]: FakeRepo.from_dir(spec.split("=", 1)[1]) for spec in args.repos}
    with FakeHub(repos, Faults(bytes_per_s=args.bytes_per_s)) as hub:
        print(f"HF_ENDPOINT={hub.url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
