"""Shards downloaded ahead of the conversion, at most ``slots`` on disk at once.

A slot is taken when a shard's download starts and given back when the shard is deleted after its
conversion, so with 2 slots one shard converts while the next downloads, and the disk holds the
container plus at most two shards. Each download is checked against the Hub's size and sha256 before it
is handed on: a mismatch is deleted and fetched again (a few times, then a one-line error), never
converted. Downloads run in daemon threads so Ctrl-C is not held up by one in progress (its partial file
stays and the next run continues it).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

from colibri_stream.convert.pull_hub import HubClient, PullError, RepoSnapshot

ATTEMPTS = 3  # downloads of one shard whose checksum does not match, before giving up


class DownloadQueue:
    def __init__(
        self,
        client: HubClient,
        snapshot: RepoSnapshot,
        local: Path,
        names: list[str],
        slots: int,
        warn: Callable[[str], None],
    ):
        if slots < 1:
            raise PullError(f"--in-flight must be at least 1, got {slots}")
        self.client, self.snapshot, self.local = client, snapshot, local
        self.pending = deque(names)
        self.slots = slots
        self.warn = warn
        self.started: deque[tuple[str, Future[Path]]] = deque()
        self.held = 0  # slots taken: shards downloading, or downloaded and not yet released
        self._lock = threading.Lock()
        self.downloaded = 0  # body bytes received by this run
        self.refetched: list[str] = []

    def _add(self, n: int) -> None:
        with self._lock:
            self.downloaded += n

    def __iter__(self) -> Iterator[tuple[str, Path]]:
        """(shard, verified path) in order; the caller calls ``release`` once it no longer needs the file."""
        self._fill()
        while self.started:
            name, future = self.started.popleft()
            yield name, future.result()

    def release(self, name: str, delete: bool) -> None:
        """A converted shard: delete it (or keep it), freeing its slot for the next download."""
        if delete:
            self.client.delete(self.local, name)
        self.held -= 1
        self._fill()

    def _fill(self) -> None:
        while self.pending and self.held < self.slots:
            name = self.pending.popleft()
            future: Future[Path] = Future()
            threading.Thread(target=self._run, args=(name, future), daemon=True, name=f"pull {name}").start()
            self.started.append((name, future))
            self.held += 1

    def _run(self, name: str, future: Future[Path]) -> None:
        try:
            future.set_result(self._fetch(name))
        except BaseException as exc:  # handed to the consumer, who raises it
            future.set_exception(exc)

    def _fetch(self, name: str) -> Path:
        expected = self.snapshot.files[name]
        why = ""
        for _ in range(ATTEMPTS):
            path = self.client.fetch_shard(self.snapshot, name, self.local, self._add)
            why = expected.check(path) or ""
            if not why:
                return path
            self.warn(f"{name}: {why}; deleted, downloading it again")
            self.refetched.append(name)
            self.client.delete(self.local, name)
        raise PullError(f"{name}: {why} after {ATTEMPTS} downloads; not converted (run again to retry)")
