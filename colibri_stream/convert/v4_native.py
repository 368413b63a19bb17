"""DeepSeek-V4 as DeepSeek ships it, read through the formats `convert` already knows.

The hub files hold attention and shared-expert weights in FP8 e4m3 with ue8m0 block scales, and the
routed experts in FP4 e2m1: ``<m>.weight`` int8 [out, in / 2] (two codes per byte, even column in the
low nibble) with ``<m>.scale`` e8m0 [out, in / 32]; every scale is ``<m>.scale`` (DeepSeek's name,
transformers reads it as ``weight_scale_inv``). config.json says so with an FP8 ``quantization_config``
whose ``expert_dtype`` is "fp4".

Those are byte for byte the FP8 blocks DeepSeek-V3 ships and compressed-tensors' mxfp4 rows, so the
table is only renamed: an FP4 module's tensors become ``weight_packed``/``weight_scale`` (copied into
mxfp4 records, never requantised), an FP8 module's scale becomes ``weight_scale_inv`` (dequantised
at conversion as V3's). ``shipped`` maps each new name back to the tensor in the file.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from colibri_stream.checkpoint.files import (
    E8M0_SCALE_DTYPES,
    FLOAT_DTYPES,
    FP8_DTYPE,
    FP8_SCALE_SUFFIX,
    WEIGHT_DTYPES,
    TensorInfo,
)
from colibri_stream.checkpoint.packed_quant import PACKED, SCALE
from colibri_stream.errors import CheckpointError

SCALE_NAME = ".scale"
FP4_DTYPE = "I8"  # two e2m1 codes per byte
ROUTED_SUFFIXES = (".w1.weight", ".w2.weight", ".w3.weight")

Table = dict[str, tuple[Path, TensorInfo]]


def allowed_dtypes() -> dict[str, tuple[str, ...]]:
    """Name suffix -> safetensors dtypes a V4-native checkpoint may hold (checkpoint_files.check_dtypes)."""
    weights = FLOAT_DTYPES + (FP8_DTYPE,)
    allowed = {**WEIGHT_DTYPES, "": weights, SCALE_NAME: E8M0_SCALE_DTYPES + ("F32",)}
    allowed.update({suffix: weights + (FP4_DTYPE,) for suffix in ROUTED_SUFFIXES})
    return allowed


def renamed_table(table: Table) -> tuple[Table, dict[str, str]]:
    """(the table in the FP8 + mxfp4 vocabulary, new name -> shipped name)."""
    renamed: Table = {}
    shipped: dict[str, str] = {}
    consumed = set()
    for name in sorted(n for n in table if n.endswith(SCALE_NAME)):
        base = name[: -len(SCALE_NAME)]
        weight = f"{base}.weight"
        if weight not in table:
            raise CheckpointError(f"{table[name][0]}: scale {name} has no weight {weight}")
        file, info = table[weight]
        if info.dtype == FP4_DTYPE:
            renamed[base + PACKED] = (file, replace(info, dtype="U8"))
            renamed[base + SCALE] = (table[name][0], replace(table[name][1], dtype="U8"))
            shipped.update({base + PACKED: weight, base + SCALE: name})
            consumed.add(weight)
        elif info.dtype == FP8_DTYPE:
            renamed[weight + FP8_SCALE_SUFFIX] = table[name]
            shipped[weight + FP8_SCALE_SUFFIX] = name
        else:
            raise CheckpointError(f"{file}: {weight} is {info.dtype} but has a scale {name} (expected FP8 or FP4)")
        consumed.add(name)
    for name, entry in table.items():
        if name in consumed:
            continue
        scaled = name + FP8_SCALE_SUFFIX in renamed
        if entry[1].dtype == FP4_DTYPE or (entry[1].dtype == FP8_DTYPE and not scaled):
            scale = name.removesuffix(".weight") + SCALE_NAME
            what = "FP4 codes (I8)" if entry[1].dtype == FP4_DTYPE else "FP8 weight"
            raise CheckpointError(f"{entry[0]}: {what} {name} has no scales {scale}")
        renamed[name] = entry
    return renamed, shipped
