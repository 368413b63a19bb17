"""Model geometry: the sizes placement is computed from, read from a converted container or derived
from a config.json plus the options a conversion would use (`plan` before the download).

Both paths end in one ``ModelGeometry`` (dense arrays with their stored dtypes, the expert record
layout, MoE layers x experts, the RAM-slot floor), so `plan` computes a container and a checkpoint
the same way. Nothing here reads a tensor: the config path takes dense shapes from the meta-device
model, the record size from storage.container.layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from colibri_stream.checkpoint.dtypes import stored_dense_dtype
from colibri_stream.checkpoint.files import read_header, read_json_object, shard_files
from colibri_stream.checkpoint.packed_quant import PackedFormat, packed_format
from colibri_stream.checkpoint.wrapped_configs import text_model_config
from colibri_stream.errors import USER_ERRORS, CheckpointError, ColibriError
from engine.config.args import ConfigError, ModelArgs, shipped_mtp_layers
from engine.config.checks import brief
from engine.config.weights import check_complete, sort_names
from engine.families import meta_transformer
from storage.container.layout import QUANTISED_DENSE, SCHEMES, ExpertRecordLayout, stored_shape
from storage.container.reader import Container, is_container
from storage.container.verify import verify_container
from storage.errors import FormatError
from storage.tiers.tiered import minimum_slots

# What `convert` writes unless told otherwise (its ConvertOptions take these defaults).
AUTO = "auto"  # --experts auto: a quantised source's routed experts as shipped, int4 otherwise
# Kinds this converter quantises (or casts) itself; int4-bf16scale and mxfp4 records are only ever
# copied from a source that ships them (auto).
PASSTHROUGH_SCHEMES = ("int4-bf16scale", "mxfp4")
EXPERT_SCHEMES = (AUTO, *(s for s in SCHEMES if s not in PASSTHROUGH_SCHEMES))
DENSE_SCHEMES = ("bf16", "f32", "int8", "int4")
DEFAULT_EXPERTS = AUTO
REQUANTISED_EXPERTS = "int4"  # what auto means for a float (or FP8) source
DEFAULT_GROUP_SIZE = 64
DEFAULT_DENSE = "bf16"
MTP_PREFIX = "mtp."  # the engine parameters of the multi-token-prediction modules (engine/mla/mtp.py)


@dataclass(frozen=True)
class ContainerTarget:
    """The container a conversion would write: routed-expert scheme, group size, dense scheme.

    ``group_size`` None means the default: the source's own groups where experts are copied as shipped,
    DEFAULT_GROUP_SIZE where anything is quantised here."""

    experts: str = DEFAULT_EXPERTS
    group_size: int | None = None
    dense: str = DEFAULT_DENSE
    mtp: bool = True  # keep the multi-token-prediction modules the checkpoint ships (engine/mla/mtp.py)

    def __post_init__(self) -> None:
        if self.experts not in EXPERT_SCHEMES:
            raise ColibriError(f"--experts must be one of {EXPERT_SCHEMES}, got {self.experts!r}")
        if self.dense not in DENSE_SCHEMES:
            raise ColibriError(f"--dense must be one of {DENSE_SCHEMES}, got {self.dense!r}")
        if self.group_size is not None and (self.group_size <= 0 or self.group_size % 2):
            raise ColibriError(
                f"--group-size must be a positive even number, got {self.group_size} (int4 packs two weights "
                "per byte: an odd group would split a byte between two scales)"
            )

    @property
    def quant_group_size(self) -> int:
        """The group of what this conversion quantises itself (int4/int8 experts, int8 dense)."""
        return self.group_size or DEFAULT_GROUP_SIZE

    def passthrough(self, packed: PackedFormat | None) -> TypeGuard[PackedFormat]:
        """Whether routed experts are copied as shipped rather than (re-)quantised here."""
        return self.experts == AUTO and packed is not None

    def expert_kind(self, packed: PackedFormat | None, scale_dtype: str | None = None) -> tuple[str, int]:
        """(record scheme, group size) of the routed experts, for a source shipping ``packed`` experts
        (None: float or FP8) whose scales are ``scale_dtype`` (a safetensors tag; None: bfloat16, what
        compressed-tensors writes for a bf16 model)."""
        if not self.passthrough(packed):
            return (REQUANTISED_EXPERTS if self.experts == AUTO else self.experts), self.quant_group_size
        kind = packed.passthrough(scale_dtype or "BF16")
        if kind is None:
            raise ColibriError(
                f"--experts auto: the source's {packed.format} scales are {scale_dtype}, which no record kind holds "
                "as shipped; pass --experts int4 (or int8/bf16/f32) to re-quantise from the dequantised weights"
            )
        if self.group_size not in (None, packed.group_size):
            raise ColibriError(
                f"--group-size {self.group_size} contradicts the source's group size {packed.group_size} "
                "(config.json quantization_config): --experts auto copies the shipped groups; drop --group-size, "
                "or pass --experts int4 to re-quantise at another group size"
            )
        return kind, packed.group_size


@dataclass(frozen=True)
class DenseArray:
    name: str  # engine parameter name
    shape: tuple[int, ...]
    dtype: str  # stored dtype tag (storage.container.layout.DTYPES)
    group_size: int | None = None  # int8 / int4 codes: columns per float16 scale

    @property
    def coded_bytes(self) -> int:
        """The codes and their float16 scales as stored (int8 / int4 arrays only)."""
        assert self.group_size is not None, f"{self.name} is not coded"
        scales = math.prod(self.shape[:-1]) * -(-self.shape[-1] // self.group_size)
        return math.prod(stored_shape(self.shape, self.dtype)) + 2 * scales

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
    mtp_left_out: int  # MTP modules the model ships that are not held (mtp_not_held)

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
        """Routed experts one decode token reads: top-k per MoE layer of the main model (an MTP module's
        block runs only when drafting, which is opt-in)."""
        return (self.n_moe_layers - self.args.n_mtp_layers) * self.args.n_activated_experts

    @property
    def mtp_records(self) -> int:
        """The expert records of the MTP modules' blocks (layer ids n_layers..)."""
        return self.args.n_mtp_layers * self.experts_per_layer


