"""Where a container's expert records live when it is spread over several directories (one per device).

A whole container keeps every record in its own directory and has no manifest: that path is read exactly
as before. A spread (or mirrored) one has ``DST/parts.json``:

    {"format": "colibri-stream-parts", "version": 1, "content_sha256": <the container's>,
     "parts": [{"dir": "/mnt/ssd2/dsv3", "weight": 3.1e9}, ...],   # part 1.. (part 0 is DST itself)
     "home_weight": 2.0e9,
     "records": {"<layer>": [[part, ...] per expert]}}             # copies of the record, primary first

Each part directory holds its records at the same relative paths as DST (``experts/layer_NNN/c/<e>/0``)
and a marker ``colibri-part.json`` naming the container's content hash, so a directory of another model
(or of another container) is refused instead of read. The manifest lives beside zarr's metadata, not in
the container's attributes: the weights' fingerprint (checkpoint/fingerprint.py) and zarr's view of the
arrays do not change when records move. It is replaced atomically (temp + rename): a record is listed
where it is, always (spread.py copies and verifies before it switches, and deletes only after).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.errors import FormatError
from storage.files.atomic import atomic_write_json
from storage.files.safe_read import read_json

PARTS_FILE = "parts.json"
PART_MARKER = "colibri-part.json"
PARTS_FORMAT = "colibri-stream-parts"
PARTS_VERSION = 1
MARKER_FORMAT = "colibri-stream-part"
MAX_PARTS = 64
MAX_MANIFEST_BYTES = 256 << 20
HOME = 0  # part index of the container's own directory

RecordKey = tuple[int, int]  # (layer, expert)


class PartError(FormatError):
    """A part directory that is missing, unreadable, or belongs to another container."""


@dataclass(frozen=True)
class Parts:
    """Copies of every record: ``copies[layer][expert]`` lists part indices, primary first."""

    home: Path
    dirs: tuple[Path, ...]  # dirs[0] is ``home``
    weights: tuple[float, ...]  # relative read speed per part (bytes/s when measured)
    copies: dict[int, tuple[tuple[int, ...], ...]]

    def root(self, part: int) -> Path:
        return self.dirs[part]

    def of(self, layer: int, expert: int) -> tuple[int, ...]:
        return self.copies[layer][expert]

    def primary(self, layer: int, expert: int) -> int:
        return self.copies[layer][expert][0]

    def records(self) -> Iterator[tuple[RecordKey, tuple[int, ...]]]:
        for layer, row in self.copies.items():
            for expert, where in enumerate(row):
                yield (layer, expert), where

    def primary_counts(self) -> list[int]:
        """Records whose primary copy is on each part."""
        counts = [0] * len(self.dirs)
        for _, where in self.records():
            counts[where[0]] += 1
        return counts

    @property
    def mirrored(self) -> int:
        return sum(len(where) > 1 for _, where in self.records())

    @property
    def is_whole(self) -> bool:
        """Every record only at home: the manifest says nothing a whole container does not."""
        return all(where == (HOME,) for _, where in self.records())

    def label(self, part: int) -> str:
        return "home" if part == HOME else f"part {part}"

    def device_name(self, part: int) -> str:
        """How errors and stats name a part: its directory."""
        return str(self.dirs[part])


def whole(home: Path, layers: Sequence[int], n_experts: int, home_weight: float = 1.0) -> Parts:
    return Parts(home, (home,), (home_weight,), {layer: ((HOME,),) * n_experts for layer in layers})


def manifest_path(home: Path) -> Path:
    return home / PARTS_FILE


def load_parts(home: Path, layers: Sequence[int], n_experts: int, content: str) -> Parts | None:
    """The container's parts, None for a whole container (no manifest). Every part directory is checked
    here (exists, readable, its marker names this container): one PartError naming the directory."""
    path = manifest_path(home)
    if not path.exists():
        return None
    data = read_json(path, MAX_MANIFEST_BYTES, "parts manifest")
    parts = _parse(data, home, layers, n_experts, path)
    if data.get("content_sha256") != content:
        raise PartError(f"{path}: parts manifest of another container (content hash differs)")
    for part in range(1, len(parts.dirs)):
        check_part_dir(parts.dirs[part], content)
    return parts


def _parse(data: Any, home: Path, layers: Sequence[int], n_experts: int, path: Path) -> Parts:
    if not isinstance(data, dict) or data.get("format") != PARTS_FORMAT or data.get("version") != PARTS_VERSION:
        raise FormatError(f"{path}: not a parts manifest (format/version)")
    try:
        listed = data["parts"]
        dirs = (home, *(Path(entry["dir"]) for entry in listed))
        weights = (float(data.get("home_weight", 1.0)), *(float(entry.get("weight", 1.0)) for entry in listed))
        table = data["records"]
        copies = {layer: tuple(tuple(int(p) for p in where) for where in table[str(layer)]) for layer in layers}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"{path}: malformed parts manifest ({exc!r:.120})") from None
    if len(dirs) > MAX_PARTS or not all(d.is_absolute() for d in dirs[1:]) or not all(w > 0 for w in weights):
        raise FormatError(f"{path}: parts must be at most {MAX_PARTS} absolute directories with weights > 0")
    for layer, row in copies.items():
        bad = len(row) != n_experts or any(
            not where or len(set(where)) != len(where) or not all(0 <= p < len(dirs) for p in where) for where in row
        )
        if bad:
            raise FormatError(f"{path}: layer {layer} must list {n_experts} records, each on distinct known parts")
    return Parts(home, dirs, weights, copies)


def check_part_dir(directory: Path, content: str) -> None:
    """A part directory that is there, readable, and this container's (its marker)."""
    if not directory.is_dir():
        state = "is not a directory" if directory.exists() else "is missing"
        raise PartError(f"part directory {directory} {state} (a device of this spread container; mount it)")
    if not os.access(directory, os.R_OK | os.X_OK):
        raise PartError(f"part directory {directory} is unreadable (permission denied)")
    marker = directory / PART_MARKER
    try:
        data = read_json(marker, 1 << 16, "part marker")
    except FileNotFoundError:
        raise PartError(f"part directory {directory} has no {PART_MARKER}: not a part of this container") from None
    except PermissionError:
        raise PartError(f"part directory {directory} is unreadable (permission denied)") from None
    if not isinstance(data, dict) or data.get("content_sha256") != content:
        raise PartError(f"part directory {directory} belongs to another container (content hash differs)")


