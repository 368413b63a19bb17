"""What a `pull` has done, kept in the destination so the same command continues after Ctrl-C, kill -9,
a network error or a full disk.

``OUT/.pull/`` holds the journal and the carry; both go when the container is published, so a finished
pull leaves exactly the files `convert` writes. The journal pins the repo, the commit and the options (the
shard headers, fetched once by Range requests, sit beside it), and lists the shards converted so far with every
result the container's attributes need (dense entries, per-record crc32c, which expert arrays exist).
It is replaced atomically (storage/files/atomic.py) after each shard's writes and before that shard is
deleted, so at any instant either the shard is still on disk or its results are in the journal.

The carry: tensors a converted shard held for records it could not finish (an expert whose up_proj is in
the next shard, an FP8 weight whose scale is), copied into one small safetensors file per journal
version, so the shard can be deleted and nothing is downloaded twice.
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from storage.container.reader import read_json
from storage.errors import IncompatibleStateError
from storage.files.atomic import atomic_write_json

STATE_DIR = ".pull"
JOURNAL = "journal.json"
HEADERS = "headers.json"  # shard -> its safetensors header, written once (DeepSeek-V3's: ~10 MB)
VERSION = 1


@dataclass
class PullJournal:
    repo_id: str
    commit: str
    options: dict[str, Any]
    converted: list[str] = field(default_factory=list)  # shards whose every record is written
    dense: dict[str, Any] = field(default_factory=dict)  # engine name -> attribute entry
    experts: dict[str, dict[str, int]] = field(default_factory=dict)  # layer -> expert -> crc32c
    arrays: list[int] = field(default_factory=list)  # expert arrays created (once: creating wipes one)
    carry: str | None = None  # the carry file of this version, in the state directory
    carried: list[str] = field(default_factory=list)  # tensors in it
    downloaded_bytes: int = 0  # body bytes received over every run (the resume tests' measure)

    def matches(self, repo_id: str, options: dict[str, Any]) -> bool:
        return self.repo_id == repo_id and self.options == options


def state_dir(out: Path) -> Path:
    return out / STATE_DIR


def load(out: Path) -> PullJournal | None:
    path = state_dir(out) / JOURNAL
    if not path.is_file():
        return None
    data = read_json(path, "pull journal")
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise IncompatibleStateError(f"{path}: not a pull journal of this version; use a new --out")
    data.pop("version")
    try:
        return PullJournal(**data)
    except TypeError:
        raise IncompatibleStateError(f"{path}: malformed pull journal; use a new --out") from None


def save(out: Path, journal: PullJournal) -> None:
    state_dir(out).mkdir(parents=True, exist_ok=True)
    atomic_write_json(state_dir(out) / JOURNAL, {"version": VERSION, **asdict(journal)})


def save_headers(out: Path, headers: dict[str, bytes]) -> None:
    state_dir(out).mkdir(parents=True, exist_ok=True)
    encoded = {name: base64.b64encode(raw).decode() for name, raw in headers.items()}
    atomic_write_json(state_dir(out) / HEADERS, encoded)


def load_headers(out: Path) -> dict[str, bytes] | None:
    path = state_dir(out) / HEADERS
    if not path.is_file():
        return None
    data = read_json(path, "pull shard headers")
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise IncompatibleStateError(f"{path}: malformed shard headers; use a new --out")
    return {name: base64.b64decode(raw) for name, raw in data.items()}


def stray_carries(out: Path, journal: PullJournal) -> list[Path]:
    """Carry files no journal version points to (written before a crash, or superseded)."""
    return [p for p in state_dir(out).glob("carry-*.safetensors") if p.name != journal.carry]
