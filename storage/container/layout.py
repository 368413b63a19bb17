"""Byte layout of one routed-expert record: where gate/up/down and their scales sit in the chunk.

A record is the unit the hot path reads with a single pread. Fields start on 64-byte boundaries (so
numpy/torch views of them are SIMD-aligned) and the record is padded to a multiple of 4 KiB (so
O_DIRECT reads of whole records are legal). The layout is stored in the container's attributes and
re-derived on open; a mismatch is a FormatError, never a guess.

Matrices: w1 (gate) and w3 (up) are [inter, dim], w2 (down) is [dim, inter]. Record kinds (the
scheme), G = ceil(in / group) groups per row, the last one possibly partial (engine/kernels/quant.py):
  int4            "<w>.q" uint8 [out, ceil(in / 2)] (two int4 nibbles per byte) + "<w>.scale" float16 [out, G]
  int4-bf16scale  the same nibbles with bfloat16 scales: compressed-tensors pack-quantized, as shipped
  mxfp4           e2m1 nibbles + "<w>.scale" e8m0 (uint8 exponents) [out, G], group 32 (OCP MX)
  int8            "<w>.q" int8 [out, in]                                        + "<w>.scale" float16 [out, G]
  bf16            "<w>" bfloat16 bits as uint16 [out, in];  f32: "<w>" float32 [out, in]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage.errors import FormatError

FIELD_ALIGN = 64
RECORD_ALIGN = 4096
SCHEMES = ("int4", "int8", "bf16", "f32", "int4-bf16scale", "mxfp4")
# scheme -> (element code, scale dtype tag) for the quantised kinds
QUANT_KINDS = {
    "int4": ("int4", "float16"),
    "int8": ("int8", "float16"),
    "int4-bf16scale": ("int4", "bfloat16"),
    "mxfp4": ("fp4", "e8m0"),
}
MX_BLOCK = 32
# numpy has no bfloat16: its bits are stored as uint16 and tagged "bfloat16" in metadata.
DTYPES = {
    "uint8": np.uint8,
    "int8": np.int8,
    "int32": np.int32,
    "float16": np.float16,
    "float32": np.float32,
    "bfloat16": np.uint16,
    "e8m0": np.uint8,  # power-of-two scales 2^(e - 127)
}
MATRICES = ("w1", "w3", "w2")
# Dense arrays (storage/container/reader.py) add int4: two codes per byte, a row's last byte half filled when its
# width is odd, so the stored array is [.., ceil(width / 2)] uint8 while the entry keeps the weight's shape.
DENSE_ARRAY_DTYPES = {**DTYPES, "int4": np.uint8}
QUANTISED_DENSE = ("int8", "int4")  # dense dtypes stored as codes with float16 group scales


def stored_shape(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """The stored array's shape of a dense weight of ``shape`` kept as ``dtype``."""
    return (*shape[:-1], -(-shape[-1] // 2)) if dtype == "int4" else shape


def align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Field:
    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        # math.prod, not np.prod: asked once per field of every expert materialised (a prompt's first
        # forward over a warm store makes ~1000 experts, and np.prod's per-call overhead showed in its time)
        return math.prod(self.shape) * np.dtype(DTYPES[self.dtype]).itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _matrix_shapes(dim: int, inter_dim: int) -> dict[str, tuple[int, int]]:
    return {"w1": (inter_dim, dim), "w3": (inter_dim, dim), "w2": (dim, inter_dim)}


def check_group(scheme: str, group_size: int | None) -> int:
    """The group size of a quantised scheme; refused only where no layout can hold it."""
    if type(group_size) is not int or group_size <= 0:
        raise FormatError(f"scheme {scheme} needs a positive integer group size, got {group_size!r:.80}")
    code = QUANT_KINDS[scheme][0]
    if code != "int8" and group_size % 2:
        raise FormatError(
            f"scheme {scheme}: group size {group_size} is odd; two weights share a byte, so an odd group "
            "would split a byte between two scales"
        )
    if scheme == "mxfp4" and group_size != MX_BLOCK:
        raise FormatError(f"scheme mxfp4: blocks are {MX_BLOCK} elements (OCP MX), got group size {group_size}")
    return group_size


def _field_specs(
    scheme: str, dim: int, inter_dim: int, group_size: int | None
) -> list[tuple[str, str, tuple[int, int]]]:
    shapes = _matrix_shapes(dim, inter_dim)
    if scheme in ("bf16", "f32"):
        dtype = "bfloat16" if scheme == "bf16" else "float32"
        return [(m, dtype, shapes[m]) for m in MATRICES]
    group = check_group(scheme, group_size)
    code, scale_dtype = QUANT_KINDS[scheme]
    if code == "int8":
        quants = [(f"{m}.q", "int8", (o, i)) for m, (o, i) in shapes.items()]
    else:
        quants = [(f"{m}.q", "uint8", (o, -(-i // 2))) for m, (o, i) in shapes.items()]
    scales = [(f"{m}.scale", scale_dtype, (o, -(-i // group))) for m, (o, i) in shapes.items()]
    return quants + scales


@dataclass(frozen=True)
class ExpertRecordLayout:
    scheme: str
    group_size: int | None
    fields: tuple[Field, ...]
    record_bytes: int
    dims: tuple[int, int]  # (dim, moe_inter_dim): a nibble field's shape does not tell an odd width

    @classmethod
    def build(cls, scheme: str, dim: int, inter_dim: int, group_size: int | None = None) -> ExpertRecordLayout:
        if scheme not in SCHEMES:
            raise FormatError(f"unknown expert scheme {scheme!r:.80} (known: {list(SCHEMES)})")
        group_size = group_size if scheme in QUANT_KINDS else None
        fields, offset = [], 0
        for name, dtype, shape in _field_specs(scheme, dim, inter_dim, group_size):
            fields.append(Field(name, dtype, shape, offset))
            offset = align(fields[-1].end, FIELD_ALIGN)
        return cls(scheme, group_size, tuple(fields), align(offset, RECORD_ALIGN), (dim, inter_dim))

    @property
    def quant_kind(self) -> tuple[str, str] | None:
        """(element code, scale dtype tag) of a quantised scheme, None for bf16/f32."""
        return QUANT_KINDS.get(self.scheme)

    def in_dim(self, matrix: str) -> int:
        """Input width of w1/w3 (dim) or w2 (moe_inter_dim)."""
        return _matrix_shapes(*self.dims)[matrix][1]

    @property
    def payload_bytes(self) -> int:
        return max(f.end for f in self.fields)

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def views(self, record: np.ndarray) -> dict[str, np.ndarray]:
        """Zero-copy typed views of every field of a uint8 record buffer."""
        if record.nbytes < self.record_bytes:
            raise ValueError(f"record buffer holds {record.nbytes} bytes, layout needs {self.record_bytes}")
        flat = record.reshape(-1)
        return {f.name: flat[f.offset : f.end].view(DTYPES[f.dtype]).reshape(f.shape) for f in self.fields}

    def pack(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """One zero-padded uint8 record from arrays named like the fields (shapes/dtypes checked)."""
        record = np.zeros(self.record_bytes, dtype=np.uint8)
        if set(arrays) != {f.name for f in self.fields}:
            raise ValueError(f"expected fields {[f.name for f in self.fields]}, got {sorted(arrays)}")
        for f in self.fields:
            value = np.ascontiguousarray(arrays[f.name])
            if value.shape != f.shape or value.dtype != DTYPES[f.dtype]:
                raise ValueError(f"{f.name}: expected {f.dtype}{list(f.shape)}, got {value.dtype}{list(value.shape)}")
            record[f.offset : f.end] = value.reshape(-1).view(np.uint8)
        return record

    def to_attrs(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme,
            "group_size": self.group_size,
            "record_bytes": self.record_bytes,
            "fields": [
                {"name": f.name, "dtype": f.dtype, "shape": list(f.shape), "offset": f.offset} for f in self.fields
            ],
        }

    @classmethod
    def from_attrs(cls, attrs: Any, dim: int, inter_dim: int) -> ExpertRecordLayout:
        """Validate stored layout metadata against the layout this version derives for the model."""
        try:
            scheme, group = attrs["scheme"], attrs.get("group_size")
            stored = cls(
                scheme,
                group,
                tuple(Field(f["name"], f["dtype"], tuple(f["shape"]), int(f["offset"])) for f in attrs["fields"]),
                int(attrs["record_bytes"]),
                (dim, inter_dim),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise FormatError(f"expert layout metadata is malformed ({exc!r:.200})") from None
        if not (group is None or type(group) is int):  # build() does arithmetic with it
            raise FormatError(f"expert layout: group_size {group!r:.80} is not an integer")
        for f in stored.fields:
            if not isinstance(f.dtype, str) or f.dtype not in DTYPES:  # a list is unhashable
                raise FormatError(f"expert layout field {f.name}: unknown dtype {f.dtype!r:.80}")
            if f.offset % FIELD_ALIGN:
                raise FormatError(f"expert layout field {f.name}: offset {f.offset} is not {FIELD_ALIGN}-byte aligned")
        if stored.record_bytes % RECORD_ALIGN:
            raise FormatError(f"expert record size {stored.record_bytes} is not a multiple of {RECORD_ALIGN}")
        expected = cls.build(scheme, dim, inter_dim, group)
        if stored != expected:
            raise FormatError(
                f"expert layout metadata does not match a {scheme} layout for dim={dim}, "
                f"moe_inter_dim={inter_dim}, group_size={group}"
            )
        return stored
