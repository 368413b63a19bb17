"""The files of a Hugging Face checkpoint directory, read as hostile input.

Only regular files named inside the directory are opened: a shard name from
``model.safetensors.index.json`` must be a relative path without ``..`` (symlinks are followed, since
the Hugging Face cache links snapshots to its blob store, but a FIFO or a device is refused before it
is opened, so nothing hangs). A safetensors header is parsed here, before the safetensors library maps
the file: length bounded by the file, JSON object, dtype in our table, every tensor's byte span inside
the data section and equal to its shape times its item size.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from colibri_stream.errors import CheckpointError
from engine.config.checks import brief

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
MAX_JSON_BYTES = 64 << 20  # config.json, the shard index (DeepSeek-V3's: 9 MB for 91k tensors)
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_DTYPES = ("F32", "F16", "BF16")  # what a bf16/f16/f32 checkpoint's weights may be stored as
INTEGER_DTYPES = ("I64", "I32")  # integer tables (DeepSeek-V4's tid2eid)
WEIGHT_DTYPES = {"": FLOAT_DTYPES, "tid2eid": INTEGER_DTYPES}  # name suffix -> what an unquantised checkpoint holds
FP8_DTYPE = "F8_E4M3"
FP8_SCALE_SUFFIX = "_scale_inv"  # an FP8 weight's block scales: "<name>_scale_inv"
# FP8 block scales: floats (DeepSeek-V3), or power-of-two e8m0 bytes (scale_fmt ue8m0: DeepSeek-V4's
# dense weights; transformers' FineGrainedFP8 writes float8_e8m0fnu, MXFP8 checkpoints uint8)
E8M0_SCALE_DTYPES = ("F8_E8M0", "U8")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    begin: int = 0  # data_offsets[0], from the start of the data section


def check_regular(path: Path, what: str) -> None:
    """Refuse anything but an existing regular file (after symlinks) before it is opened."""
    try:
        mode = path.stat().st_mode
    except OSError:
        raise CheckpointError(f"{short_name(str(path), 1000)}: {what} is missing") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{short_name(str(path), 1000)}: {what} is not a regular file")


def inside(root: Path, name: Any, source: str) -> Path:
    """``root / name`` for a relative name that stays inside ``root`` (checked on the name itself)."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        raise CheckpointError(f"{source}: shard name {brief(name)} is not a file name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts:
        raise CheckpointError(f"{source}: shard name {brief(name)} points outside {root}")
    return root / pure


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    check_regular(path, what)
    if path.stat().st_size > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: {path.stat().st_size} bytes, more than {MAX_JSON_BYTES} for {what}")
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
    except RecursionError:  # json's C decoder recurses per nesting level: 100k brackets exhaust the stack
        raise CheckpointError(f"{path}: JSON nested too deeply for {what}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def shard_files(path: str | Path) -> list[Path]:
    """The shards of a checkpoint directory: those its index names, else every ``*.safetensors``."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        weight_map = read_json_object(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
        files = sorted({inside(path, name, str(index)) for name in weight_map.values()})
        what = f"a shard listed in {INDEX_FILE}"
    else:
        files = sorted(path.glob("*.safetensors"))
        what = "a safetensors shard"
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    for file in files:
        check_regular(file, what)
    return files


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Tensor name -> dtype, shape, bytes, from a shard's header; every byte span checked."""
    check_regular(file, "a safetensors shard")
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        length = header_length(file, prefix, size)
        return parse_header(file, f.read(length), size, length)


def header_length(file: Path, prefix: bytes, size: int) -> int:
    """The header length a shard of ``size`` bytes announces in its first 8 bytes, checked against the file."""
    if len(prefix) < 8:
        raise CheckpointError(f"{file}: {size} bytes, too short for a safetensors header")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise CheckpointError(f"{file}: header length {length} at offset 0 exceeds the file ({size} bytes)")
    return int(length)


def parse_header(file: Path, raw: bytes, size: int, length: int | None = None) -> dict[str, TensorInfo]:
    """The header JSON ``raw`` of a shard of ``size`` bytes (read here, or fetched by a Range request
    before the shard is downloaded: convert/pull_hub.py), every byte span checked against that size."""
    length = len(raw) if length is None else length
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: safetensors header is not valid JSON ({exc})") from None
    except RecursionError:
        raise CheckpointError(f"{file}: safetensors header JSON is nested too deeply") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: safetensors header is not a JSON object")
    data_bytes = size - 8 - length
    tensors = {
        name: _tensor_info(file, name, entry, data_bytes) for name, entry in header.items() if name != "__metadata__"
    }
    _check_coverage(file, tensors, data_bytes, size)
    return tensors


def _check_coverage(file: Path, tensors: dict[str, TensorInfo], data_bytes: int, size: int) -> None:
    """The tensors tile the data section exactly, as the safetensors library requires: refused here,
    from the header alone, before anything maps the file (a shard grown sparse to 1 TiB would otherwise
    be mapped, or hashed to the last byte, and a gap or an overlap is no valid file either)."""
    end = 0
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].nbytes)):
        if info.begin != end:
            raise CheckpointError(
                f"{file}: tensor {short_name(name)} starts at data offset {info.begin}, the previous tensor ends "
                f"at {end} (tensors must tile the data section without gaps or overlaps)"
            )
        end += info.nbytes
    if end != data_bytes:
        raise CheckpointError(
            f"{file}: {size} bytes, but its header's tensors end at byte {size - data_bytes + end} "
            f"(data section {data_bytes} bytes, tensors cover {end})"
        )