def write_marker(directory: Path, content: str) -> None:
    """Claim ``directory`` for this container (refused when it holds another one's part)."""
    marker = directory / PART_MARKER
    if marker.exists():
        check_part_dir(directory, content)
        return
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_json(marker, {"format": MARKER_FORMAT, "content_sha256": content})


def save_parts(parts: Parts, content: str) -> None:
    """Replace the manifest atomically; a whole container's manifest is removed instead."""
    path = manifest_path(parts.home)
    if parts.is_whole and len(parts.dirs) == 1:
        path.unlink(missing_ok=True)
        return
    atomic_write_json(
        path,
        {
            "format": PARTS_FORMAT,
            "version": PARTS_VERSION,
            "content_sha256": content,
            "home_weight": parts.weights[HOME],
            "parts": [{"dir": str(d), "weight": w} for d, w in zip(parts.dirs[1:], parts.weights[1:], strict=True)],
            "records": {str(layer): [list(where) for where in row] for layer, row in sorted(parts.copies.items())},
        },
    )


def with_copies(parts: Parts, changes: dict[RecordKey, tuple[int, ...]]) -> Parts:
    """``parts`` with the records in ``changes`` listed on new parts."""
    copies = {layer: list(row) for layer, row in parts.copies.items()}
    for (layer, expert), where in changes.items():
        copies[layer][expert] = where
    return Parts(parts.home, parts.dirs, parts.weights, {layer: tuple(row) for layer, row in copies.items()})


def with_dirs(parts: Parts, dirs: Sequence[Path], weights: Sequence[float]) -> Parts:
    """``parts`` with part directories appended or reweighted (records keep their part indices)."""
    return Parts(parts.home, tuple(dirs), tuple(weights), parts.copies)
