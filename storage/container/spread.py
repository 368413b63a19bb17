"""Moving expert records between a container's part directories: spread, gather, mirror stage.

Every change is one target: the copies each record should have (primary first). Applying it is
resumable and never leaves a record unlisted or listed where it is not:

    1. the target and the part directories are written to a journal (``spread.journal.json``), and each
       new directory gets its marker (parts.py);
    2. per batch of records: copy each missing copy from a verified existing one (temp file, fsync,
       rename), read it back from the device and check its crc32c;
    3. switch the manifest (atomic replace) to list the batch where it now is;
    4. delete the copies the target no longer lists.

A kill anywhere leaves the manifest listing verified copies only; rerunning the same command finds the
journal, redoes the unfinished batch (a temp file is rewritten, a copy already there is re-checked) and
removes what a killed step left behind. The records' bytes, and so the fingerprint, never change.

One change at a time per container: ``layout_lock`` holds ``spread.lock`` in the container's directory
(an flock, storage/files/lockfile.py: a killed holder's lock is free again) from before the layout is
computed until the manifest is final, so a second spread, gather or mirror stage is refused in one line
naming the lock and its holder instead of copying beside the first.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.container.parts import HOME, PART_MARKER, Parts, RecordKey, save_parts, whole, with_copies, write_marker
from storage.container.reader import Container, expert_chunk_relpath, read_record_file
from storage.errors import CorruptDataError, FormatError, IncompatibleStateError, write_errors
from storage.files import lockfile
from storage.files.atomic import atomic_write_json, fsync_dir
from storage.files.buffers import aligned_empty
from storage.files.checksum import crc32c
from storage.files.page_cache import drop_cached, file_bypass, open_file, write_bypass
from storage.files.safe_read import read_json

JOURNAL = "spread.journal.json"
LOCK = "spread.lock"
BATCH_BYTES = 1 << 30  # records copied between manifest switches: a kill redoes at most this much
Target = dict[RecordKey, tuple[int, ...]]
Progress = Callable[[int], object]


@dataclass(frozen=True)
class Layout:
    """What a spread is asked to reach: the part directories (home first), their weights, and where
    every record goes."""

    dirs: tuple[Path, ...]
    weights: tuple[float, ...]
    target: Target


class EmptyPartError(FormatError):
    """A part directory whose weight is too small to get a single record."""


_held: dict[Path, int] = {}  # container directory -> how many layout_lock blocks of this process hold it


@contextmanager
def layout_lock(path: Path) -> Iterator[None]:
    """The container's layout lock for the block (re-entered freely within this process: the CLI takes it
    before measuring and computing a layout, apply_layout again); IncompatibleStateError naming the lock
    file and its holder when another process has it."""
    key = path.absolute()
    if key in _held:
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    try:
        fd = lockfile.acquire(key / LOCK)
    except lockfile.LockHeldError as exc:
        holder = f"pid {exc.pid}" if exc.pid is not None else "another process"
        raise IncompatibleStateError(
            f"{exc.path}: held by {holder}, another spread, gather or mirror stage of this container; "
            "rerun when it has finished"
        ) from None
    _held[key] = 1
    try:
        yield
    finally:
        del _held[key]
        lockfile.release(fd)


def current_parts(container: Container) -> Parts:
    return container.parts or whole(container.path, container.moe_layers, container.n_experts)


def stripe(weights: Sequence[float], keys: Iterable[RecordKey]) -> dict[RecordKey, int]:
    """Each record's part, in proportion to ``weights`` (smooth weighted round-robin over the records in
    file order: every layer, and every stretch of records, is split near the proportions)."""
    total = sum(weights)
    credit = [0.0] * len(weights)
    chosen = {}
    for key in keys:
        for i, weight in enumerate(weights):
            credit[i] += weight
        best = max(range(len(weights)), key=lambda i: credit[i])
        credit[best] -= total
        chosen[key] = best
    return chosen


def all_keys(container: Container) -> list[RecordKey]:
    return [(layer, expert) for layer in container.moe_layers for expert in range(container.n_experts)]


def spread_layout(container: Container, targets: Sequence[tuple[Path, float]], home_weight: float) -> Layout:
    """Records striped over home and ``targets`` by weight; part directories already in use are reused,
    mirror copies kept (a copy that becomes the primary is not doubled)."""
    parts = current_parts(container)
    dirs, weights = list(parts.dirs), list(parts.weights)
    weights[HOME] = home_weight
    indices = []
    for directory, weight in targets:
        directory = directory.absolute()
        if directory == container.path.absolute():
            raise FormatError(f"{directory}: is the container itself; name other directories with --to")
        if directory in dirs:
            weights[dirs.index(directory)] = weight
        else:
            dirs.append(directory)
            weights.append(weight)
        indices.append(dirs.index(directory))
    used = [HOME, *indices]
    primary = stripe([weights[i] if i in used else 0.0 for i in range(len(dirs))], all_keys(container))
    _check_every_part_gets_records(primary, [(dirs[i], weights[i], i) for i in indices], sum(weights[i] for i in used))
    target = {key: (p, *[m for m in parts.of(*key)[1:] if m != p]) for key, p in primary.items()}
    return Layout(tuple(dirs), tuple(weights), target)


def _check_every_part_gets_records(
    primary: dict[RecordKey, int], parts: Sequence[tuple[Path, float, int]], total: float
) -> None:
    """A named directory whose weight earns it no record is an error, never a spread that silently copies
    nothing there."""
    counts = Counter(primary.values())
    for directory, weight, i in parts:
        if counts[i] == 0:
            raise EmptyPartError(
                f"{directory}: its weight {weight:.3g} is {weight / total:.2%} of all the weights, too little for "
                f"one of the {len(primary)} records; give it a larger weight"
            )


def gather_layout(container: Container) -> Layout:
    """Every record back in the container's own directory, mirror copies dropped."""
    parts = current_parts(container)
    return Layout(parts.dirs, parts.weights, {key: (HOME,) for key in all_keys(container)})


