"""Model geometry: the sizes placement is computed from, read from a converted container or derived
from a config.json plus the options a conversion would use (`plan` before the download).

Both paths end in one ``ModelGeometry`` (dense arrays with their stored dtypes, the expert record
layout, MoE layers x experts, the RAM-slot floor), so `plan` computes a container and a checkpoint
the same way. Nothing here reads a tensor: the config path takes dense shapes from the meta-device
model, the record size from storage.layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibri_stream.checkpoint_files import read_json_object
from colibri_stream.dtypes import stored_dense_dtype
from colibri_stream.errors import USER_ERRORS, CheckpointError, ColibriError
from engine.args import ConfigError, ModelArgs
from engine.config_checks import brief
from engine.model import meta_transformer
from engine.weights import check_complete
from storage.container import Container, is_container
from storage.errors import FormatError
from storage.layout import SCHEMES, ExpertRecordLayout
from storage.tiered import minimum_slots
from storage.verify import verify_container

# What `convert` writes unless told otherwise (its ConvertOptions take these defaults).
EXPERT_SCHEMES = SCHEMES
DENSE_SCHEMES = ("bf16", "f32", "int8")
DEFAULT_EXPERTS = "int4"
DEFAULT_GROUP_SIZE = 64
DEFAULT_DENSE = "bf16"


@dataclass(frozen=True)
class ContainerTarget:
    """The container a conversion would write: routed-expert scheme, group size, dense scheme."""

    experts: str = DEFAULT_EXPERTS
    group_size: int = DEFAULT_GROUP_SIZE
    dense: str = DEFAULT_DENSE

    def __post_init__(self) -> None:
        if self.experts not in EXPERT_SCHEMES:
            raise ColibriError(f"--experts must be one of {EXPERT_SCHEMES}, got {self.experts!r}")
        if self.dense not in DENSE_SCHEMES:
            raise ColibriError(f"--dense must be one of {DENSE_SCHEMES}, got {self.dense!r}")
        if self.group_size <= 0 or self.group_size % 2:
            raise ColibriError(f"--group-size must be a positive even number, got {self.group_size}")


@dataclass(frozen=True)
class DenseArray:
    name: str  # engine parameter name
    shape: tuple[int, ...]
    dtype: str  # stored dtype tag (storage.layout.DTYPES)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelGeometry:
    """Everything placement needs, whichever way it was obtained."""

    kind: str  # "container", "checkpoint" (an HF directory) or "config" (a bare config.json)
    description: str  # what the numbers describe, e.g. "as converted: experts int4 g64, dense bf16"
    args: ModelArgs
    dense: tuple[DenseArray, ...]
    layout: ExpertRecordLayout
    n_moe_layers: int
    experts_per_layer: int
    minimum_slots: int  # the store's floor of RAM slots

    @property
    def record_bytes(self) -> int:
        return self.layout.record_bytes

    @property
    def total_records(self) -> int:
        return self.n_moe_layers * self.experts_per_layer

    @property
    def expert_bytes(self) -> int:
        return self.total_records * self.record_bytes

    @property
    def active_records_per_token(self) -> int:
        """Routed experts one decode token reads: top-k per MoE layer."""
        return self.n_moe_layers * self.args.n_activated_experts


def config_floor(args: ModelArgs) -> int:
    """The RAM-slot floor of a model not converted yet: the store's rule (storage.tiered.minimum_slots,
    which containers use) computed from the config: the top-k records one token routes to per layer."""
    return args.n_activated_experts


def dequantised_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json as the converted model has it: an FP8 ``quantization_config`` (DeepSeek-V3, Kimi-K2)
    describes the source only; convert dequantises it."""
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ConfigError(f"config.json: quantization_config={brief(quant)}, expected an object (or null)")
    return {k: v for k, v in config.items() if k != "quantization_config"}


