"""The expert container: a zarr v3 directory store, and its fast read path.

    DST/zarr.json                    root group; attributes hold everything below ("colibri" key)
    DST/dense/<engine name>/         one array per dense tensor, real shape, float32 or bfloat16 bits
    DST/experts/layer_NNN/           uint8 [n_experts, record_bytes], one uncompressed chunk per expert
    DST/experts/layer_NNN/c/<e>/0    that chunk: exactly one expert record (see layout.py)
    DST/config.json, tokenizer*, ... copied from the source checkpoint

Stock ``zarr.open`` reads all of it. The hot path does not: a zarr chunk read costs several times one
``pread`` of the same bytes (docs/benchmarks-log.md, "Figures behind the code"), so ``ExpertReader`` opens
the chunk file itself and reads the record in one call, optionally past the page cache (O_DIRECT, or
F_NOCACHE on macOS: storage/files/page_cache.py; records are 4 KiB multiples at offset 0).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import zarr

from storage.container.layout import DENSE_ARRAY_DTYPES, QUANTISED_DENSE, ExpertRecordLayout, stored_shape
from storage.container.parts import Parts, load_parts
from storage.errors import CorruptDataError, FormatError
from storage.files.checksum import crc32c
from storage.files.page_cache import Bypass, open_file

FORMAT_NAME = "colibri-stream-container"
FORMAT_VERSION = 1
ATTRS_KEY = "colibri"
DENSE_GROUP = "dense"
EXPERTS_GROUP = "experts"
# Arrays a container keeps for completeness but no model loads (DeepSeek-V4's multi-token-prediction
# modules): checksummed and verified like the rest, never resident, never in a plan.
KEPT_PREFIX = "kept."
CONTENT_KEY = "content_sha256"
# int8 / int4: group-quantised codes with float16 scales (int4 two per byte); int32: tables
DENSE_DTYPES = ("float32", "bfloat16", "int8", "int4", "int32")
MAX_METADATA_BYTES = 64 << 20  # zarr.json files; DeepSeek-V3's root, every checksum included, is ~0.2 MB
# Dense array names are engine parameter names: one path component, never "." or ".." or a separator.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


def expert_array_name(layer: int) -> str:
    return f"layer_{layer:03d}"


def expert_chunk_relpath(layer: int, expert: int) -> str:
    """zarr v3 default chunk key encoding ("/" separator) for chunk (expert, 0)."""
    return f"{EXPERTS_GROUP}/{expert_array_name(layer)}/c/{expert}/0"


def regular_file_size(path: Path, what: str) -> int:
    """The size of ``path``, refusing anything but a regular file before it is opened (a FIFO would
    block the open forever; a device or directory is no chunk)."""
    try:
        info = path.stat()
    except OSError:
        raise FormatError(f"{path}: missing ({what})") from None
    if not stat.S_ISREG(info.st_mode):
        raise FormatError(f"{path}: not a regular file ({what})")
    return info.st_size


def check_plain_name(name: Any, where: str) -> str:
    """A name used as one path component inside the container: no separators, no '..', not absolute, and
    no longer than a file name may be (so a 1 MiB name is refused here, not listed in later errors)."""
    if not isinstance(name, str) or len(name) > 255 or not _PLAIN_NAME.fullmatch(name) or ".." in name:
        raise FormatError(f"{where}: name {brief(name)} is not a plain array or file name")
    return name


def read_json(path: Path, what: str) -> Any:
    size = regular_file_size(path, what)
    if size > MAX_METADATA_BYTES:
        raise FormatError(f"{path}: {size} bytes, more than {MAX_METADATA_BYTES} for {what}")
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: not valid JSON ({what}): {exc}") from None
    except RecursionError:  # json's C decoder recurses per nesting level: 100k brackets exhaust the stack
        raise FormatError(f"{path}: JSON nested too deeply ({what})") from None


def brief(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error line names a hostile value without echoing
    all of it (storage cannot use engine.config.checks.brief: the two packages never import each other)."""
    try:
        text = repr(value)
    except RecursionError:
        return f"<{type(value).__name__} nested too deeply>"
    return text if len(text) <= limit else text[:limit] + "..."


