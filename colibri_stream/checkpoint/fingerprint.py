"""What identifies a model's state files, in one place.

Two scopes, on purpose: a KV log belongs to the weights, config *and* tokenizer (``model_fingerprint``,
also naming the session directory); a usage history belongs to the routed experts and the config
only (``container_fingerprint``), so re-tokenising does not throw away what the router taught the
hot store.

The weights are covered, not just their shapes: DeepSeek-V3 and R1 share every shape and shard size,
and a session of one continued by the other would resume silently into wrong tokens. Both kinds of
model say what their weights are without reading them whole:
- a container stores a content hash made at convert time from the checksum of every stored byte
  (``storage.container.write.content_sha256``);
- an HF directory is hashed from each shard's safetensors header, the first, middle and last
  ``SPAN_BYTES`` of every tensor's data (a tensor of up to three spans is read whole), and one span
  every ``GRID_STRIDE`` bytes of the shard: bounded reads (about 1/1000 of the weights plus three pages
  per tensor), and any real change of a tensor (a fine-tune, another seed) changes its samples. An edit
  of bytes outside every span (inside a tensor larger than three spans, away from the grid) is not
  seen: that is the limit, stated in the README.
The HF result is cached per shard identity (device, inode, size, mtime and ctime in ns: a replacement
with the same size and a restored mtime still has another inode or ctime, and no utime call sets a
ctime), so only the first open of a checkpoint pays for the samples. A shard changed in the last
``RACY_NS`` before the hash, or while it was hashed, is not cached: a timestamp of coarse granularity
could not tell a later edit apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path
from typing import Any

from colibri_stream.paths import user_cache_dir
from storage.container.reader import Container, is_container
from storage.container.write import CONTENT_KEY, content_sha256
from storage.files.atomic import atomic_write_json
from storage.files.safe_read import open_regular, read_bounded

SPAN_BYTES = 4096  # a page: reading one costs what reading 64 bytes of it would
GRID_STRIDE = 4 << 20  # one span per this many bytes of a shard, whatever the tensors
RACY_NS = 1_000_000_000  # shards changed this recently are hashed but not cached (1 s timestamps)
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
_CACHE_ENTRIES = 256  # entries kept in the digest cache (the newest)
_TOKENIZER = "tokenizer.json"
_MAX_SMALL_FILE_BYTES = 512 << 20  # config.json and tokenizer.json (real tokenizers: 5-30 MB)


def model_fingerprint(path: str | Path) -> str:
    """A checkpoint directory or container: its config, tokenizer and weights (see the module doc)."""
    path = Path(path)
    if is_container(path):
        container = Container(path)
        config = json.dumps(container.model_config, sort_keys=True).encode()
        weights = container_weights_sha256(container)
    else:
        config = _small_file(path / "config.json", "the model config")
        weights = hf_weights_sha256(path)
    tokenizer = _small_file(path / _TOKENIZER, "the tokenizer")
    digest = hashlib.sha256()
    for part in (config, hashlib.sha256(tokenizer).hexdigest().encode(), weights.encode()):
        digest.update(len(part).to_bytes(8, "little") + part)  # length-prefixed: no ambiguous joins
    return digest.hexdigest()[:32]


def _small_file(path: Path, what: str) -> bytes:
    """The file's bytes, b"" when it is absent; a directory, FIFO or oversized file is a FormatError
    naming it (never a blocked open or an endless read)."""
    if not path.exists():
        return b""
    return read_bounded(path, _MAX_SMALL_FILE_BYTES, what)


def container_weights_sha256(container: Container) -> str:
    """The content hash published at convert time; a container converted before it was published gets
    the same value computed from its stored checksums."""
    stored = container.attrs.get(CONTENT_KEY)
    return stored if isinstance(stored, str) else content_sha256(container.attrs)


def container_fingerprint(container: Container) -> str:
    """A container's config and expert checksums: what a usage history was learned on."""
    payload = json.dumps({"config": container.model_config, "experts": container.attrs["experts"]}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------------ HF directories


def hf_weights_sha256(path: Path) -> str:
    """Hash of every shard's header and sampled spans, cached by the shards' identity."""
    shards = sorted(path.glob("*.safetensors"))
    identities = _shard_identities(shards)
    key = _cache_key(path, identities)
    entries = _read_cache()
    if isinstance(entries.get(key), str):
        return entries[key]
    started = time.time_ns()
    digest = hashlib.sha256()
    for shard in shards:
        digest.update(shard.name.encode() + b"\0" + shard_digest(shard))
    value = digest.hexdigest()
    if shards and _settled(identities, started) and _shard_identities(shards) == identities:
        entries.pop(key, None)
        _write_cache({**entries, key: value})
    return value


def shard_digest(shard: Path) -> bytes:
    """sha256 of a safetensors file's header and its spans (``sampled_spans``). Reads at most the header
    plus three ``SPAN_BYTES`` per tensor and one per ``GRID_STRIDE`` of the file. A malformed file is
    hashed as far as it parses (the loader is what reports it)."""
    digest = hashlib.sha256()
    with os.fdopen(open_regular(shard, "a safetensors shard"), "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        digest.update(prefix)
        if len(prefix) < 8:
            return digest.digest()
        (length,) = struct.unpack("<Q", prefix)
        header = os.pread(fd, min(length, _MAX_HEADER_BYTES, max(0, size - 8)), 8)
        digest.update(header)
        data_start = 8 + len(header)
        for begin, end in sampled_spans(_tensor_ranges(header), size - data_start):
            digest.update(begin.to_bytes(8, "little") + os.pread(fd, end - begin, data_start + begin))
    return digest.digest()


def _tensor_ranges(header: bytes) -> list[tuple[int, int]]:
    """Each tensor's (begin, end) data offsets from a safetensors header, in file order; [] if it is not
    one."""
    try:
        table = json.loads(header)
    except (ValueError, RecursionError):
        return []
    if not isinstance(table, dict):
        return []
    ranges = []
    for name, entry in table.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) and name != "__metadata__" else None
        if isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets):
            if 0 <= offsets[0] <= offsets[1]:
                ranges.append((offsets[0], offsets[1]))
    return sorted(ranges)


