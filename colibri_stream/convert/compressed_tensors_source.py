"""The tensors of a compressed-tensors checkpoint (colibri_stream.checkpoint.packed_quant has the formats): each
quantised module's packed codes, scales and shape, checked from the headers and presented as one
logical ``<module>.weight`` of shape [out, in], read back as an engine QuantizedMatrix in our record's
byte layout without dequantising.

pack-quantized codes need one repacking step: a row's int32 words, viewed as little-endian bytes, are
already our nibble order (element 2k in the low nibble of byte k, the value q + 8 that our int4 code
reads as n - 8: compressed-tensors' own unpack_from_int32 splits the bytes the same way), but a row
holds 4 * ceil(in / 8) bytes where a record row holds ceil(in / 2), and the padding nibble of an odd
width is 0 there, 8 (int4's zero) here. mxfp4 rows are our layout byte for byte.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from colibri_stream.checkpoint.files import TensorInfo, short_name
from colibri_stream.checkpoint.packed_quant import MXFP4, PACK, PACKED, SCALE, SHAPE, PackedFormat
from colibri_stream.errors import CheckpointError
from engine.kernels.quant import QuantizedMatrix, n_groups, packed_width

SUFFIXES = (PACKED, SCALE, SHAPE)


@dataclass(frozen=True)
class PackedModule:
    """One quantised module: its shipped tensors and the [out, in] weight they encode."""

    base: str  # module name, e.g. "model.layers.1.mlp.experts.0.gate_proj"
    shape: tuple[int, int]
    scale_dtype: str  # safetensors dtype tag of weight_scale
    nbytes: int  # bytes on disk of its tensors, for progress

    @property
    def name(self) -> str:
        """The logical tensor name the engine's name mapping sees."""
        return self.base + ".weight"


def packed_modules(
    table: dict[str, tuple[Path, TensorInfo]], fmt: PackedFormat, source: Path
) -> dict[str, PackedModule]:
    """Logical name -> module, for every module shipping ``weight_packed``; each module's tensors
    present and shaped for the weight they encode (refused naming the tensor otherwise)."""
    bases = {name[: -len(PACKED)] for name in table if name.endswith(PACKED)}
    for name in table:
        base = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s)), None)
        if base is not None and base not in bases:
            raise CheckpointError(f"{table[name][0]}: tensor {short_name(name)} has no {short_name(base + PACKED)}")
        if name.endswith(".weight") and name[: -len(".weight")] in bases:
            module = short_name(name[: -len(".weight")])
            raise CheckpointError(f"{table[name][0]}: module {module} ships both weight and {PACKED[1:]}")
    shapes = _shipped_shapes(table, bases, fmt, source)
    modules = {}
    for base in sorted(bases):
        _check_module(table, base, shapes[base], fmt)
        parts = [table[base + s][1].nbytes for s in SUFFIXES if base + s in table]
        modules[base + ".weight"] = PackedModule(base, shapes[base], table[base + SCALE][1].dtype, sum(parts))
    return modules


def _shipped_shapes(
    table: dict[str, tuple[Path, TensorInfo]], bases: set[str], fmt: PackedFormat, source: Path
) -> dict[str, tuple[int, int]]:
    """[out, in] per module: pack-quantized says it in ``weight_shape`` (read here: 2 integers per
    module); mxfp4 rows are whole bytes, so [out, 2 * bytes]."""
    for base in bases:
        if base + SCALE not in table:
            raise CheckpointError(f"{source}: quantised module {short_name(base)} has no {short_name(base + SCALE)}")
        if fmt.format == PACK and base + SHAPE not in table:
            raise CheckpointError(f"{source}: quantised module {short_name(base)} has no {short_name(base + SHAPE)}")
    if fmt.format == MXFP4:
        return {b: _mx_shape(b + PACKED, *table[b + PACKED]) for b in bases}
    by_file: dict[Path, list[str]] = {}
    for base in bases:
        by_file.setdefault(table[base + SHAPE][0], []).append(base)
    shapes = {}
    for file, file_bases in sorted(by_file.items()):
        try:
            with safe_open(file, framework="pt") as shard:
                for base in file_bases:
                    shapes[base] = _weight_shape(file, base + SHAPE, table[base + SHAPE][1], shard.get_tensor)
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: unreadable safetensors file ({exc})") from None
    return shapes


def _mx_shape(name: str, file: Path, info: TensorInfo) -> tuple[int, int]:
    if len(info.shape) != 2:
        raise CheckpointError(f"{file}: tensor {short_name(name)} has shape {list(info.shape)}, expected [out, in / 2]")
    return info.shape[0], 2 * info.shape[1]


def _weight_shape(file: Path, name: str, info: TensorInfo, get: Callable[[str], torch.Tensor]) -> tuple[int, int]:
    if info.shape != (2,):
        raise CheckpointError(
            f"{file}: tensor {short_name(name)} has shape {list(info.shape)}, expected [2]: [out, in]"
        )
    out_dim, in_dim = (int(v) for v in get(name).tolist())
    if out_dim < 1 or in_dim < 1:
        raise CheckpointError(f"{file}: tensor {short_name(name)} = {[out_dim, in_dim]} is not a weight shape")
    return out_dim, in_dim


Table = dict[str, tuple[Path, TensorInfo]]


def _check_module(table: Table, base: str, shape: tuple[int, int], fmt: PackedFormat) -> None:
    out_dim, in_dim = shape
    words = -(-in_dim // 8) if fmt.format == PACK else in_dim // 2  # int32 words / bytes per row
    expected = {PACKED: (out_dim, words), SCALE: (out_dim, n_groups(in_dim, fmt.group_size))}
    said = f"weight_shape {list(shape)}" if fmt.format == PACK else f"{fmt.format}"
    for suffix, want in expected.items():
        file, info = table[base + suffix]
        if info.shape != want:
            raise CheckpointError(
                f"{file}: tensor {short_name(base + suffix)} has shape {list(info.shape)}, {said} at group size "
                f"{fmt.group_size} needs {list(want)}"
            )


def read_packed(get: Callable[[str], torch.Tensor], module: PackedModule, fmt: PackedFormat) -> QuantizedMatrix:
    """The module's codes in our record layout and its scales as shipped (bf16 / f16 / e8m0; f32 scales
    come back as float32, which only the dequantising path takes)."""
    packed, scales = get(module.base + PACKED), get(module.base + SCALE)
    in_dim = module.shape[1]
    # DeepSeek-V4 ships the same bytes as int8 codes and float8_e8m0fnu scales (convert/v4_native.py)
    packed = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    scales = scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales
    q = nibble_rows(packed, in_dim) if fmt.format == PACK else packed.contiguous()
    return QuantizedMatrix(q, scales.contiguous(), fmt.code, fmt.group_size, in_dim)


def nibble_rows(words: torch.Tensor, in_dim: int) -> torch.Tensor:
    """int32 [out, ceil(in / 8)] pack-quantized words -> uint8 [out, ceil(in / 2)] int4 nibbles."""
    out_dim = words.shape[0]
    data = words.contiguous().view(torch.uint8).view(out_dim, -1, 4)
    if sys.byteorder == "big":  # the words' value is the format: element i at bits 4i
        data = data.flip(-1)
    q = data.reshape(out_dim, -1)[:, : packed_width(in_dim)].clone()
    if in_dim % 2:
        q[:, -1] = (q[:, -1] & 0x0F) | 0x80
    return q
