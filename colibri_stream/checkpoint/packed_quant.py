"""What a compressed-tensors ``quantization_config`` announces: routed experts shipped in 4 bits.

Two formats are read (learned from compressed-tensors 0.20.1's compressors, not from memory):
  pack-quantized        int4, symmetric, strategy group (any even group size): per quantised module
                        ``<m>.weight_packed`` int32 [out, ceil(in / 8)] (eight nibbles q + 8 per word,
                        element i at bits 4i), ``<m>.weight_scale`` [out, ceil(in / group)] in the
                        model's float dtype, ``<m>.weight_shape`` int32/int64 [2] = [out, in]
  mxfp4-pack-quantized  fp4 e2m1, group 32: ``<m>.weight_packed`` uint8 [out, in / 2] (two nibbles per
                        byte, even column low), ``<m>.weight_scale`` uint8 e8m0 [out, in / 32]
Anything else the config can say (zero points, other bit widths or formats, quantised activations or
KV cache) changes the math or the layout and is refused with one line naming config.json.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibri_stream.errors import CheckpointError
from engine.config.checks import brief

METHOD = "compressed-tensors"
PACK = "pack-quantized"
MXFP4 = "mxfp4-pack-quantized"
FORMATS = (PACK, MXFP4)
PACKED, SCALE, SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"
SUPPORTED = (
    f"supported: quant_method {METHOD}, format {PACK} (int4 symmetric, strategy group) or {MXFP4} "
    "(fp4 group 32), weights only"
)
# Safetensors dtypes of each tensor a quantised module ships (checkpoint_files.check_dtypes' suffixes).
PACKED_DTYPES = {PACK: ("I32",), MXFP4: ("U8",)}
SCALE_DTYPES = {PACK: ("BF16", "F16", "F32"), MXFP4: ("U8",)}
SHAPE_DTYPES = ("I32", "I64")
# pack-quantized scales as shipped -> the record kind that holds them unchanged (F32: none does)
PACK_PASSTHROUGH = {"BF16": "int4-bf16scale", "F16": "int4"}


@dataclass(frozen=True)
class PackedFormat:
    """The routed experts' shipped quantisation, from config.json."""

    format: str  # PACK or MXFP4
    group_size: int

    @property
    def code(self) -> str:
        """engine.kernels.quant's element code."""
        return "int4" if self.format == PACK else "fp4"

    def passthrough(self, scale_dtype: str = "BF16") -> str | None:
        """The record kind that holds the shipped codes and scales as they are (None: none does)."""
        return "mxfp4" if self.format == MXFP4 else PACK_PASSTHROUGH.get(scale_dtype)

    def allowed_dtypes(self) -> dict[str, tuple[str, ...]]:
        """Tensor-name suffix -> safetensors dtypes (the rest are the float weights of ignored modules)."""
        allowed = {PACKED: PACKED_DTYPES[self.format], SCALE: SCALE_DTYPES[self.format]}
        return {**allowed, SHAPE: SHAPE_DTYPES} if self.format == PACK else allowed


def is_v4_native(config: Mapping[str, Any]) -> bool:
    """DeepSeek-V4 as shipped: an FP8 quantization_config whose routed experts are FP4 (``expert_dtype``),
    stored as mxfp4 rows are (colibri_stream/convert/v4_native.py)."""
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "fp8" and quant.get("expert_dtype") == "fp4"


def packed_format(config: Mapping[str, Any], source: str | Path) -> PackedFormat | None:
    """How config.json says the routed experts are packed: a compressed-tensors format, DeepSeek-V4's FP4
    (mxfp4, group 32), or None for another (or no) quant_method."""
    if is_v4_native(config):
        return PackedFormat(MXFP4, 32)
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != METHOD:
        return None
    where = f"{Path(source) / 'config.json'}: quantization_config"
    fmt = quant.get("format")
    groups = quant.get("config_groups")
    if fmt not in FORMATS:
        raise CheckpointError(f"{where} format {brief(fmt)} is not supported ({SUPPORTED})")
    if quant.get("kv_cache_scheme") is not None:
        raise CheckpointError(f"{where} kv_cache_scheme is set: a quantised KV cache is not supported ({SUPPORTED})")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where} config_groups={brief(groups)}, expected an object of schemes")
    weights = [_scheme_weights(f"{where} config_groups.{name}", scheme, fmt) for name, scheme in groups.items()]
    if len({w["group_size"] for w in weights}) != 1:
        raise CheckpointError(f"{where}: config_groups use several group sizes; one is supported ({SUPPORTED})")
    return PackedFormat(fmt, weights[0]["group_size"])


def _scheme_weights(where: str, scheme: Any, fmt: str) -> dict[str, Any]:
    if not isinstance(scheme, dict):
        raise CheckpointError(f"{where}={brief(scheme)}, expected a scheme object")
    if scheme.get("format", fmt) not in (fmt, None):
        raise CheckpointError(f"{where}.format {brief(scheme.get('format'))} differs from format {fmt} ({SUPPORTED})")
    for activations in ("input_activations", "output_activations"):
        if scheme.get(activations) is not None:
            raise CheckpointError(f"{where}.{activations} is set: quantised activations are not supported")
    weights = scheme.get("weights")
    if not isinstance(weights, dict):
        raise CheckpointError(f"{where}.weights={brief(weights)}, expected quantisation arguments")
    kind = "int" if fmt == PACK else "float"
    expected = {"num_bits": 4, "type": kind, "symmetric": True, "strategy": "group", "dynamic": False}
    for key, value in expected.items():
        if weights.get(key, value) != value or (key != "dynamic" and key not in weights):
            raise CheckpointError(f"{where}.weights.{key}={brief(weights.get(key))}, expected {value!r} ({SUPPORTED})")
    group = weights.get("group_size")
    if type(group) is not int or group < 2 or group % 2:
        raise CheckpointError(
            f"{where}.weights.group_size={brief(group)}: expected a positive even group size (two weights share "
            "a byte of the record, so an odd group would split a byte between two scales)"
        )
    if fmt == MXFP4 and group != 32:
        raise CheckpointError(f"{where}.weights.group_size={group}: {MXFP4} blocks are 32 elements")
    if weights.get("actorder") not in (None, False):
        order = brief(weights.get("actorder"))
        raise CheckpointError(f"{where}.weights.actorder={order}: reordered groups are not supported")
    return weights
