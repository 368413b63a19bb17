"""Every byte `pull` takes from the Hub, streamed and bounded by what the listing says, with deadlines.

huggingface_hub's own download paths bound nothing a Hub sends: ``http_get`` writes whatever body comes
(a shard listed at 2 MB streamed as 1 GB is written whole, and its ``.part`` is then "continued" past its
size on every run), ``hf_hub_download`` has no size cap for config.json, ``HfApi.model_info`` reads the
listing whole with no timeout, and a 200 answer to a Range request is read into memory by a plain
``response.content``. So `pull` speaks HTTP here, on huggingface_hub's session (its proxies, its
user-agent, HF_HUB_OFFLINE) and its headers (HF_TOKEN or the saved login):

- a body is read as it arrives (``iter_raw``, ``Accept-Encoding: identity``: the bytes as listed, no
  decompression bomb) and written to disk or, for the listing and shard headers, kept only up to a cap;
- never past its listed size: the byte past it ends the download, and the partial file is deleted;
- a 200 answer to a Range request (a server that ignores Range) skips the bytes already held while
  streaming; a 206 from another offset skips to ours or is refused;
- redirects are followed here, at most ``MAX_REDIRECTS``, to http(s) only, the token dropped when the
  host changes (the CDN);
- deadlines: ``stall_s`` with no byte ends a request (the read timeout), and after ``stall_s`` of grace
  the bytes of a body must keep up with ``min_rate`` (a body of N bytes: within ``stall_s + N /
  min_rate`` seconds; a drip-fed one ends as soon as it falls behind, listed size or not);
- a dropped connection continues with a Range request from the bytes written (``RETRIES`` drops in a row
  without a new byte end it);
- every failure is a one-line ``PullError`` that says what to do.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urljoin, urlsplit

import httpx2
from huggingface_hub import constants
from huggingface_hub.errors import OfflineModeIsEnabled
from huggingface_hub.utils import get_session

from colibri_stream.errors import ColibriError

MAX_REDIRECTS = 5
RETRIES = 5  # dropped connections in a row without a new byte, before a download gives up
RETRY_PAUSE_S = 0.5
_RETRYABLE = (httpx2.RemoteProtocolError, httpx2.ReadError, httpx2.ConnectError, httpx2.WriteError)
_CONTENT_RANGE = re.compile(r"bytes (\d{1,20})-(\d{1,20})/(\d{1,20}|\*)")
OFFLINE = "HF_HUB_OFFLINE is set: pull downloads from the Hub; unset it to continue"

OnBytes = Callable[[int], object]


class PullError(ColibriError):
    """The Hub refused or failed a request, or sent what its listing does not allow; the message says
    what to do."""


class _TooLong(Exception):
    """A body went past the bytes it may have (internal: the caller words the error)."""


@dataclass(frozen=True)
class Deadlines:
    stall_s: float = 60.0  # --stall-timeout: no byte for this long ends a request
    min_rate: float = 100_000.0  # --min-rate, bytes/s: a body of N bytes gets stall_s + N / min_rate seconds

    def seconds(self, n_bytes: int) -> float:
        return self.stall_s + n_bytes / self.min_rate


def endpoint() -> str:
    """HF_ENDPOINT as set now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


class Clock:
    """The rate deadline of one body: after ``stall_s`` of grace, the bytes received (over every retry of
    this run) must keep up with ``min_rate``, so a body of N bytes ends within stall_s + N / min_rate
    seconds, and a drip-fed one as soon as it falls behind (whether its size is listed or not)."""

    def __init__(self, what: str, deadlines: Deadlines):
        self.what, self.deadlines = what, deadlines
        self.received = 0
        self.started = time.monotonic()

    def tick(self, n_bytes: int) -> None:
        self.received += n_bytes
        elapsed = time.monotonic() - self.started
        if elapsed > self.deadlines.seconds(self.received):
            raise PullError(
                f"{self.what}: {self.received} bytes in {elapsed:.1f} s, below --min-rate "
                f"{self.deadlines.min_rate:g} bytes/s; run the same command again to continue"
            )


def _one_line(text: str, limit: int = 200) -> str:
    return " ".join(text.split())[:limit]