# ---------------------------------------------------------------------------------------- applying
def apply_layout(
    container: Container, layout: Layout, progress: Progress = lambda n: None, batch_records: int | None = None
) -> dict[str, int]:
    """Move records until the container matches ``layout``; returns what was copied and deleted.
    Resumes a journal of the same directories left by a killed run (its target wins: weights measured
    again would otherwise move records twice)."""
    with layout_lock(container.path):
        return _apply_locked(container, _resume(container, layout), progress, batch_records)


def _apply_locked(
    container: Container, layout: Layout, progress: Progress, batch_records: int | None
) -> dict[str, int]:
    content = container.content_hash
    atomic_write_json(container.path / JOURNAL, _journal_json(layout))
    for directory in layout.dirs[1:]:
        with write_errors(directory, "the part marker"):
            write_marker(directory, content)
    parts = Parts(container.path, layout.dirs, layout.weights, current_parts(container).copies)
    save_parts(parts, content)
    batch = batch_records or max(1, BATCH_BYTES // container.layout.record_bytes)
    pending = [key for key, where in layout.target.items() if parts.of(*key) != where]
    copied = deleted = 0
    for start in range(0, len(pending), batch):
        keys = pending[start : start + batch]
        copied += sum(_copy_missing(container, parts, key, layout.target[key], progress) for key in keys)
        before = parts
        parts = with_copies(parts, {key: layout.target[key] for key in keys})
        save_parts(parts, content)  # the switch: from here the new copies are the listed ones
        deleted += sum(_delete_dropped(container, before, key, layout.target[key]) for key in keys)
    deleted += _sweep(container, parts)
    parts = _drop_empty_parts(parts, content)
    save_parts(parts, content)
    (container.path / JOURNAL).unlink(missing_ok=True)
    return {"records_copied": copied, "records_deleted": deleted, "parts": len(parts.dirs)}


def _journal_json(layout: Layout) -> dict[str, object]:
    return {
        "dirs": [str(d) for d in layout.dirs],
        "weights": list(layout.weights),
        "target": {f"{layer}/{expert}": list(where) for (layer, expert), where in layout.target.items()},
    }


def _resume(container: Container, layout: Layout) -> Layout:
    path = container.path / JOURNAL
    if not path.exists():
        return layout
    data = read_json(path, 256 << 20, "spread journal")
    try:
        dirs = tuple(Path(d) for d in data["dirs"])
        weights = tuple(float(w) for w in data["weights"])
        target = {_key(k): tuple(int(p) for p in v) for k, v in data["target"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"{path}: unreadable spread journal ({exc!r:.120})") from None
    gathering = all(where == (HOME,) for where in layout.target.values())
    if dirs != layout.dirs or gathering or target.keys() != layout.target.keys():
        return layout  # another request: the manifest is consistent whatever the journal said
    return Layout(dirs, weights, target)


def _key(text: str) -> RecordKey:
    layer, expert = text.split("/")
    return int(layer), int(expert)


def _copy_missing(
    container: Container, parts: Parts, key: RecordKey, where: tuple[int, ...], progress: Progress
) -> int:
    missing = [p for p in where if p not in parts.of(*key)]
    if not missing:
        return 0
    record = _verified_source(container, parts, key)
    for part in missing:
        _write_copy(container, parts.root(part) / expert_chunk_relpath(*key), key, record)
    progress(1)
    return len(missing)


def _verified_source(container: Container, parts: Parts, key: RecordKey) -> np.ndarray:
    """The record's bytes from a listed copy that matches its crc32c (another copy if one is bad)."""
    buffer = aligned_empty(container.layout.record_bytes)
    problems = []
    for part in parts.of(*key):
        path = parts.root(part) / expert_chunk_relpath(*key)
        try:
            data = read_record_file(path, *key, buffer, container.layout.record_bytes)
        except CorruptDataError as exc:
            problems.append(str(exc))
            continue
        if crc32c(data) == container.expert_checksum(*key):
            return buffer
        problems.append(f"layer {key[0]} expert {key[1]}: checksum mismatch in {path}")
    raise CorruptDataError("; ".join(problems) + " (not copied: no good copy to copy from)")


def _write_copy(container: Container, path: Path, key: RecordKey, record: np.ndarray) -> None:
    """The record at ``path`` (temp, fsync, rename), then read back from the device and checked."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with write_errors(path, "an expert record"):
        fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, write_bypass(), 0o644)
        try:
            view, done = memoryview(record), 0  # type: ignore[arg-type]  # numpy: a Buffer only on >= 3.12
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    _drop_cached(path)
    back = aligned_empty(container.layout.record_bytes)
    data = read_record_file(path, *key, back, container.layout.record_bytes, file_bypass(path))
    if crc32c(data) != container.expert_checksum(*key):
        raise CorruptDataError(f"layer {key[0]} expert {key[1]}: the copy written to {path} reads back wrong")


def _drop_cached(path: Path) -> None:
    """The page cache's copy dropped, so a buffered read-back comes from the device. Without fadvise (macOS)
    the read-back past the cache (F_NOCACHE) still checks the bytes, perhaps from the cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_cached(fd)
    finally:
        os.close(fd)


def _delete_dropped(container: Container, before: Parts, key: RecordKey, where: tuple[int, ...]) -> int:
    dropped = [p for p in before.of(*key) if p not in where]
    for part in dropped:
        (before.root(part) / expert_chunk_relpath(*key)).unlink(missing_ok=True)
    return len(dropped)


def _sweep(container: Container, parts: Parts) -> int:
    """Remove record files (and temp files) a killed run left where the manifest does not list them."""
    removed = 0
    for key, where in parts.records():
        relpath = expert_chunk_relpath(*key)
        for part in range(len(parts.dirs)):
            path = parts.root(part) / relpath
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.unlink(missing_ok=True)
            if part not in where and path.exists():
                path.unlink()
                removed += 1
    return removed


def _drop_empty_parts(parts: Parts, content: str) -> Parts:
    """Part directories that hold no record any more leave the manifest (their marker and empty record
    folders are removed); the others are renumbered in order."""
    used = sorted({HOME} | {p for _, where in parts.records() for p in where})
    for part in range(1, len(parts.dirs)):
        if part not in used:
            _remove_part_files(parts.root(part))
    remap = {old: new for new, old in enumerate(used)}
    copies = {layer: tuple(tuple(remap[p] for p in where) for where in row) for layer, row in parts.copies.items()}
    return Parts(parts.home, tuple(parts.dirs[p] for p in used), tuple(parts.weights[p] for p in used), copies)


def _remove_part_files(directory: Path) -> None:
    experts = directory / "experts"
    if experts.is_dir():
        for folder in sorted((p for p in experts.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            if not any(folder.iterdir()):
                folder.rmdir()
        if not any(experts.iterdir()):
            experts.rmdir()
    (directory / PART_MARKER).unlink(missing_ok=True)


def describe(parts: Parts, record_bytes: int) -> str:
    """One line per part: directory, weight, records (primary), copies."""
    lines = []
    primaries = parts.primary_counts()
    held = [0] * len(parts.dirs)
    for _, where in parts.records():
        for p in where:
            held[p] += 1
    for p, directory in enumerate(parts.dirs):
        lines.append(
            f"{parts.label(p):>7}  {directory}  weight {parts.weights[p]:.3g}  "
            f"{primaries[p]} records primary, {held[p]} held ({held[p] * record_bytes / 2**30:.2f} GiB)"
        )
    return "\n".join(lines)


def journal_summary(container: Container) -> str | None:
    path = container.path / JOURNAL
    if not path.exists():
        return None
    return json.dumps(read_json(path, 256 << 20, "spread journal").get("dirs"))
