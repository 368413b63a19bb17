"""Byte layout of one routed-expert record: where gate/up/down and their scales sit in the chunk.

A record is the unit the hot path reads with a single pread. Fields start on 64-byte boundaries (so
numpy/torch views of them are SIMD-aligned) and the record is padded to a multiple of 4 KiB (so
O_DIRECT reads of whole records are legal). The layout is stored in the container's attributes and
re-derived on open; a mismatch is a FormatError, never a guess.

Matrices: w1 (gate) and w3 (up) are [inter, dim], w2 (down) is [dim, inter].
  int4: "<w>.q" uint8 [out, in // 2] (two nibbles per byte) + "<w>.scale" float16 [out, in // group]
  int8: "<w>.q" int8 [out, in]                                + "<w>.scale" float16 [out, in // group]
  bf16: "<w>" bfloat16 bits as uint16 [out, in];  f32: "<w>" float32 [out, in]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from storage.errors import FormatError

FIELD_ALIGN = 64
RECORD_ALIGN = 4096
SCHEMES = ("int4", "int8", "bf16", "f32")
QUANTISED = ("int4", "int8")
# numpy has no bfloat16: its bits are stored as uint16 and tagged "bfloat16" in metadata.
DTYPES = {
    "uint8": np.uint8,
    "int8": np.int8,
    "float16": np.float16,
    "float32": np.float32,
    "bfloat16": np.uint16,
}
MATRICES = ("w1", "w3", "w2")


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
        return int(np.prod(self.shape)) * np.dtype(DTYPES[self.dtype]).itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _matrix_shapes(dim: int, inter_dim: int) -> dict[str, tuple[int, int]]:
    return {"w1": (inter_dim, dim), "w3": (inter_dim, dim), "w2": (dim, inter_dim)}


def _field_specs(scheme: str, dim: int, inter_dim: int, group_size: int | None) -> list[tuple[str, str, tuple]]:
    shapes = _matrix_shapes(dim, inter_dim)
    if scheme in ("bf16", "f32"):
        dtype = "bfloat16" if scheme == "bf16" else "float32"
        return [(m, dtype, shapes[m]) for m in MATRICES]
    if not group_size or group_size <= 0:
        raise FormatError(f"scheme {scheme} needs a positive group size, got {group_size!r:.80}")
    for m, (_, in_dim) in shapes.items():
        if in_dim % group_size:
            raise FormatError(f"{m}: input dimension {in_dim} is not a multiple of group size {group_size}")
    if scheme == "int4":
        quants = [(f"{m}.q", "uint8", (o, i // 2)) for m, (o, i) in shapes.items()]
    else:
        quants = [(f"{m}.q", "int8", (o, i)) for m, (o, i) in shapes.items()]
    scales = [(f"{m}.scale", "float16", (o, i // group_size)) for m, (o, i) in shapes.items()]
    return quants + scales


@dataclass(frozen=True)
class ExpertRecordLayout:
    scheme: str
    group_size: int | None
    fields: tuple[Field, ...]
    record_bytes: int

    @classmethod
    def build(cls, scheme: str, dim: int, inter_dim: int, group_size: int | None = None) -> ExpertRecordLayout:
        if scheme not in SCHEMES:
            raise FormatError(f"unknown expert scheme {scheme!r:.80} (known: {list(SCHEMES)})")
        group_size = group_size if scheme in QUANTISED else None
        fields, offset = [], 0
        for name, dtype, shape in _field_specs(scheme, dim, inter_dim, group_size):
            fields.append(Field(name, dtype, shape, offset))
            offset = align(fields[-1].end, FIELD_ALIGN)
        return cls(scheme, group_size, tuple(fields), align(offset, RECORD_ALIGN))

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