def config_floor(args: ModelArgs) -> int:
    """The RAM-slot floor of a model not converted yet: the store's rule (storage.tiers.tiered.minimum_slots,
    which containers use) computed from the config: the top-k records one token routes to per layer."""
    return args.n_activated_experts


def dequantised_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json as the converted model has it: an FP8 ``quantization_config`` (DeepSeek-V3, Kimi-K2)
    describes the source only; convert dequantises it."""
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ConfigError(f"config.json: quantization_config={brief(quant)}, expected an object (or null)")
    return {k: v for k, v in config.items() if k != "quantization_config"}


def mtp_layers_held(dense_names: Iterable[str]) -> int:
    """The MTP modules a container holds: those whose joining projection is stored (mtp.I.eh_proj; DeepSeek-V4's
    mtp.I.e_proj)."""
    joins = (".eh_proj.weight", ".e_proj.weight")
    return sum(1 for name in dense_names if name.startswith(MTP_PREFIX) and name.endswith(joins))


def planned_mtp_layers(
    config: Mapping[str, Any], args: ModelArgs, target: ContainerTarget, tensor_names: Iterable[str] | None
) -> int:
    """The MTP modules a conversion keeps: none with --no-mtp; else those the checkpoint's tensors hold
    (convert's rule, engine.config.weights.sort_names), or before the download (``tensor_names`` None) those its
    config ships."""
    if not target.mtp:
        return 0
    if tensor_names is None:
        return shipped_mtp_layers(config)
    return sort_names(tensor_names, args.n_layers).mtp_layers


def mtp_not_held(config: Mapping[str, Any], args: ModelArgs) -> int:
    """The MTP modules the model ships (its config says) that ``args`` do not hold: left out by --no-mtp,
    or absent from the checkpoint."""
    return max(0, shipped_mtp_layers(config) - args.n_mtp_layers)


def _converted_array(name: str, shape: tuple[int, ...], scheme: str, group_size: int) -> DenseArray:
    """A dense parameter as `convert --dense scheme` stores it."""
    dtype = stored_dense_dtype(name, shape, scheme, group_size)
    return DenseArray(name, shape, dtype, group_size if dtype in QUANTISED_DENSE else None)


def checkpoint_tensor_names(directory: Path) -> list[str]:
    """Every tensor name of a checkpoint directory's shards (their headers; no tensor is read)."""
    return [name for shard in shard_files(directory) for name in read_header(shard)]


def container_args(container: Container) -> ModelArgs:
    """The model a container describes, after checking its dense table and expert layers against it:
    the layer count against the layers the table holds before anything is built per layer, then every
    name and shape against the meta-device model. A container `verify` passes can be loaded."""
    args = ModelArgs.from_hf_config(container.model_config)
    args = args.with_mtp_layers(mtp_layers_held(container.dense))
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
    """`verify`: the container's structure and checksums (storage.container.verify), and the model it describes."""

    def model_problems(container: Container) -> list[str]:
        try:
            container_args(container)
        except USER_ERRORS as exc:
            return [str(exc)]
        return []

    return verify_container(path, check_model=model_problems)


def geometry_from_container(container: Container) -> ModelGeometry:
    args = container_args(container)
    dense = tuple(DenseArray(name, tuple(e.shape), e.dtype, e.group_size) for name, e in container.dense.items())
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
        mtp_left_out=mtp_not_held(container.model_config, args),
    )