def tensor_spans(begin: int, end: int) -> list[tuple[int, int]]:
    """The spans read of a tensor's data [begin, end): all of it up to three spans, else its first,
    middle and last SPAN_BYTES."""
    if end - begin <= 3 * SPAN_BYTES:
        return [(begin, end)] if end > begin else []
    middle = begin + (end - begin) // 2 - SPAN_BYTES // 2
    return [(begin, begin + SPAN_BYTES), (middle, middle + SPAN_BYTES), (end - SPAN_BYTES, end)]


def sampled_spans(tensors: list[tuple[int, int]], data_bytes: int) -> list[tuple[int, int]]:
    """Every byte range [begin, end) of a shard's data region (``data_bytes`` long) that its digest
    covers: each tensor's spans and one span every GRID_STRIDE bytes, sorted and merged (each byte is
    read once)."""
    spans = [span for begin, end in tensors for span in tensor_spans(begin, end)]
    spans += [(at, min(at + SPAN_BYTES, data_bytes)) for at in range(0, max(0, data_bytes), GRID_STRIDE)]
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(spans):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def _shard_identities(shards: list[Path]) -> list[list[Any]]:
    """Per shard what a replacement or rewrite changes: a new file has another inode, and any write,
    utime or rename sets the ctime to now (no call sets it back)."""
    identities: list[list[Any]] = []
    for shard in shards:
        st = shard.stat()
        identities.append([shard.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return identities


def _settled(identities: list[list[Any]], started_ns: int) -> bool:
    """Whether every shard's last change is older than RACY_NS before the hash began: an edit within the
    same timestamp granule would otherwise keep the key of the content hashed before it."""
    return all(max(identity[-2:]) < started_ns - RACY_NS for identity in identities)  # mtime_ns, ctime_ns


def _cache_key(path: Path, identities: list[list[Any]]) -> str:
    """Changes whenever a shard is added, removed, replaced, resized or rewritten."""
    return hashlib.sha256(json.dumps([str(path.resolve()), *identities]).encode()).hexdigest()


def _cache_file() -> Path:
    return user_cache_dir("weights-sha256.json")


def _read_cache() -> dict[str, str]:
    """key -> hash, oldest first; {} when the file is missing or unreadable: the cache only saves work,
    so it never fails a run."""
    try:
        entries = json.loads(_cache_file().read_text()).get("entries")
        return {str(key): str(value) for key, value in entries}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _write_cache(entries: dict[str, str]) -> None:
    """Keep the newest entries (a list: the JSON writer sorts object keys); a read-only or full cache
    directory just means no caching."""
    newest = [[key, value] for key, value in list(entries.items())[-_CACHE_ENTRIES:]]
    try:
        _cache_file().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(_cache_file(), {"entries": newest})
    except OSError:
        pass
