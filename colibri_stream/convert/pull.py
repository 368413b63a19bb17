"""`colibri-stream pull REPO_ID`: from the Hugging Face Hub to a container, needing the container's disk
plus a couple of shards, not the whole checkpoint.

In order: resolve the revision to a commit; fetch config.json and refuse a config the engine does not
support (nothing else fetched yet); fetch the tokenizer files and the shard index; report `plan`'s verdict
for this machine (``plan_only`` stops here, "does not fit" stops unless ``force``); fetch the shard
headers (Range requests); check free space; then download shards (``in_flight`` on disk at once), verify
each against the Hub's sha256, convert it (convert/pull_convert.py), journal it and delete it. The same
command after any interruption continues from the journal (convert/pull_state.py).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from colibri_stream.checkpoint.files import INDEX_FILE
from colibri_stream.convert.converter import ConvertOptions
from colibri_stream.convert.hf_source import COPIED_FILES
from colibri_stream.convert.pull_convert import StreamingConversion
from colibri_stream.convert.pull_http import Deadlines
from colibri_stream.convert.pull_hub import HubClient, PullError, RepoSnapshot
from colibri_stream.convert.pull_queue import DownloadQueue
from colibri_stream.convert.pull_source import HubSource, shard_names
from colibri_stream.convert.pull_space import Need, check_free_space, complete_container, container_bytes, tree_bytes
from colibri_stream.convert.pull_state import (
    PullJournal,
    load,
    load_headers,
    save,
    save_headers,
    state_dir,
    stray_carries,
)
from colibri_stream.errors import BudgetError
from colibri_stream.planning.budget import StoreOptions, store_plan
from colibri_stream.planning.geometry import ModelGeometry, geometry_from_config, read_json_config
from colibri_stream.planning.placement import verdict
from storage.errors import IncompatibleStateError

Report = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class PullOptions:
    repo_id: str
    out: Path
    revision: str | None = None  # None: main (or, resuming, the commit the journal pins)
    download_dir: Path | None = None  # None: OUT.download beside the container
    target: ConvertOptions = field(default_factory=ConvertOptions)
    in_flight: int = 2  # shards on disk at once (downloading, waiting or converting)
    keep_download: bool = False
    force: bool = False  # pull even when the plan says "does not fit"
    plan_only: bool = False
    space_check: bool = True
    store: StoreOptions = field(default_factory=lambda: StoreOptions(ram="auto"))
    dtype: str = "float32"
    progress: bool = True
    deadlines: Deadlines = field(default_factory=Deadlines)  # --stall-timeout, --min-rate

    @property
    def downloads(self) -> Path:
        return self.download_dir or self.out.with_name(self.out.name + ".download")


class Pull:
    def __init__(self, options: PullOptions, report: Report, client: HubClient | None = None):
        self.options = options
        self.report = report
        self.client = client or HubClient(options.repo_id, deadlines=options.deadlines)

    def run(self) -> dict[str, Any]:
        o = self.options
        started = time.monotonic()
        finished = self._finished()
        if finished is not None:
            return finished
        journal = load(o.out)
        if journal is not None and not journal.matches(o.repo_id, asdict(o.target)):
            raise IncompatibleStateError(
                f"{o.out}: holds an unfinished pull of {journal.repo_id} or with other options; use a new --out"
            )
        snapshot = self.client.snapshot(journal.commit if journal and o.revision is None else o.revision)
        if journal is not None and snapshot.commit != journal.commit:
            raise IncompatibleStateError(
                f"{o.out}: holds an unfinished pull of commit {journal.commit[:12]}, not {snapshot.commit[:12]}; "
                "use a new --out"
            )
        geometry = self._check_config(snapshot)  # config.json only: an unsupported model stops here
        self._fetch_side_files(snapshot)
        shards = shard_names(o.downloads, snapshot)
        side = [snapshot.files[name].size for name in COPIED_FILES if name in snapshot.files]
        estimate = container_bytes(geometry, o.target.quant_group_size, side)
        if not self._plan(geometry, snapshot, shards, estimate):
            return {"status": "planned", "repo": o.repo_id, "commit": snapshot.commit}
        headers = self._headers(snapshot, shards)
        source = HubSource(o.downloads, snapshot, headers)
        journal = journal or PullJournal(o.repo_id, snapshot.commit, asdict(o.target))
        save(o.out, journal)
        conversion = StreamingConversion(source, o.out, o.target, journal)
        todo = [s for s in conversion.shards if s not in journal.converted]
        if o.space_check:
            self._check_space(snapshot, todo, estimate)
        for stray in stray_carries(o.out, journal):
            stray.unlink()
        downloaded = self._convert(conversion, snapshot, todo, journal)
        conversion.publish()
        shutil.rmtree(state_dir(o.out))
        if not o.keep_download:
            shutil.rmtree(o.downloads, ignore_errors=True)
        result = {
            "status": "pulled",
            "repo": o.repo_id,
            "commit": snapshot.commit,
            "path": str(o.out),
            "shards": len(conversion.shards),
            "resumed_shards": len(conversion.shards) - len(todo),
            "downloaded_bytes": downloaded,
            "seconds": round(time.monotonic() - started, 3),
            "run": f"colibri-stream chat {o.out}",
        }
        return result

    def _finished(self) -> dict[str, Any] | None:
        """The result when OUT already holds a finished pull; a refusal when it holds something else."""
        out = self.options.out
        if not out.exists() or (state_dir(out) / "journal.json").exists() or not any(out.iterdir()):
            return None
        if complete_container(out):
            return {"status": "already pulled", "path": str(out), "run": f"colibri-stream chat {out}"}
        if state_dir(out).exists():
            return None  # headers fetched, journal not written yet
        raise IncompatibleStateError(f"{out}: exists and is not an unfinished pull; use a new --out")

    def _check_config(self, snapshot: RepoSnapshot) -> ModelGeometry:
        if "config.json" not in snapshot.files:
            raise PullError(f"{snapshot.repo_id}: no config.json in the repo")
        path = self.client.download(snapshot, "config.json", self.options.downloads)
        return geometry_from_config(read_json_config(path), self.options.target, "checkpoint", path.parent)

    def _fetch_side_files(self, snapshot: RepoSnapshot) -> None:
        for name in (*COPIED_FILES, INDEX_FILE):
            if name != "config.json" and name in snapshot.files:
                self.client.download(snapshot, name, self.options.downloads)

    def _plan(self, geometry: ModelGeometry, snapshot: RepoSnapshot, shards: list[str], estimate: int) -> bool:
        """Report the verdict; False when the pull stops here (--plan-only)."""
        o = self.options
        placement = store_plan(o.store, geometry, o.dtype)[1]
        result = verdict(placement)
        sizes = sorted((snapshot.files[s].size for s in shards), reverse=True)
        self.report(
            {
                "event": "plan",
                "repo": o.repo_id,
                "commit": snapshot.commit,
                "model": geometry.description,
                "container_bytes": estimate,
                "download_bytes": sum(sizes),
                "shards": len(shards),
                "peak_disk_bytes": estimate + sum(sizes[: o.in_flight]),
                "fits": result.fits,
                "verdict": result.line,
            }
        )
        if not result.fits and not o.force:
            raise BudgetError(f"{result.line} (--force pulls it anyway)")
        return not o.plan_only

    def _headers(self, snapshot: RepoSnapshot, shards: list[str]) -> dict[str, bytes]:
        headers = load_headers(self.options.out)
        if headers is None or set(headers) != set(shards):
            headers = {name: self.client.header(snapshot, name) for name in shards}
            save_headers(self.options.out, headers)
        return headers

    def _check_space(self, snapshot: RepoSnapshot, todo: list[str], estimate: int) -> None:
        o = self.options
        sizes = sorted((snapshot.files[s].size for s in todo), reverse=True)
        shards = sum(sizes) if o.keep_download else sum(sizes[: o.in_flight])
        partial = sum(tree_bytes(o.downloads / s) for s in todo)
        written = tree_bytes(o.out)
        check_free_space(
            [
                Need(o.out, max(0, estimate - written), "the container, estimated"),
                Need(o.downloads, max(0, shards - partial), f"the {min(len(todo), o.in_flight)} largest shards"),
            ]
        )

    def _convert(
        self, conversion: StreamingConversion, snapshot: RepoSnapshot, todo: list[str], journal: PullJournal
    ) -> int:
        o = self.options
        sizes = {s: snapshot.files[s].size for s in conversion.shards}
        done = sum(sizes.values()) - sum(sizes[s] for s in todo)
        queue = DownloadQueue(self.client, snapshot, o.downloads, todo, o.in_flight, self._warn)
        started = time.monotonic()
        with tqdm(
            total=sum(sizes.values()), initial=done, unit="B", unit_scale=True, desc="pull", disable=not o.progress
        ) as bar:
            converted = 0
            counted = 0
            for name, path in queue:
                journal.downloaded_bytes += queue.downloaded - counted  # saved with the shard's results
                counted = queue.downloaded
                conversion.convert_shard(name, path)
                queue.release(name, delete=not o.keep_download)
                converted += sizes[name]
                bar.update(sizes[name])
                elapsed = max(time.monotonic() - started, 1e-9)
                bar.set_postfix_str(
                    f"download {queue.downloaded / elapsed / 1e6:.1f} MB/s, "
                    f"convert {converted / elapsed / 1e6:.1f} MB/s"
                )
                self.report(
                    {
                        "event": "shard",
                        "shard": name,
                        "converted_bytes": done + converted,
                        "downloaded": queue.downloaded,
                    }
                )
        if not conversion.complete():
            raise PullError(f"{o.repo_id}: every shard converted but records are missing (a bug: please report it)")
        return queue.downloaded

    def _warn(self, line: str) -> None:
        self.report({"event": "warning", "message": line})