def _tensor_info(file: Path, name: str, entry: Any, data_bytes: int) -> TensorInfo:
    where = f"{file}: tensor {short_name(name)}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:  # a list is unhashable
        raise CheckpointError(f"{where}: dtype {brief(dtype)} is not a safetensors dtype")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape {brief(shape)} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets {brief(offsets)} is not [begin, end]")
    begin, end = offsets
    if not begin <= end <= data_bytes:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] outside the {data_bytes}-byte data section")
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if nbytes != end - begin:
        raise CheckpointError(f"{where}: {dtype}{shape} needs {nbytes} bytes, data_offsets span {end - begin}")
    return TensorInfo(dtype, tuple(shape), nbytes, begin)


def short_name(name: str, limit: int = 120) -> str:
    """A name (a header key, a path) as an error line shows it: a 1 MiB name is cut, not echoed."""
    return name if len(name) <= limit else name[:limit] + "..."


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_dtypes(file: Path, tensors: dict[str, TensorInfo], allowed: dict[str, tuple[str, ...]]) -> None:
    """Refuse a tensor stored in a dtype the config does not announce (an F32 weight relabelled I32
    has the right size and would load as integers). ``allowed``: name suffix -> dtypes, "" for the rest."""
    for name, info in tensors.items():
        suffix = next((s for s in allowed if s and name.endswith(s)), "")
        if info.dtype not in allowed[suffix]:
            raise CheckpointError(
                f"{file}: tensor {short_name(name)} is {info.dtype}, expected one of {list(allowed[suffix])} "
                "(the weight dtypes config.json announces)"
            )


def add_shard(
    table: dict[str, tuple[Path, TensorInfo]],
    file: Path,
    tensors: dict[str, TensorInfo],
    allowed: dict[str, tuple[str, ...]],
) -> None:
    """One shard's header entries into ``table`` (tensor name -> (shard, entry)): a dtype outside
    ``allowed`` (check_dtypes) or a name another shard already holds is refused."""
    check_dtypes(file, tensors, allowed)
    for name, info in tensors.items():
        if name in table:
            raise CheckpointError(f"{file}: tensor {short_name(name)} is also in {table[name][0]}")
        table[name] = (file, info)
