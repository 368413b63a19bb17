"""The byte layout of one prefix-cache block file: the KV of a run of consecutive positions of a prompt.

    header (4096 bytes): the KV log's header (storage/kv/log.py), its "state" holding, beside what the
                         values depend on (the namespace's state), "prefix_key" (the block's key),
                         "first_position" (the position of its first record) and, when set, "tenant" (whose
                         block it is: an id derived from an API key, never the key) and "origin" (where its
                         values came from: the KV pack it was imported from, its digest and the time)
    records:             the KV log's records for positions first_position.., the position folded into
                         each crc, so a block read at another place of a prompt fails

A block is written whole to a temporary name and renamed into place, so a reader sees a whole block or
none; it is not fsynced (a cache: a block lost or torn by a power cut fails its checksums and is
recomputed, never used). Reading checks the magic, header crc, model fingerprint, geometry, state and key,
then every record's crc: a block of another model, record dtype, compute dtype or activation path, or a
damaged one, is never returned.

Which blocks exist and which to drop is prefix_store.py's business; what a key means is the app's.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.errors import CorruptDataError, FormatError, IncompatibleStateError
from storage.files.atomic import replacing
from storage.files.safe_read import open_regular
from storage.kv.log import (
    HEADER_BYTES,
    Geometry,
    count_valid_records,
    decode_header,
    decode_records,
    encode_header,
    encode_records,
    geometry_of_header,
)

BLOCK_SUFFIX = ".kvblock"
_KEY_FIELDS = ("prefix_key", "first_position")
_OWN_FIELDS = (*_KEY_FIELDS, "tenant", "origin")  # the block's own header fields, beside the namespace's state


@dataclass(frozen=True)
class Namespace:
    """What every block of one cache shares, and what its values depend on: the model (fingerprint), the
    record geometry and the state (compute dtype, activation path: runtime/sessions.session_state)."""

    fingerprint: str
    geometry: Geometry
    state: tuple[tuple[str, str], ...]  # sorted (key, value) pairs: hashable

    @classmethod
    def of(cls, fingerprint: str, geometry: Geometry, state: dict[str, str]) -> Namespace:
        if any(key in state for key in _OWN_FIELDS):
            raise ValueError(f"state keys {_OWN_FIELDS} are the block header's own")
        return cls(fingerprint, geometry, tuple(sorted(state.items())))


@dataclass(frozen=True)
class Block:
    """Positions first..first+n of a prompt: their token ids [n] uint32 and record payloads
    [n, payload_bytes] uint8; whose block it is (``tenant``, "": no API key's) and where its values came from
    (``origin``, "": computed here)."""

    first: int
    tokens: np.ndarray
    payloads: np.ndarray
    tenant: str = ""
    origin: str = ""

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes + self.payloads.nbytes)


def block_file_bytes(geometry: Geometry, length: int) -> int:
    return HEADER_BYTES + length * geometry.record_bytes


def encode_block(namespace: Namespace, key: str, block: Block) -> bytes:
    state = dict(namespace.state) | {"prefix_key": key, "first_position": str(block.first)}
    state |= {field: value for field, value in (("tenant", block.tenant), ("origin", block.origin)) if value}
    header = encode_header(namespace.fingerprint, namespace.geometry, state)
    records = encode_records(block.tokens, block.payloads, block.first, namespace.geometry.record_bytes)
    return header + records.tobytes()


def write_block(path: Path, namespace: Namespace, key: str, block: Block) -> int:
    """Write ``block`` at ``path`` (temp + rename, see the module docstring); returns the file's bytes.
    A full disk raises DiskFullError naming the path and leaves no partial file."""
    data = encode_block(namespace, key, block)
    with replacing(path, "a prefix-cache block", durable=False) as f:
        f.write(data)
    return len(data)


def read_block(path: Path, namespace: Namespace, key: str) -> Block:
    """The block at ``path`` if it is ``key``'s, of this namespace and whole. FileNotFoundError when there
    is none; IncompatibleStateError for another namespace or key; FormatError / CorruptDataError for a
    file that is not a whole, valid block."""
    try:
        fd = open_regular(path, "prefix-cache block", follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, "no such block", str(path)) from None
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    header = decode_header(data[:HEADER_BYTES], path)
    _check_namespace(header, namespace, key, path)
    first = int(header["state"]["first_position"])
    record_bytes = namespace.geometry.record_bytes
    body = memoryview(data)[HEADER_BYTES:]
    n, rest = divmod(len(body), record_bytes)
    if n == 0 or rest:
        raise FormatError(f"{path}: prefix-cache block of {len(body)} record bytes, not a whole number of records")
    if count_valid_records(body, record_bytes, first) != n:
        raise CorruptDataError(f"{path}: prefix-cache block record checksum mismatch")
    tokens, payloads = decode_records(np.frombuffer(data, dtype=np.uint8, offset=HEADER_BYTES).reshape(n, -1))
    state = header["state"]
    return Block(first, tokens, payloads, str(state.get("tenant", "")), str(state.get("origin", "")))


def describe_blocks(directory: Path) -> list[dict[str, object]]:
    """The block files in ``directory`` grouped by what their values depend on (model fingerprint, record
    dtype and the state) and whose they are (the tenant): blocks, tokens and bytes of each group, and the
    origins of its imported blocks. A file whose header cannot be read is counted under "unreadable" (it is
    a miss when looked up, and removed then)."""
    groups: dict[str, dict[str, object]] = {}
    for path in sorted(directory.glob(f"*{BLOCK_SUFFIX}")) if directory.is_dir() else []:
        size = path.lstat().st_size
        try:
            with os.fdopen(open_regular(path, "prefix-cache block", follow_symlinks=False), "rb") as f:
                header = decode_header(f.read(HEADER_BYTES), path)
            geometry = geometry_of_header(header, path)
            state = {k: v for k, v in header["state"].items() if k not in (*_KEY_FIELDS, "origin")}
            origin = str(header["state"].get("origin", ""))
            label = ", ".join(f"{k}={v}" for k, v in sorted((state | {"record_dtype": geometry.dtype}).items()))
            tokens = (size - HEADER_BYTES) // geometry.record_bytes
        except (OSError, FormatError, CorruptDataError, KeyError, AttributeError):
            label, tokens, origin = "unreadable", 0, ""
        group = groups.setdefault(label, {"state": label, "blocks": 0, "tokens": 0, "bytes": 0})
        for field, add in (("blocks", 1), ("tokens", tokens), ("bytes", size)):
            group[field] = int(str(group[field])) + add
        if origin:
            origins = group.setdefault("origins", [])
            if isinstance(origins, list) and origin not in origins:
                origins.append(origin)
    return list(groups.values())


def _check_namespace(header: dict[str, object], namespace: Namespace, key: str, path: Path) -> None:
    state = header.get("state")
    if not isinstance(state, dict) or not isinstance(state.get("first_position"), str):
        raise FormatError(f"{path}: prefix-cache block header has no first position")
    if not state["first_position"].isdigit():
        raise FormatError(f"{path}: prefix-cache block first position {state['first_position']!r} is not a number")
    expected = dict(namespace.state) | {"prefix_key": key}
    stored = {k: v for k, v in state.items() if k not in ("first_position", "tenant", "origin")}
    if header.get("fingerprint") != namespace.fingerprint or stored != expected:
        raise IncompatibleStateError(f"{path}: prefix-cache block of another model, state or key")
    if geometry_of_header(header, path) != namespace.geometry:
        raise IncompatibleStateError(f"{path}: prefix-cache block of another KV geometry")