class HubHttp:
    """GETs of one repo's URLs with ``headers`` (the token, the user-agent), bounded and timed."""

    def __init__(self, repo_id: str, headers: dict[str, str], deadlines: Deadlines):
        self.repo_id, self.deadlines = repo_id, deadlines
        self.headers = {**headers, "Accept-Encoding": "identity"}

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """Network failures, as one line each."""
        try:
            yield
        except OfflineModeIsEnabled:
            raise PullError(OFFLINE) from None
        except httpx2.TimeoutException:
            raise PullError(
                f"{self.repo_id}: {what}: no byte from {endpoint()} for {self.deadlines.stall_s:g} s "
                "(--stall-timeout); run the same command again to continue"
            ) from None
        except (httpx2.HTTPError, httpx2.InvalidURL) as exc:
            raise PullError(
                f"{self.repo_id}: {what}: network error talking to {endpoint()} ({type(exc).__name__}: "
                f"{_one_line(str(exc))}); run the same command again to continue"
            ) from None

    @contextlib.contextmanager
    def get(self, url: str, what: str, start: int = 0, end: int | None = None) -> Iterator[httpx2.Response]:
        """An open 200 or 206 response to a GET of ``url`` (bytes ``start``-``end`` asked for when not the
        whole body), after at most MAX_REDIRECTS redirects; any other answer is a PullError."""
        headers = dict(self.headers)
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end}"
        session = get_session()
        for _ in range(MAX_REDIRECTS + 1):
            if urlsplit(url).scheme not in ("http", "https"):
                raise PullError(f"{self.repo_id}: {what}: redirected to a URL that is not http(s): {url[:200]!r}")
            with session.stream(
                "GET", url, headers=headers, timeout=self.deadlines.stall_s, follow_redirects=False
            ) as r:
                if r.status_code in (301, 302, 303, 307, 308) and r.headers.get("Location"):
                    target = self._redirect(url, r.headers["Location"], what)
                    if urlsplit(target).netloc != urlsplit(url).netloc:  # a CDN: the token stays with the Hub
                        headers.pop("authorization", None)
                        headers.pop("Authorization", None)
                    url = target
                    continue
                if r.status_code not in (200, 206):
                    raise self.status_error(r, what)
                yield r
                return
        raise PullError(f"{self.repo_id}: {what}: more than {MAX_REDIRECTS} redirects")

    def _redirect(self, url: str, location: str, what: str) -> str:
        """The absolute URL a redirect's Location names, if it is one."""
        try:
            target = urljoin(url, location)
            urlsplit(target).port  # noqa: B018 (raises ValueError on a port that is not a number)
        except ValueError:
            raise PullError(f"{self.repo_id}: {what}: redirected to a malformed URL {location[:200]!r}") from None
        return target

    def status_error(self, response: httpx2.Response, what: str) -> PullError:
        """The Hub's refusal as one line that says what to do (huggingface_hub's error codes)."""
        code, status = response.headers.get("X-Error-Code"), response.status_code
        if code == "GatedRepo":
            return PullError(
                f"{self.repo_id} is gated: accept its terms on its Hub page, then set HF_TOKEN to a token of that "
                "account (or run `hf auth login`)"
            )
        if code == "RepoNotFound" or status == 401:
            return PullError(
                f"{self.repo_id}: no such repo on {endpoint()}, or it is private or gated: if you have access, set "
                "HF_TOKEN (or run `hf auth login`)"
            )
        if code == "RevisionNotFound":
            return PullError(f"{self.repo_id}: {what}: no such revision")
        if code == "EntryNotFound" or status == 404:
            return PullError(f"{self.repo_id}: {what}: not in the repo")
        return PullError(f"{self.repo_id}: {what}: the Hub answered {status}; run the same command again to continue")

    def _skip(self, response: httpx2.Response, start: int, what: str) -> int:
        """Bytes of the body before ``start``: all of them when the server ignored Range (200), those
        before ``start`` in a 206 from an earlier offset; a 206 from a later one is refused."""
        if response.status_code == 200 or not start:
            return start if response.status_code == 200 else 0
        given = response.headers.get("Content-Range", "")
        match = _CONTENT_RANGE.fullmatch(given.strip())
        if match is None or int(match[1]) > start:
            raise PullError(
                f"{self.repo_id}: {what}: asked for bytes from {start}, the Hub answered 206 with Content-Range "
                f"{given[:80]!r}; run the same command again to continue"
            )
        return start - int(match[1])

    def read(self, url: str, what: str, limit: int, start: int = 0, end: int | None = None) -> bytes:
        """A body in memory: bytes ``start``-``end`` (the first ``end - start + 1`` of what comes, however
        much the server sends), or a whole body of at most ``limit`` bytes (more: a PullError)."""
        room = limit if end is None else min(limit, end - start + 1)
        out = io.BytesIO()
        clock = Clock(f"{self.repo_id}: {what}", self.deadlines)
        with self.errors(what), self.get(url, what, start, end) as response:
            try:
                copy_body(response, out, self._skip(response, start, what), room, clock, lambda n: None)
            except _TooLong:
                if end is None:
                    raise PullError(
                        f"{self.repo_id}: {what}: the Hub sent more than {limit} bytes, the most pull reads for it"
                    ) from None
        return out.getvalue()

    def download(self, url: str, what: str, part: Path, size: int | None, cap: int, on_bytes: OnBytes) -> None:
        """The body into ``part``, continuing what it holds: up to ``size`` bytes when the listing gives
        one (a body going past it: the partial file deleted, a PullError), else one body of at most
        ``cap`` bytes. Dropped connections continue with a Range request."""
        held = part.stat().st_size if part.is_file() else 0
        want = size if size is not None else cap
        clock = Clock(f"{self.repo_id}: {what}", self.deadlines)
        try:
            with self.errors(what), open(part, "ab", buffering=0) as out:
                self._fill(url, what, out, held, size, want, clock, on_bytes)
        except _TooLong:
            part.unlink(missing_ok=True)
            if size is None:
                raise PullError(
                    f"{self.repo_id}: {what}: the Hub lists no size for it and sent more than {cap} bytes, the most "
                    "pull takes for such a file; the partial download deleted"
                ) from None
            raise PullError(
                f"{self.repo_id}: {what}: the Hub sent more than the {size} bytes it lists; stopped at {size} and "
                "deleted the partial download (run the same command again to retry)"
            ) from None

    def _fill(
        self,
        url: str,
        what: str,
        out: BinaryIO,
        held: int,
        size: int | None,
        want: int,
        clock: Clock,
        on_bytes: OnBytes,
    ) -> None:
        drops = 0
        while True:
            before = held
            try:
                with self.get(url, what, start=held) as response:
                    skip = self._skip(response, held, what)
                    copy_body(response, out, skip, want - held, clock, on_bytes)
                held = out.tell()
                if size is None or held >= size:
                    return
                ended: Exception | None = None  # the body ended short: a drop too
            except _RETRYABLE as exc:
                if size is None:
                    raise
                held, ended = out.tell(), exc  # what reached the file before the connection dropped
            drops = 0 if held > before else drops + 1
            if drops > RETRIES:
                if ended is not None:
                    raise ended  # worded by errors(): the network's own reason
                raise PullError(
                    f"{self.repo_id}: {what}: {held} of {size} bytes, the body ended short {drops} times in a row "
                    "without a byte; run the same command again to continue"
                )
            clock.tick(0)
            if drops:
                time.sleep(RETRY_PAUSE_S)
                clock.started += RETRY_PAUSE_S  # our own pause is not the Hub's slowness


def copy_body(response: httpx2.Response, out: BinaryIO, skip: int, room: int, clock: Clock, on_bytes: OnBytes) -> int:
    """Write the body after its first ``skip`` bytes, at most ``room`` bytes (one more: _TooLong, after
    writing up to ``room``); the rate deadline checked as bytes arrive. Returns the bytes written."""
    written = 0
    for chunk in response.iter_raw():
        on_bytes(len(chunk))
        clock.tick(len(chunk))
        if skip:
            cut = min(skip, len(chunk))
            chunk, skip = chunk[cut:], skip - cut
        if len(chunk) > room - written:
            out.write(chunk[: room - written])
            raise _TooLong
        out.write(chunk)
        written += len(chunk)
    return written