def geometry_from_config(
    config: Mapping[str, Any],
    target: ContainerTarget,
    kind: str = "config",
    source: str | Path = ".",
    tensor_names: Iterable[str] | None = None,
) -> ModelGeometry:
    """The geometry of the container `convert` would write from a checkpoint with this config.json (a
    compressed-tensors source sized at the record kind its experts convert to; its scales taken to be
    bfloat16: float16 ones make a record of the same size), with the MTP modules ``planned_mtp_layers``
    keeps: ``tensor_names`` are the checkpoint's where its shards are here (None: the config's word)."""
    args = ModelArgs.from_hf_config(dequantised_config(config))
    args = args.with_mtp_layers(planned_mtp_layers(config, args, target, tensor_names))
    packed = packed_format(config, source)
    scheme, group_size = target.expert_kind(packed)
    layout = ExpertRecordLayout.build(scheme, args.dim, args.moe_inter_dim, group_size)
    group_of_dense = target.quant_group_size
    dense = tuple(
        _converted_array(name, tuple(p.shape), target.dense, group_of_dense)
        for name, p in meta_transformer(args).state_dict().items()
        if not (args.tie_word_embeddings and name == "head.weight")
    )
    group = f" g{group_size}" if layout.group_size else ""
    quant = config.get("quantization_config") or {}  # an object: dequantised_config checked it
    shipped = f"{packed.format} " if packed else ""
    source_text = f"{quant.get('quant_method', 'quantised')} {shipped}checkpoint, " if quant else ""
    copied = " (as shipped)" if target.passthrough(packed) else ""
    return ModelGeometry(
        kind=kind,
        description=f"{source_text}as converted: experts {scheme}{group}{copied}, dense {target.dense}",
        args=args,
        dense=dense,
        layout=layout,
        n_moe_layers=len(args.moe_layers),
        experts_per_layer=args.n_routed_experts,
        minimum_slots=config_floor(args),
        mtp_left_out=mtp_not_held(config, args),
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
    if path.is_dir() and any(path.glob("*.safetensors")):  # the MTP layers its shards hold, as convert keeps them
        config = read_json_config(config_path)
        return geometry_from_config(config, target, "checkpoint", path, checkpoint_tensor_names(path))
    return geometry_from_config(read_json_config(config_path), target, "config", config_path.parent)


def read_json_config(path: Path) -> dict[str, Any]:
    """A config.json; of a multimodal wrapper (Kimi-K2.5), its text model's."""
    return text_model_config(read_json_object(path, "the model config"), str(path))
