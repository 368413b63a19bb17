"""KV packs: a computed prompt prefix in one file, to ship a preamble computed once to another machine.

    header (4096 bytes): the KV log's header (storage/kv/log.py); its "state" holds, beside what the
                         values depend on, "pack_name" and "chat_template" (the digest of the template
                         the tokens were rendered with: a pack is only worth importing where the same
                         template renders the same preamble)
    records:             the KV log's records for positions 0..n-1, the position folded into each crc

Written to a temporary name, fsynced and renamed into place (a pack is a file a user keeps); read in
chunks, every record's checksum checked before any is handed on, so a torn or damaged pack is refused
whole rather than half-imported.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.errors import CorruptDataError, FormatError
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

PACK_SUFFIX = ".kvpack"
PACK_KEYS = ("pack_name", "chat_template")


@dataclass(frozen=True)
class PackHeader:
    fingerprint: str
    geometry: Geometry
    state: dict[str, str]  # what the values depend on (the pack's own keys taken out)
    name: str
    chat_template: str
    positions: int


def write_pack(path: Path, header: PackHeader, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
    """Write the pack: ``chunks`` are (tokens [n] uint32, payloads [n, payload_bytes] uint8) of
    consecutive positions from 0. Returns the positions written."""
    state = header.state | {"pack_name": header.name, "chat_template": header.chat_template}
    written = 0
    with replacing(path, "the KV pack") as f:
        f.write(encode_header(header.fingerprint, header.geometry, state))
        for tokens, payloads in chunks:
            f.write(encode_records(tokens, payloads, written, header.geometry.record_bytes).tobytes())
            written += len(tokens)
    return written


def read_pack_header(path: Path) -> PackHeader:
    """The pack's header, its size checked against whole records; FormatError for anything else."""
    fd = open_regular(path, "KV pack", follow_symlinks=False)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(HEADER_BYTES)
        size = os.fstat(f.fileno()).st_size
    header = decode_header(raw, path)
    geometry = geometry_of_header(header, path)
    state = header.get("state")
    if not isinstance(state, dict) or not all(isinstance(state.get(key), str) for key in PACK_KEYS):
        raise FormatError(f"{path}: a KV log, not a KV pack (no pack name or chat-template digest)")
    positions, rest = divmod(size - HEADER_BYTES, geometry.record_bytes)
    if rest:
        raise CorruptDataError(f"{path}: KV pack is truncated ({rest} bytes of a partial record at the end)")
    own = {key: value for key, value in state.items() if key not in PACK_KEYS}
    return PackHeader(
        str(header.get("fingerprint")), geometry, own, state["pack_name"], state["chat_template"], positions
    )


def read_pack_records(path: Path, header: PackHeader, chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, payloads) of ``chunk`` positions at a time (the last may be shorter), each checked."""
    record_bytes = header.geometry.record_bytes
    fd = open_regular(path, "KV pack", follow_symlinks=False)
    try:
        for first in range(0, header.positions, chunk):
            n = min(chunk, header.positions - first)
            data = os.pread(fd, n * record_bytes, HEADER_BYTES + first * record_bytes)
            if len(data) != n * record_bytes or count_valid_records(data, record_bytes, first) != n:
                raise CorruptDataError(f"{path}: KV pack record checksum mismatch at or after position {first}")
            yield decode_records(np.frombuffer(data, dtype=np.uint8).reshape(n, record_bytes))
    finally:
        os.close(fd)


def pack_tokens(path: Path, header: PackHeader, chunk: int) -> np.ndarray:
    """Every token id of the pack [positions] uint32; CorruptDataError unless every record is whole and
    valid (checked before anything is imported)."""
    tokens = [ids for ids, _ in read_pack_records(path, header, chunk)]
    return np.concatenate(tokens) if tokens else np.empty(0, dtype=np.uint32)
