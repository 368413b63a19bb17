"""Write side of the container (used by the converter): create the zarr arrays, write records and
dense arrays, then publish the attributes that mark the container complete.

Every write is deterministic (same input bytes -> same files), which is what lets an interrupted
conversion resume into a container byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import zarr

from storage.container.layout import DENSE_ARRAY_DTYPES, ExpertRecordLayout, stored_shape
from storage.container.reader import (
    ATTRS_KEY,
    DENSE_GROUP,
    EXPERTS_GROUP,
    FORMAT_NAME,
    FORMAT_VERSION,
    expert_array_name,
)
from storage.container.reader import CONTENT_KEY as CONTENT_KEY  # defined beside the reader; re-exported
from storage.container.reader import content_sha256 as content_sha256
from storage.errors import write_errors
from storage.files.atomic import is_dead_writers_temp
from storage.files.checksum import crc32c

if TYPE_CHECKING:
    from zarr.core.array_spec import ArrayConfigParams

_NO_SKIP: ArrayConfigParams = {
    "write_empty_chunks": True
}  # an all-zero chunk must still be a file: the hot path reads files
# zarr's LocalStore writes each file as `<name>.<uuid4 hex>.partial`, then renames it
_ZARR_TEMP = re.compile(r".+\.[0-9a-f]{32}\.partial")
P = ParamSpec("P")
R = TypeVar("R")


def _writes(method: Callable[Concatenate[ContainerWriter, P], R]) -> Callable[Concatenate[ContainerWriter, P], R]:
    """A full disk (or a device error) under a write is a DiskFullError / DiskWriteError naming the
    container; a conversion redoes the unfinished unit when rerun, so nothing half-written is kept."""

    @functools.wraps(method)
    def guarded(writer: ContainerWriter, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with write_errors(writer.path, "the container"):
            return method(writer, *args, **kwargs)

    return guarded


def _remove_torn_writes(path: Path) -> None:
    """Remove the temp files a writer killed between a write and its rename left in an unfinished
    container (zarr's, ours): nothing renames them any more, and kept they would end up in the published
    container, no longer byte-identical to an uninterrupted conversion. The unit they belonged to is
    redone, since the journal names only units whose writes all finished."""
    if not path.is_dir():
        return
    for file in path.rglob("*"):
        if file.is_file() and (_ZARR_TEMP.fullmatch(file.name) or is_dead_writers_temp(file)):
            file.unlink(missing_ok=True)


class ContainerWriter:
    def __init__(self, path: str | Path, layout: ExpertRecordLayout, n_experts: int):
        self.path = Path(path)
        self.layout = layout
        self.n_experts = n_experts
        _remove_torn_writes(self.path)
        self.root = zarr.open_group(self.path, mode="a", zarr_format=3)

    @_writes
    def mark_incomplete(self) -> None:
        self.root.attrs[ATTRS_KEY] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "complete": False,
        }

    @_writes
    def create_expert_array(self, layer: int) -> None:
        self.root.create_array(
            f"{EXPERTS_GROUP}/{expert_array_name(layer)}",
            shape=(self.n_experts, self.layout.record_bytes),
            chunks=(1, self.layout.record_bytes),
            dtype="uint8",
            compressors=None,  # int4 nibbles do not compress with lz4: not worth a decode on the hot path
            fill_value=0,
            overwrite=True,
            config=_NO_SKIP,
        )

    @_writes
    def write_expert(self, layer: int, expert: int, record: np.ndarray) -> int:
        if record.shape != (self.layout.record_bytes,) or record.dtype != np.uint8:
            raise ValueError(
                f"expert record must be uint8[{self.layout.record_bytes}], got {record.dtype}{list(record.shape)}"
            )
        array = zarr.open_array(self.path / EXPERTS_GROUP / expert_array_name(layer), mode="r+")
        array[expert : expert + 1] = record[None]
        return crc32c(record)

    @_writes
    def write_dense(
        self, name: str, array: np.ndarray, dtype: str, shape: tuple[int, ...] | None = None
    ) -> dict[str, Any]:
        """Store one dense array (float32, bfloat16 bits as uint16, int8, int4 codes packed two a byte, or
        float16 scales); return its attribute entry. ``shape``: the weight's (int4: its width, not the
        packed array's; default the array's)."""
        array = np.ascontiguousarray(array)
        shape = tuple(array.shape) if shape is None else shape
        wanted, wanted_shape = np.dtype(DENSE_ARRAY_DTYPES[dtype]), stored_shape(shape, dtype)
        if array.dtype != wanted or tuple(array.shape) != wanted_shape:
            raise ValueError(
                f"dense array {name}: {dtype}{list(shape)} must be given as {wanted}{list(wanted_shape)}, "
                f"got {array.dtype}{list(array.shape)}"
            )
        target = self.root.create_array(
            f"{DENSE_GROUP}/{name}",
            shape=array.shape,
            chunks=array.shape,
            dtype=array.dtype,
            compressors=None,
            fill_value=0,
            overwrite=True,
            config=_NO_SKIP,
        )
        target[...] = array
        return {"shape": list(shape), "dtype": dtype, "crc32c": crc32c(array)}

    @_writes
    def publish(self, attrs: dict[str, Any]) -> None:
        """Write the final attributes; from here on the container opens as complete."""
        attrs = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **attrs, "complete": True}
        attrs[CONTENT_KEY] = content_sha256(attrs)
        # Canonical key order: attributes built fresh or replayed from a journal serialise identically.
        self.root.attrs[ATTRS_KEY] = json.loads(json.dumps(attrs, sort_keys=True))