def container_args(container: Container) -> ModelArgs:
    """The model a container describes, after checking its dense table and expert layers against it:
    the layer count against the layers the table holds before anything is built per layer, then every
    name and shape against the meta-device model. A container `verify` passes can be loaded."""
    args = ModelArgs.from_hf_config(container.model_config)
    where = f"{container.path}: model_config"
    present = {name.split(".")[1] for name in container.dense if name.startswith("layers.")}
    if args.n_layers > len(present):
        raise FormatError(f"{where} num_hidden_layers={args.n_layers}, the dense table holds {len(present)} layer(s)")
    if container.moe_layers != args.moe_layers or container.n_experts != args.n_routed_experts:
        raise FormatError(
            f"{where} makes layers {list(args.moe_layers)} MoE, experts.layers lists {list(container.moe_layers)}"
        )
    expected = {name: tuple(p.shape) for name, p in meta_transformer(args).state_dict().items()}
    if args.tie_word_embeddings and "head.weight" not in container.dense:
        expected.pop("head.weight")
    check_complete([n for n in container.dense if n not in expected], expected, container.dense, str(container.path))
    for name, entry in container.dense.items():
        if entry.shape != expected[name]:
            raise FormatError(f"dense array {name}: shape {list(entry.shape)}, the model needs {list(expected[name])}")
    return args


def container_problems(path: str | Path) -> list[str]:
    """`verify`: the container's structure and checksums (storage.verify), and the model it describes."""

    def model_problems(container: Container) -> list[str]:
        try:
            container_args(container)
        except USER_ERRORS as exc:
            return [str(exc)]
        return []

    return verify_container(path, check_model=model_problems)


def geometry_from_container(container: Container) -> ModelGeometry:
    args = container_args(container)
    dense = tuple(DenseArray(name, tuple(e.shape), e.dtype) for name, e in container.dense.items())
    layout = container.layout
    group = f" g{layout.group_size}" if layout.group_size else ""
    return ModelGeometry(
        kind="container",
        description=f"container {container.path}: experts {layout.scheme}{group}",
        args=args,
        dense=dense,
        layout=layout,
        n_moe_layers=len(container.moe_layers),
        experts_per_layer=container.n_experts,
        minimum_slots=minimum_slots(container),
    )


def geometry_from_config(config: Mapping[str, Any], target: ContainerTarget, kind: str = "config") -> ModelGeometry:
    """The geometry of the container `convert` would write from a checkpoint with this config.json."""
    args = ModelArgs.from_hf_config(dequantised_config(config))
    layout = ExpertRecordLayout.build(target.experts, args.dim, args.moe_inter_dim, target.group_size)
    dense = tuple(
        DenseArray(name, tuple(p.shape), stored_dense_dtype(name, tuple(p.shape), target.dense, target.group_size))
        for name, p in meta_transformer(args).state_dict().items()
        if not (args.tie_word_embeddings and name == "head.weight")
    )
    group = f" g{target.group_size}" if layout.group_size else ""
    quant = config.get("quantization_config") or {}  # an object: dequantised_config checked it
    source = f"{quant.get('quant_method', 'quantised')} checkpoint, " if quant else ""
    return ModelGeometry(
        kind=kind,
        description=f"{source}as converted: experts {target.experts}{group}, dense {target.dense}",
        args=args,
        dense=dense,
        layout=layout,
        n_moe_layers=len(args.moe_layers),
        experts_per_layer=args.n_routed_experts,
        minimum_slots=config_floor(args),
    )


def model_geometry(path: str | Path, target: ContainerTarget | None = None) -> ModelGeometry:
    """A container's geometry, or the one a conversion of an HF directory / a config.json would have."""
    path = Path(path)
    target = target or ContainerTarget()
    if path.is_dir() and is_container(path):
        return geometry_from_container(Container(path))
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise CheckpointError(f"{path}: neither a container, a checkpoint directory nor a config.json")
    kind = "checkpoint" if path.is_dir() and any(path.glob("*.safetensors")) else "config"
    return geometry_from_config(read_json_config(config_path), target, kind)


def read_json_config(path: Path) -> dict[str, Any]:
    return read_json_object(path, "the model config")
