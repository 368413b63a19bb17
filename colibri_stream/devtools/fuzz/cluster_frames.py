"""The cluster-frames surfaces' inputs (docs/fuzzing.md): two frame files and how a case edits them. What
runs a case is cluster_calls.py (in the case's child: it imports torch, this module must not, for the
parent that draws the cases).

A frame file is frames back to back as the wire writes them unsealed: an int64 head [HEAD] (op, payload
bytes, values) and its payload. A case edits bytes (no sparse growth: the file is read whole) or sets a
head's int64 field to an edge value (the op, the payload size, the values: rows, dims, dtypes, counts).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from colibri_stream.devtools.fuzz import mutations as mut

TO_COORDINATOR, TO_WORKER = "cluster/to-coordinator.frames", "cluster/to-worker.frames"
VALUES = 10
HEAD = struct.Struct(f"<{2 + VALUES}q")  # wire.HEAD (cluster_calls.py checks they agree)

# ---------------------------------------------------------------------------------------- edits
FIELD_VALUES = (0, 1, -1, 7, 255, 1 << 31, 1 << 32, 1 << 50, 1 << 62, (1 << 63) - 1, -(1 << 63))


def frames_ops() -> st.SearchStrategy[list[dict[str, Any]]]:
    """Byte edits (no sparse growth: the file is read whole) and int64 head fields set to edge values
    (the op, the payload size, the values: rows, dims, dtypes, counts)."""
    field = st.fixed_dictionaries(
        {"op": st.just("field"), "frame": st.integers(0, 7), "field": st.integers(0, 1 + VALUES),
         "value": st.sampled_from(FIELD_VALUES)}
    )  # fmt: skip
    at = st.floats(0.0, 1.0)
    raw = st.one_of(
        st.fixed_dictionaries({"op": st.just("truncate"), "at": at}),
        st.fixed_dictionaries({"op": st.just("flip"), "at": at, "bit": st.integers(0, 7)}),
        st.fixed_dictionaries({"op": st.just("overwrite"), "at": at, "data": st.binary(min_size=1, max_size=16)}),
        st.fixed_dictionaries({"op": st.just("append"), "data": st.binary(min_size=1, max_size=64)}),
    )
    return st.lists(st.one_of(field, field, raw), min_size=1, max_size=3)


def edit_frames(path: Path, ops: list[dict[str, Any]], canary: str) -> list[dict[str, Any]]:
    for op in ops:
        if op["op"] != "field":
            mut.apply_bytes_op(path, op)
            continue
        data = bytearray(path.read_bytes())
        starts = list(_frame_starts(bytes(data)))
        if starts:
            at = starts[op["frame"] % len(starts)] + 8 * op["field"]
            data[at : at + 8] = struct.pack("<q", op["value"])
            path.write_bytes(bytes(data[: max(len(data), at + 8)]))
    return mut.printable(ops)


def _frame_starts(data: bytes) -> Iterator[int]:
    at = 0
    for head, payload in split_frames(data):
        yield at
        at += len(head) + len(payload)


def split_frames(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(head, payload) as the file announces them (a payload cut at the file's end; a short head padded)."""
    at = 0
    while at < len(data):
        head = data[at : at + HEAD.size].ljust(HEAD.size, b"\0")
        size = HEAD.unpack(head)[1]
        start = at + HEAD.size
        end = start + max(0, min(size, len(data) - start))
        yield head, data[start:end]
        at = end