def metadata_object(meta: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """``meta[key]`` as a JSON object ({} when absent): anything else is refused naming the file and key
    rather than failing later on ``.get`` of a list."""
    value = meta.get(key, {})
    if not isinstance(value, dict):
        raise FormatError(f"{where}: {key} must be a JSON object, got {brief(value)}")
    return value


def _chunk_shape(meta: dict[str, Any], where: str) -> Any:
    grid = metadata_object(meta, "chunk_grid", where)
    return metadata_object(grid, "configuration", f"{where}: chunk_grid").get("chunk_shape")


def content_sha256(attrs: dict[str, Any]) -> str:
    """What the stored weights are, as one hash: sha256 over every dense array's entry (shape, dtype,
    crc32c of its bytes) and the experts' layout and per-record crc32c.

    Every stored weight byte is under one of those checksums, so two containers agree here only if
    their weights do (for weights that differ by accident, not by construction: crc32c is no defence
    against a deliberate collision). Published at convert time; containers converted before it existed
    give the same value computed from their attributes (storage.container.reader attrs "dense"/"experts")."""
    payload = json.dumps({"dense": attrs.get("dense"), "experts": attrs.get("experts")}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def is_container(path: str | Path) -> bool:
    """True for a directory shaped like a container (even a damaged one): opening it then says what is wrong."""
    path = Path(path)
    return (path / "zarr.json").is_file() or (path / EXPERTS_GROUP).is_dir() or (path / DENSE_GROUP).is_dir()


@dataclass(frozen=True)
class DenseEntry:
    name: str
    shape: tuple[int, ...]  # the weight's (an int4 array stores ceil(in / 2) bytes per row: ``stored_shape``)
    dtype: str  # "float32" | "bfloat16" | "int8" | "int4" | "int32" | "float16" (the codes' scales)
    crc32c: int
    scales: DenseEntry | None = None  # int8/int4 only: float16 [out, ceil(in / group)] stored as "<name>.scale"
    group_size: int | None = None  # int8/int4 only; the last group of a row may be partial


class Container:
    """Read side of a finished container. Opening checks the metadata; bytes are checked when read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        root = read_json(self.path / "zarr.json", "zarr root metadata")
        where = str(self.path / "zarr.json")
        attrs = metadata_object(root, "attributes", where).get(ATTRS_KEY) if isinstance(root, dict) else None
        if not isinstance(attrs, dict):
            raise FormatError(f"{self.path}: not a colibri-stream container (no '{ATTRS_KEY}' attributes)")
        self.attrs = attrs
        self._check_header()
        self.model_config: dict[str, Any] = attrs["model_config"]
        experts = attrs["experts"]
        self.layout = ExpertRecordLayout.from_attrs(
            experts.get("layout"), self._config_int("hidden_size"), self._config_int("moe_intermediate_size")
        )
        self.n_experts = self._config_int("n_routed_experts")
        self.experts_per_token = self._config_int("num_experts_per_tok")  # the router's top-k
        self.moe_layers: tuple[int, ...] = self._parse_layers(experts.get("layers"))
        self._expert_crcs = self._parse_expert_checksums(experts.get("checksums"))
        arrays = self._parse_dense(attrs["dense"])
        self.dense = {name: entry for name, entry in arrays.items() if not name.startswith(KEPT_PREFIX)}
        self.kept = {name: entry for name, entry in arrays.items() if name.startswith(KEPT_PREFIX)}
        # Spread over several directories (storage/container/parts.py): None for a whole container, whose reads
        # resolve paths exactly as before. Every part directory is checked here (one error naming it).
        self.parts: Parts | None = load_parts(self.path, self.moe_layers, self.n_experts, self.content_hash)

    @property
    def content_hash(self) -> str:
        """What the weights are (storage.container.write.content_sha256): the same whole or spread."""
        stored = self.attrs.get(CONTENT_KEY)
        return stored if isinstance(stored, str) else content_sha256(self.attrs)

    # ------------------------------------------------------------------------------------ metadata
    def _check_header(self) -> None:
        name, version = self.attrs.get("format"), self.attrs.get("format_version")
        if name != FORMAT_NAME:
            raise FormatError(f"{self.path}: format {brief(name)} is not {FORMAT_NAME!r}")
        if version != FORMAT_VERSION:
            raise FormatError(
                f"{self.path}: format version {brief(version)} is not supported (this build reads {FORMAT_VERSION})"
            )
        if not self.attrs.get("complete"):
            raise FormatError(f"{self.path}: conversion did not finish; rerun `colibri-stream convert` to resume it")
        for key in ("model_config", "experts", "dense"):
            if not isinstance(self.attrs.get(key), dict):
                raise FormatError(f"{self.path}: attributes lack '{key}'")

    def _config_int(self, key: str) -> int:
        value = self.model_config.get(key)
        if not isinstance(value, int):
            raise FormatError(f"{self.path}: model_config.{key} is missing or not an integer")
        return value

    def _parse_layers(self, layers: Any) -> tuple[int, ...]:
        # MTP modules' blocks (engine/mla/mtp.py) follow the last layer, as many as the model ships
        mtp = self.model_config.get("num_nextn_predict_layers", 0)
        n_layers = self._config_int("num_hidden_layers") + (mtp if type(mtp) is int and mtp > 0 else 0)
        ok = isinstance(layers, list) and all(type(x) is int and 0 <= x < n_layers for x in layers)
        if not ok or len(set(layers)) != len(layers):
            raise FormatError(
                f"{self.path}: experts.layers must list distinct MoE layers in [0, {n_layers}), got {brief(layers)}"
            )
        return tuple(layers)

    def _parse_expert_checksums(self, checksums: Any) -> dict[int, list[int]]:
        if not isinstance(checksums, dict):
            raise FormatError(f"{self.path}: experts.checksums is missing")
        parsed = {}
        for layer in self.moe_layers:
            crcs = checksums.get(str(layer))
            if (
                not isinstance(crcs, list)
                or not all(type(c) is int and 0 <= c < 1 << 32 for c in crcs)
                or len(crcs) != self.n_experts
            ):
                raise FormatError(f"{self.path}: experts.checksums[{layer}] must list {self.n_experts} crc32c values")
            parsed[layer] = crcs
        return parsed

    def _parse_dense(self, table: dict[str, Any]) -> dict[str, DenseEntry]:
        entries = {}
        for name, entry in table.items():
            check_plain_name(name, f"{self.path}: dense")
            dense = self._dense_entry(name, entry)
            if dense.dtype not in DENSE_DTYPES:
                raise FormatError(
                    f"{self.path}: dense array {name}: dtype {brief(dense.dtype)} is not one of {DENSE_DTYPES}"
                )
            if dense.dtype in QUANTISED_DENSE:
                dense = self._quantised_entry(dense, entry)
            entries[name] = dense
        return entries

    def _quantised_entry(self, dense: DenseEntry, entry: dict[str, Any]) -> DenseEntry:
        """An int8 or int4 array with its scales and group size (containers before ragged groups recorded no
        group size: their groups divide the width, so it is width / scale columns)."""
        name = dense.name
        scales = self._dense_entry(f"{name}.scale", entry.get("scales"), "float16")
        if len(dense.shape) != 2 or len(scales.shape) != 2 or scales.shape[0] != dense.shape[0]:
            raise FormatError(f"{self.path}: dense array {name}: scales {list(scales.shape)} do not fit it")
        width, groups = dense.shape[1], scales.shape[1]
        group = entry.get("group_size", width // groups if width % groups == 0 else None)
        if type(group) is not int or group <= 0 or -(-width // group) != groups:
            raise FormatError(
                f"{self.path}: dense array {name}: group size {brief(group)} does not give its "
                f"{groups} scale columns for width {width}"
            )
        if dense.dtype == "int4" and group % 2:
            raise FormatError(f"{self.path}: dense array {name}: int4 groups pack two codes a byte, not {group}")
        return DenseEntry(name, dense.shape, dense.dtype, dense.crc32c, scales, group)

    def _dense_entry(self, name: str, entry: Any, dtype: str | None = None) -> DenseEntry:
        try:
            dense = DenseEntry(name, tuple(entry["shape"]), dtype or entry["dtype"], int(entry["crc32c"]))
        except (KeyError, TypeError, ValueError, OverflowError):
            raise FormatError(f"{self.path}: dense entry {brief(name)} needs shape, dtype and crc32c") from None
        if not dense.shape or not all(type(d) is int and d > 0 for d in dense.shape):
            shape = brief(list(dense.shape))
            raise FormatError(f"{self.path}: dense entry {brief(name)}: shape {shape} is not a list of sizes")
        return dense

    def array_metadata(self, relpath: str) -> dict[str, Any]:
        meta = read_json(self.path / relpath / "zarr.json", f"array metadata of {relpath}")
        if not isinstance(meta, dict) or meta.get("node_type") != "array":
            raise FormatError(f"{self.path / relpath}: not a zarr array")
        return meta

    def check_dense_metadata(self, entry: DenseEntry) -> None:
        """The array as the converter writes it, and nothing else: one chunk holding the whole array,
        uncompressed little-endian bytes, its file regular and exactly the declared size. So a read is
        bounded by the declared shape (a gzip codec could inflate a small chunk to gigabytes)."""
        relpath = f"{DENSE_GROUP}/{entry.name}"
        meta = self.array_metadata(relpath)
        where = f"{self.path / relpath / 'zarr.json'}"
        dtype, shape = np.dtype(DENSE_ARRAY_DTYPES[entry.dtype]), list(stored_shape(entry.shape, entry.dtype))
        if meta.get("shape") != shape or meta.get("data_type") != str(dtype):
            raise FormatError(
                f"dense array {entry.name}: zarr metadata says "
                f"{brief(meta.get('data_type'))}{brief(meta.get('shape'))}, "
                f"container attributes say {dtype}{shape}"
            )
        chunks = _chunk_shape(meta, where)
        codecs: Any = meta.get("codecs")  # JSON, checked just below
        bytes_only = isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)
        if not bytes_only or codecs[0].get("name") != "bytes" or chunks != shape:
            raise FormatError(
                f"dense array {entry.name}: needs one uncompressed chunk (bytes codec only, chunk_shape = shape), "
                f"got codecs {brief(codecs)}, chunks {brief(chunks)}"
            )
        endian = metadata_object(codecs[0], "configuration", f"{where}: codecs[0]").get("endian", "little")
        if endian != "little" or meta.get("storage_transformers"):
            raise FormatError(f"dense array {entry.name}: only little-endian bytes without transformers are read")
        self._check_chunk_key_encoding(meta, f"dense array {entry.name}", where)
        chunk = self.path / relpath / "c" / "/".join("0" * len(entry.shape))
        size = regular_file_size(chunk, f"chunk of dense array {entry.name}")
        expected = math.prod(shape) * dtype.itemsize
        if size != expected:
            raise CorruptDataError(f"dense array {entry.name}: {chunk} holds {size} bytes, expected {expected}")

    def _check_chunk_key_encoding(self, meta: dict[str, Any], what: str, where: str) -> None:
        encoding = metadata_object(meta, "chunk_key_encoding", where)
        separator = metadata_object(encoding, "configuration", f"{where}: chunk_key_encoding").get("separator", "/")
        if encoding.get("name") != "default" or separator != "/":
            raise FormatError(f"{what}: unsupported chunk key encoding {brief(encoding)}")

    def check_expert_file(self, layer: int, expert: int) -> None:
        """The record's chunk is a regular file of exactly one record, checked before anything is read or
        a buffer sized from the layout is allocated."""
        path = self.expert_path(layer, expert)
        try:
            info = path.stat()
        except OSError:
            raise CorruptDataError(f"layer {layer} expert {expert}: chunk file {path} is missing") from None
        if not stat.S_ISREG(info.st_mode):
            raise CorruptDataError(f"layer {layer} expert {expert}: chunk {path} is not a regular file")
        size = info.st_size
        if size != self.layout.record_bytes:
            raise CorruptDataError(
                f"layer {layer} expert {expert}: {path} holds {size} bytes, expected {self.layout.record_bytes}"
            )

    def check_expert_metadata(self, layer: int) -> None:
        relpath = f"{EXPERTS_GROUP}/{expert_array_name(layer)}"
        meta = self.array_metadata(relpath)
        where = f"{self.path / relpath / 'zarr.json'}"
        chunks = _chunk_shape(meta, where)
        codecs = meta.get("codecs")
        names = [c.get("name") if isinstance(c, dict) else c for c in codecs] if isinstance(codecs, list) else codecs
        expected_shape = [self.n_experts, self.layout.record_bytes]
        if meta.get("shape") != expected_shape or meta.get("data_type") != "uint8":
            raise FormatError(
                f"expert array {relpath}: expected uint8{expected_shape}, "
                f"got {brief(meta.get('data_type'))}{brief(meta.get('shape'))}"
            )
        if chunks != [1, self.layout.record_bytes] or names != ["bytes"]:
            raise FormatError(
                f"expert array {relpath}: needs one uncompressed chunk per expert "
                f"(chunks {brief(chunks)}, codecs {brief(names)})"
            )
        self._check_chunk_key_encoding(meta, f"expert array {relpath}", where)

    # ---------------------------------------------------------------------------------------- data
    def expert_path(self, layer: int, expert: int) -> Path:
        if layer not in self._expert_crcs:
            raise KeyError(f"layer {layer} has no routed experts in {self.path}")
        if not 0 <= expert < self.n_experts:
            raise KeyError(f"layer {layer} has no routed expert {expert}")
        if self.parts is None:
            return self.path / expert_chunk_relpath(layer, expert)
        return self.parts.root(self.parts.primary(layer, expert)) / expert_chunk_relpath(layer, expert)

    def expert_copies(self, layer: int, expert: int) -> tuple[tuple[int, Path], ...]:
        """(part, path) of every copy of a record, primary first; one (0, path) for a whole container."""
        if self.parts is None:
            return ((0, self.expert_path(layer, expert)),)
        self.expert_path(layer, expert)  # the same KeyErrors
        relpath = expert_chunk_relpath(layer, expert)
        return tuple((part, self.parts.root(part) / relpath) for part in self.parts.of(layer, expert))

    def expert_checksum(self, layer: int, expert: int) -> int:
        return self._expert_crcs[layer][expert]

    @property
    def expert_bytes(self) -> int:
        """Bytes of all routed-expert records (what a cold prefill may read at most)."""
        return len(self.moe_layers) * self.n_experts * self.layout.record_bytes

    def read_dense(self, name: str) -> np.ndarray:
        """The dense array through zarr, checksum-verified. bfloat16 comes back as its uint16 bits,
        int8 as its quantised values, int4 as its packed bytes (see ``read_dense_scales``)."""
        entry = self.dense.get(name) or self.kept.get(name)
        if entry is None:
            raise FormatError(f"{self.path}: no dense array {name!r}")
        return self._read_entry(entry)

    def read_dense_scales(self, name: str) -> np.ndarray:
        """float16 group scales of an int8 or int4 dense array."""
        scales = self.dense[name].scales
        if scales is None:
            raise FormatError(f"{self.path}: dense array {name} is not quantised")
        return self._read_entry(scales)

    def _read_entry(self, entry: DenseEntry) -> np.ndarray:
        self.check_dense_metadata(entry)
        try:
            # zarr types a read as any array-like or scalar; a whole-array read of a stored array is an ndarray
            array = cast(np.ndarray, zarr.open_array(self.path / DENSE_GROUP / entry.name, mode="r")[...])
        except Exception as exc:  # zarr raises assorted types for unreadable chunks
            raise CorruptDataError(
                f"dense array {entry.name}: unreadable chunk ({type(exc).__name__}: {exc})"
            ) from None
        if crc32c(np.ascontiguousarray(array)) != entry.crc32c:
            raise CorruptDataError(f"dense array {entry.name}: checksum mismatch (corrupted or missing chunk)")
        return array


def read_record_file(
    path: Path, layer: int, expert: int, out: np.ndarray, size: int, bypass: Bypass = Bypass.NONE
) -> memoryview:
    """One ``pread`` of the ``size``-byte record at ``path`` into ``out``, past the page cache as ``bypass``
    says (storage/files/page_cache.py); the bytes read, unverified. Short reads and I/O errors are
    CorruptDataError naming the expert and the file."""
    if out.nbytes < size:
        raise ValueError(f"buffer of {out.nbytes} bytes cannot hold a {size}-byte record")
    # O_NONBLOCK: opening a FIFO planted as a chunk returns at once (and is refused below) instead
    # of waiting forever for a writer; it changes nothing for a regular file.
    flags = os.O_RDONLY | os.O_NONBLOCK
    target = memoryview(out.reshape(-1)[:size])  # type: ignore[arg-type]  # numpy: a Buffer only on >= 3.12
    try:
        fd = open_file(path, flags, bypass)
    except FileNotFoundError:
        raise CorruptDataError(f"layer {layer} expert {expert}: chunk file {path} is missing") from None
    except OSError as exc:  # a part directory made unreadable after open
        raise CorruptDataError(f"layer {layer} expert {expert}: cannot open {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptDataError(f"layer {layer} expert {expert}: chunk {path} is not a regular file")
        got = os.preadv(fd, [target], 0)
    except OSError as exc:
        raise CorruptDataError(f"layer {layer} expert {expert}: read of {path} failed: {exc}") from None
    finally:
        os.close(fd)
    if got != size:
        raise CorruptDataError(f"layer {layer} expert {expert}: short read of {path} ({got} of {size} bytes)")
    return target


class ExpertReader:
    """The hot path: one ``pread`` of one whole expert record into a caller-provided buffer.

    A record's crc32c is checked the first time it is read from disk; short reads and I/O errors
    become CorruptDataError naming the expert. Thread-safe (reads from a thread pool).
    """

    def __init__(self, container: Container, bypass: Bypass = Bypass.NONE, verify: bool = True):
        self.container = container
        self.bypass = bypass
        self.verify = verify
        self._verified: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    @property
    def record_bytes(self) -> int:
        return self.container.layout.record_bytes

    def read_into(self, layer: int, expert: int, out: np.ndarray) -> int:
        path = self.container.expert_path(layer, expert)
        target = read_record_file(path, layer, expert, out, self.record_bytes, self.bypass)
        if self.verify:
            self._verify_once(layer, expert, target)
        return len(target)

    def _verify_once(self, layer: int, expert: int, data: memoryview) -> None:
        key = (layer, expert)
        if key in self._verified:
            return
        if crc32c(data) != self.container.expert_checksum(layer, expert):
            raise CorruptDataError(
                f"layer {layer} expert {expert}: checksum mismatch in {self.container.expert_path(layer, expert)}"
            )
        with self._lock:
            self._verified.add(key)
