"""Will it fit on disk? Checked before `convert` or `pull` writes a byte, from the sizes `plan` computes.

A container's size is estimated from its geometry (expert records plus dense arrays in their stored
dtypes: what `plan` shows) with a small margin for zarr's metadata and block rounding; `pull` adds the N
largest shards it keeps on disk at once in its download directory. Needs on one filesystem add up (the
container and the downloads usually share a disk). Where a resumed run already wrote part, only the
rest is asked for. The refusal is one line naming each directory, the bytes it needs and the bytes free.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri_stream.errors import ColibriError
from colibri_stream.planning.geometry import ModelGeometry
from storage.container.layout import DENSE_ARRAY_DTYPES, QUANTISED_DENSE, stored_shape
from storage.container.reader import Container, is_container
from storage.errors import StorageError, free_bytes

METADATA_MARGIN = 0.005  # zarr.json files and partly filled blocks: measured 0.1-0.3% on DeepSeek-V3's layout
BLOCK = 4096
ARRAY_OVERHEAD = 4 * BLOCK  # one array's zarr.json and directories, on a filesystem giving a directory a block
SKIP_FLAG = "--no-space-check"


class DiskSpaceError(ColibriError):
    """Not enough free space for what is about to be written."""


@dataclass(frozen=True)
class Need:
    path: Path  # the directory to write into (it may not exist yet)
    bytes: int  # still to be written there
    what: str  # e.g. "the container (estimated)"


def container_bytes(geometry: ModelGeometry, dense_group: int, side_files: Iterable[int] = ()) -> int:
    """The container `convert` writes for this geometry, on disk: every record and dense array (one file
    each, rounded to a block), plus a margin for metadata, plus the side files it copies (config,
    tokenizer: their sizes). ``dense_group``: int8 and int4 dense arrays' group."""
    # a record is a chunk file in a directory of its own (zarr's c/<expert>/0): its blocks plus the directory's
    records = geometry.total_records * (_blocks(geometry.record_bytes) + BLOCK)
    dense = 0
    for array in geometry.dense:  # zarr.json and the chunk's directories (c/, c/0/...), then the chunk
        stored = math.prod(stored_shape(array.shape, array.dtype))
        dense += ARRAY_OVERHEAD + _blocks(stored * np.dtype(DENSE_ARRAY_DTYPES[array.dtype]).itemsize)
        if array.dtype in QUANTISED_DENSE:  # its float16 scales, one per group of the last dim
            groups = math.prod(array.shape[:-1]) * -(-array.shape[-1] // dense_group)
            dense += ARRAY_OVERHEAD + _blocks(groups * 2)
    return int((records + dense) * (1 + METADATA_MARGIN)) + sum(_blocks(n) for n in side_files)


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def tree_bytes(path: Path) -> int:
    """Bytes already allocated under ``path`` (a resumed run's progress): du's count."""
    if not path.exists():
        return 0
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def complete_container(path: Path) -> bool:
    """Whether ``path`` holds a finished container (a rerun writes nothing: no space to check)."""
    if not is_container(path):
        return False
    try:
        return Container(path).attrs.get("complete") is True
    except StorageError:
        return False


def _device(path: Path) -> int:
    where = path.absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return os.stat(where).st_dev


def check_free_space(needs: list[Need]) -> None:
    """Refuse, in one line, when the needs on one filesystem exceed its free bytes."""
    by_device: dict[int, list[Need]] = {}
    for need in needs:
        by_device.setdefault(_device(need.path), []).append(need)
    for group in by_device.values():
        wanted = sum(n.bytes for n in group)
        free = free_bytes(group[0].path)
        if free is None or wanted <= free:
            continue
        parts = " and ".join(f"{n.path} needs {_size(n.bytes)} ({n.what})" for n in group)
        shared = ", on one filesystem," if len(group) > 1 else ""
        raise DiskSpaceError(
            f"not enough free space: {parts}{shared} with {_size(free)} free; free {_size(wanted - free)} or "
            f"choose another directory ({SKIP_FLAG} to start anyway if the estimate is wrong)"
        )


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.2f} GiB)"
