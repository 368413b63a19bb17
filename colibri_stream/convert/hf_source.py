"""Lazy, shard-aware reading of a Hugging Face checkpoint directory for conversion.

Tensors are read one at a time through ``safe_open`` (memory-mapped); shards are opened per unit of
work and closed after it, so the mapped pages a unit touched stop counting against this process.
FP8 checkpoints in DeepSeek's layout (float8_e4m3fn ``weight`` + a ``weight_scale_inv`` per 128x128
block, announced by ``quantization_config``; float32 scales, or power-of-two e8m0 bytes under
``scale_fmt: ue8m0`` as DeepSeek-V4's dense weights ship) are dequantised to float32 on read: exact,
and dense weights stay resident, so 8-bit dense storage is `--dense int8`'s choice, not the source's. Modules
quantised by compressed-tensors (convert/compressed_tensors_source.py) appear as one logical
``<module>.weight`` each: read as shipped (``get_quantized``) or dequantised (``get``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from colibri_stream.checkpoint.files import (
    E8M0_SCALE_DTYPES,
    FLOAT_DTYPES,
    FP8_DTYPE,
    FP8_SCALE_SUFFIX,
    WEIGHT_DTYPES,
    TensorInfo,
)
from colibri_stream.checkpoint.packed_quant import PackedFormat, is_v4_native, packed_format
from colibri_stream.convert.compressed_tensors_source import SUFFIXES, PackedModule, packed_modules, read_packed
from colibri_stream.convert.v4_native import allowed_dtypes as v4_allowed_dtypes
from colibri_stream.convert.v4_native import renamed_table
from colibri_stream.errors import CheckpointError
from colibri_stream.planning.geometry import dequantised_config
from colibri_stream.runtime.loader import check_tensors, read_config, tensor_table
from engine.config.args import ModelArgs
from engine.config.checks import brief
from engine.config.weights import sort_names
from engine.kernels.quant import QuantizedMatrix, dequantize_torch, scale_values

COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class HFSource:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = read_config(self.path)
        native = is_v4_native(self.config)  # DeepSeek-V4 as shipped: FP8 dense, FP4 experts
        self.packed: PackedFormat | None = packed_format(self.config, self.path)
        quant = self.config.get("quantization_config")
        self.block = self._fp8_block(quant) if native or not self.packed else None
        # Headers only, each checked (checkpoint_files.read_header); FP8 / packed weights only where announced.
        allowed = dict(WEIGHT_DTYPES)
        if self.block:
            allowed.update({"": FLOAT_DTYPES + (FP8_DTYPE,), FP8_SCALE_SUFFIX: FLOAT_DTYPES + E8M0_SCALE_DTYPES})
        if self.packed:
            allowed.update(self.packed.allowed_dtypes())
        table = self.read_table(v4_allowed_dtypes() if native else allowed)
        # logical (as the FP8 and packed paths name them) -> shipped tensor name, where they differ
        self.shipped: dict[str, str] = {}
        if native:
            table, self.shipped = renamed_table(table)
        self.files = sorted({file for file, _ in table.values()})
        self.where: dict[str, Path] = {name: file for name, (file, _) in table.items()}  # shipped tensor -> shard
        # logical name (a quantised module's "<m>.weight") -> its packed tensors
        self.packed_modules: dict[str, PackedModule] = (
            packed_modules(table, self.packed, self.path) if self.packed else {}
        )
        logical = _logical_table(table, self.packed_modules)
        self.shapes: dict[str, tuple[int, ...]] = {name: info.shape for name, info in logical.items()}
        self.stored_bytes = {name: info.nbytes for name, info in logical.items()}  # bytes on disk, for progress
        args = ModelArgs.from_hf_config(self.dense_config())
        names = sort_names(self.tensor_names, args.n_layers)
        check_tensors(args.with_mtp_layers(names.mtp_layers), names, self.shapes, str(self.path), self.dense_config())
        if self.block:
            self._check_fp8_scales({name: info.dtype for name, (_, info) in table.items()}, self.block)

    def read_table(self, allowed: dict[str, tuple[str, ...]]) -> dict[str, tuple[Path, TensorInfo]]:
        """Tensor name -> (shard, header entry), from the shards' headers (a source whose shards are
        not on disk yet reads them elsewhere: convert/pull_source.py)."""
        return tensor_table(self.path, allowed)

    def _check_fp8_scales(self, dtypes: dict[str, str], block: tuple[int, int]) -> None:
        """Every FP8 weight's block scales present and shaped for it, from the headers: refused before
        the conversion starts (and its progress bar), not midway through it."""
        for name, dtype in dtypes.items():
            if dtype != FP8_DTYPE:
                continue
            scale = name + FP8_SCALE_SUFFIX
            if scale not in self.shapes:
                raise CheckpointError(f"{self.where[name]}: FP8 tensor {name} has no {scale}")
            expected = [-(-d // b) for d, b in zip(self.shapes[name], block, strict=False)]
            if len(self.shapes[name]) != 2 or list(self.shapes[scale]) != expected:
                raise CheckpointError(
                    f"{self.where[scale]}: tensor {scale} has shape {list(self.shapes[scale])}, FP8 weight {name} "
                    f"{list(self.shapes[name])} in {list(block)} blocks needs {expected}"
                )

    def _fp8_block(self, quant: Any) -> tuple[int, int] | None:
        if quant is not None and not isinstance(quant, dict):
            raise CheckpointError(
                f"{self.path / 'config.json'}: quantization_config={brief(quant)}, expected an object "
                "(quant_method fp8, fmt e4m3, weight_block_size [rows, cols])"
            )
        if not quant:
            return None
        method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
        block, scale_fmt = quant.get("weight_block_size"), quant.get("scale_fmt", "float")
        sizes = isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
        if method != "fp8" or fmt != "e4m3" or not sizes or scale_fmt not in ("float", "ue8m0"):
            raise CheckpointError(
                f"{self.path / 'config.json'}: quantization_config {brief(quant)} is not supported "
                "(supported: quant_method fp8, fmt e4m3, weight_block_size [rows, cols], scale_fmt float or "
                "ue8m0; or quant_method compressed-tensors)"
            )
        return int(block[0]), int(block[1])  # type: ignore[index]  # a list of two, checked by `sizes`

    @property
    def tensor_names(self) -> list[str]:
        """Every logical tensor except FP8 scales, which are consumed with their weights."""
        return [n for n in self.shapes if not (self.block and n.endswith(FP8_SCALE_SUFFIX))]

    @property
    def scale_dtype(self) -> str | None:
        """The one safetensors dtype of the quantised modules' scales (None: nothing is quantised)."""
        dtypes = sorted({m.scale_dtype for m in self.packed_modules.values()})
        if len(dtypes) > 1:
            raise CheckpointError(f"{self.path}: weight_scale tensors mix dtypes {dtypes}; one is supported")
        return dtypes[0] if dtypes else None

    def unit_bytes(self, names: list[str]) -> int:
        """Bytes on disk of ``names`` and their FP8 scales."""
        return sum(self.stored_bytes[n] + self.stored_bytes.get(n + FP8_SCALE_SUFFIX, 0) for n in names)

    def dense_config(self) -> dict[str, Any]:
        """config.json as the converted (dequantised) model has it."""
        return dequantised_config(self.config)

    @contextlib.contextmanager
    def reading(self, where: dict[str, Path] | None = None) -> Iterator[TensorReader]:
        reader = TensorReader(self, where)
        try:
            yield reader
        finally:
            reader.close()

    def identity(self) -> dict[str, Any]:
        """Cheap fingerprint of the source files (names, sizes, mtimes) to refuse mixing sources."""
        return {file.name: {"size": file.stat().st_size, "mtime_ns": file.stat().st_mtime_ns} for file in self.files}

    def shard_sha256(self) -> dict[str, str]:
        digests = {}
        for file in self.files:
            digest = hashlib.sha256()
            with open(file, "rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
            digests[file.name] = digest.hexdigest()
        return digests

    def copy_side_files(self, dst: Path) -> list[str]:
        copied = []
        for name in COPIED_FILES:
            source = self.path / name
            if source.is_file():
                data = source.read_bytes()
                if name == "config.json":
                    data = (json.dumps(self.dense_config(), indent=2, sort_keys=True) + "\n").encode()
                (dst / name).write_bytes(data)
                copied.append(name)
        return copied


class TensorReader:
    """Open shards on demand within one unit of work; float32 tensors out."""

    def __init__(self, source: HFSource, where: dict[str, Path] | None = None):
        self.source = source
        # tensor -> the file to read it from: the source's shards, or (a streaming pull) only the tensors on disk now
        self.where = source.where if where is None else where
        self._open: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()

    def _shard(self, name: str):
        file = self.where.get(name)
        if file is None:
            raise CheckpointError(f"{self.source.path}: tensor {name} is missing")
        if file not in self._open:
            try:
                self._open[file] = self._stack.enter_context(safe_open(file, framework="pt"))
            except SafetensorError as exc:
                raise CheckpointError(f"{file}: unreadable safetensors file ({exc})") from None
        return self._open[file]

    def _raw(self, name: str) -> torch.Tensor:
        """A shipped tensor as stored."""
        try:
            return self._shard(name).get_tensor(self.source.shipped.get(name, name))
        except SafetensorError as exc:
            raise CheckpointError(f"{self.source.where[name]}: tensor {name} unreadable ({exc})") from None

    def get_quantized(self, name: str) -> QuantizedMatrix:
        """A quantised module's logical weight as shipped: codes in our record layout, its own scales."""
        # packed_modules is empty unless the source ships a packed format
        return read_packed(self._raw, self.source.packed_modules[name], self.source.packed)  # type: ignore[arg-type]

    def get(self, name: str) -> torch.Tensor:
        if name in self.source.packed_modules:  # the float32 weight the codes mean: q * scale, exact
            return dequantize_torch(self.get_quantized(name))
        tensor = self._raw(name)
        if tensor.dtype == torch.float8_e4m3fn:
            if self.source.block is None:
                raise CheckpointError(
                    f"{self.source.path}: {name} is float8 but config.json has no quantization_config"
                )
            scale_name = name + FP8_SCALE_SUFFIX
            if scale_name not in self.source.where:
                raise CheckpointError(f"{self.source.path}: FP8 tensor {name} has no {scale_name}")
            return dequantize_fp8_blocks(tensor, self._raw(scale_name), self.source.block)
        if tensor.dtype in (torch.int64, torch.int32):
            return tensor  # an integer table (tid2eid, the only one WEIGHT_DTYPES admits): never through float
        if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise CheckpointError(f"{self.source.path}: {name} has unsupported dtype {tensor.dtype}")
        return tensor.float()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()


def _logical_table(table: dict[str, tuple[Path, TensorInfo]], modules: dict[str, PackedModule]) -> dict:
    """Shipped tensors with each quantised module's tensors replaced by its logical [out, in] weight."""
    shipped = {m.base + suffix for m in modules.values() for suffix in SUFFIXES}
    logical = {name: info for name, (_, info) in table.items() if name not in shipped}
    logical.update({name: TensorInfo("packed", m.shape, m.nbytes) for name, m in modules.items()})
    return logical


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [out, in] float8 * scale_inv [ceil(out/bo), ceil(in/bi)] per block -> float32 [out, in]."""
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // block[0]), -(-in_dim // block[1])
    if tuple(scale_inv.shape) != (rows, cols):
        raise CheckpointError(
            f"FP8 scale shape {list(scale_inv.shape)} does not match weight {[out_dim, in_dim]} in {block} blocks"
        )
    scale = scale_values(scale_inv).repeat_interleave(block[0], 0)[:out_dim]  # float or e8m0 bytes
    scale = scale.repeat_interleave(block[1], 1)[:, :in_dim]
    return weight.float() * scale
