"""Load a model into the engine: a Hugging Face checkpoint directory (everything resident: the float
path of the tiny fixtures, small models, exactness tests) or a converted container (dense part
resident, routed experts resident or streamed by the tiered store under a budget).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from colibri_stream.checkpoint.dtypes import COMPUTE_DTYPES, compute_dtype_of, from_stored
from colibri_stream.checkpoint.files import (
    WEIGHT_DTYPES,
    TensorInfo,
    add_shard,
    read_header,
    read_json_object,
    shard_files,
    short_name,
)
from colibri_stream.checkpoint.fingerprint import container_fingerprint
from colibri_stream.checkpoint.wrapped_configs import text_model_config
from colibri_stream.errors import CheckpointError, ColibriError
from colibri_stream.experts.cluster.group import ClusterOptions, connect
from colibri_stream.experts.codec import Settler, expert_from_record
from colibri_stream.experts.store import ExpertStore, ResidentStore
from colibri_stream.planning.budget import StoreOptions, store_plan
from colibri_stream.planning.geometry import container_args, geometry_from_container
from colibri_stream.planning.placement import bf16_held_weights, check_fits
from colibri_stream.planning.read_ahead import choose_read_ahead, last_level_cache_bytes
from colibri_stream.runtime.huge_pages import hold_in_huge_pages
from colibri_stream.runtime.memory import return_freed_heap_to_the_os
from engine.config.args import ModelArgs
from engine.config.weights import SortedNames, check_complete, layer_of, sort_names
from engine.core.interfaces import Drafter, Model
from engine.core.sources import Expert, ExpertWeights
from engine.families import meta_transformer
from engine.kernels.bf16 import hold_in_bf16, linear_candidates
from engine.kernels.int8_dense import hold_codes, interleave_codes
from engine.kernels.isa import kernel_isa
from engine.kernels.q8 import tiles_fast
from engine.kernels.quant import QuantizedMatrix
from storage.container.reader import Container, ExpertReader, is_container
from storage.errors import FormatError
from storage.files.buffers import aligned_empty
from storage.tiers.config import StoreConfig
from storage.tiers.history import UsageHistory
from storage.tiers.tiered import TieredExpertStore, total_records
from storage.tiers.trace import TraceWriter


@dataclass
class LoadedModel:
    path: Path
    config: dict[str, Any]
    args: ModelArgs
    model: Model[Any]
    experts: ExpertStore

    @property
    def drafter(self) -> Drafter | None:
        """The model as a drafter, where it has MTP modules loaded (engine/mla/mtp.py, engine/v4/mtp.py)."""
        return self.model.drafter()


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint directory; of a multimodal wrapper (Kimi-K2.5), its text model's."""
    config_path = Path(path) / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{config_path}: not found (expected a Hugging Face checkpoint directory)")
    return text_model_config(read_json_object(config_path, "the model config"), str(config_path))


def model_config(path: str | Path) -> dict[str, Any]:
    """The HF config of a container (from its attributes) or of a checkpoint directory."""
    return Container(path).model_config if is_container(path) else read_config(path)


def tensor_table(path: str | Path, allowed: dict[str, tuple[str, ...]]) -> dict[str, tuple[Path, TensorInfo]]:
    """Tensor name -> (shard, header entry) over every shard, read from the headers alone; a dtype
    outside ``allowed`` (see checkpoint_files.check_dtypes) or a name in two shards is refused."""
    table: dict[str, tuple[Path, TensorInfo]] = {}
    for file in shard_files(path):
        add_shard(table, file, read_header(file), allowed)
    return table


def check_tensors(
    args: ModelArgs,
    names: SortedNames,
    shapes: dict[str, tuple[int, ...]],
    source: str,
    config: Mapping[str, Any] | None = None,
) -> Model[Any]:
    """Everything about a checkpoint's tensors that can be checked from its headers, before a byte of
    weights is read: config.json's layer count against the layers present, names, routed experts and
    every shape against the model config.json describes (a mismatch names the ``config`` keys that
    hold the disagreeing size). Returns the meta-device model."""
    present = {layer for name in shapes if (layer := layer_of(name)) is not None}
    if args.n_layers > len(present):
        raise CheckpointError(
            f"{source}/config.json: num_hidden_layers={args.n_layers}, but the tensors hold {len(present)} layer(s)"
        )
    _check_routed_names(args, names, source)
    model = check_dense_names(args, names.unmapped, set(names.dense.values()), source)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    for hf, engine in sorted(names.dense.items()):
        _check_shape(source, hf, shapes[hf], expected[engine], config or {})
    projections = {"w1": (args.moe_inter_dim, args.dim), "w3": (args.moe_inter_dim, args.dim)}
    projections["w2"] = (args.dim, args.moe_inter_dim)
    for (_, _, proj), hf in names.routed.items():
        _check_shape(source, hf, shapes[hf], projections[proj], config or {})
    return model


def _check_shape(
    source: str, name: str, shape: tuple[int, ...], expected: tuple[int, ...], config: Mapping[str, Any]
) -> None:
    if shape != expected:
        raise CheckpointError(
            f"{source}: tensor {name} has shape {list(shape)}, config.json implies {list(expected)}"
            f"{_keys_sized(config, shape, expected)}"
        )


def _keys_sized(config: Mapping[str, Any], shape: tuple[int, ...], expected: tuple[int, ...]) -> str:
    """The config keys whose value is a size the tensor disagrees on, e.g. " (from vocab_size=10000000)".
    A size that is a product of keys (heads x head dim) names none; the shapes still say what differs."""
    differing = {e for s, e in zip(shape, expected, strict=False) if s != e} if len(shape) == len(expected) else set()
    keys = [f"{k}={v}" for k, v in config.items() if type(v) is int and v in differing]
    return f" (from {', '.join(sorted(keys))})" if keys else ""


def _check_routed_names(args: ModelArgs, names: SortedNames, source: str) -> None:
    found: dict[int, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for layer, expert, proj in names.routed:
        found[layer][expert].add(proj)
    unexpected = sorted(set(found) - set(args.moe_layers))
    if unexpected:
        raise CheckpointError(f"{source}: routed experts in dense layer(s) {unexpected}")
    for layer in args.moe_layers:
        experts = found.get(layer, {})
        if sorted(experts) != list(range(args.n_routed_experts)):
            raise CheckpointError(
                f"{source}: layer {layer} has routed experts {sorted(experts)[:8]}... "
                f"({len(experts)}), config.json n_routed_experts={args.n_routed_experts} "
                f"expects 0..{args.n_routed_experts - 1}"
            )
        for expert, projs in experts.items():
            if projs != {"w1", "w2", "w3"}:
                raise CheckpointError(
                    f"{source}: layer {layer} expert {expert} lacks {sorted({'w1', 'w2', 'w3'} - projs)}"
                )


def check_dense_names(args: ModelArgs, unmapped: list[str], loaded: set[str], source: str) -> Model[Any]:
    """The meta-device model, after refusing tensors it does not use and parameters nobody provides
    (a tied LM head may be absent: it is the embedding)."""
    model = meta_transformer(args)
    expected = set(model.state_dict())
    unused = sorted(loaded - expected)  # e.g. shared-expert tensors of a config without n_shared_experts
    if unused:
        raise CheckpointError(
            f"{source}: {len(unused)} tensor(s) have no parameter in the model config.json describes "
            f"(a count or size there disagrees with the checkpoint), e.g. {unused[:3]}"
        )
    if args.tie_word_embeddings and "head.weight" not in loaded:
        expected.discard("head.weight")
    check_complete([short_name(name) for name in unmapped], expected, loaded, source)
    return model


def load(
    path: str | Path,
    dtype: str = "float32",
    store: StoreOptions | None = None,
    activations: str = "float32",
    cluster: ClusterOptions | None = None,
) -> LoadedModel:
    """What `run`, `chat`, `serve` and `demo` load: a container streams its experts under the budget
    ``store`` describes (refused with the numbers when it cannot fit); an HF directory is resident.
    ``activations`` "int8": the kernel matmuls quantise their inputs (engine/kernels/q8.py; lossy, opt-in);
    "int8-tiles": and a prompt's rows are tile GEMMs (engine/csrc/q8_tiles.h: AVX-512 VNNI hosts).
    ``cluster``: the routed experts live in worker processes (colibri_stream/cluster); with local
    workers the budget is theirs together, so it is checked as for one process."""
    store = store or StoreOptions()
    cluster = cluster if cluster is not None and cluster.enabled else None
    trace = TraceWriter(store.trace) if store.trace else None
    int8 = check_activations(activations, dtype)
    if not is_container(path):
        if cluster is not None:
            raise ColibriError(f"{path}: workers serve a converted container's experts; convert this checkpoint first")
        loaded = load_checkpoint(path, COMPUTE_DTYPES[dtype], trace=trace)
        loaded.model.int8_activations = int8
        loaded.model.prompt_tiles = activations == "int8-tiles"
        args = loaded.args
        return _as_decode_reads_it(loaded, 3 * args.dim * args.moe_inter_dim * COMPUTE_DTYPES[dtype].itemsize)
    geometry = geometry_from_container(Container(path))
    config, placement = store_plan(store, geometry, dtype, int8)
    if cluster is None or cluster.local_workers:
        check_fits(placement)
    loaded = load_container(path, COMPUTE_DTYPES[dtype], config, trace, int8_activations=int8, cluster=cluster)
    loaded.model.prompt_tiles = activations == "int8-tiles"
    return _as_decode_reads_it(loaded, geometry.record_bytes)


def _as_decode_reads_it(loaded: LoadedModel, expert_bytes: int) -> LoadedModel:
    """The dense part moved onto huge pages (runtime/huge_pages.py); decode reads ahead into the CPU caches
    only where they hold what it reads (planning/read_ahead.py)."""
    if hold_in_huge_pages(loaded.model):
        return_freed_heap_to_the_os()  # the old tensors' small allocations
    choose_read_ahead(loaded.model, loaded.args.n_activated_experts, expert_bytes, last_level_cache_bytes())
    return loaded


ACTIVATIONS = ("float32", "int8", "int8-tiles")


def check_activations(activations: str, dtype: str) -> bool:
    """Whether the model runs with int8 activations; refuses what cannot."""
    if activations not in ACTIVATIONS:
        raise ColibriError(f"activations {activations!r}: expected one of {', '.join(ACTIVATIONS)}")
    if activations != "float32" and dtype != "float32":
        raise ColibriError(
            f"int8 activations quantise float32 inputs: use --dtype float32 with --activations {activations}"
        )
    if activations == "int8-tiles" and not tiles_fast():
        raise ColibriError(
            "--activations int8-tiles computes prompts as AVX-512 VNNI tile GEMMs, which this CPU or build lacks "
            f"({kernel_isa()}): use --activations int8"
        )
    return activations != "float32"


# ------------------------------------------------------------------------------ HF checkpoints


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", trace: TraceWriter | None = None
) -> LoadedModel:
    path = Path(path)
    config = read_config(path)
    args = ModelArgs.from_hf_config(config)
    table = tensor_table(path, WEIGHT_DTYPES)
    names = sort_names(table, args.n_layers)
    args = args.with_mtp_layers(names.mtp_layers)
    shapes = {name: info.shape for name, (_, info) in table.items()}
    model = check_tensors(args, names, shapes, str(path), config)
    # (kind, target): a dense name, or a routed (layer, expert, proj); Any: the kind says which
    wanted: dict[str, tuple[str, Any]] = {name: ("dense", target) for name, target in names.dense.items()}
    wanted.update({name: ("routed", key) for key, name in names.routed.items()})
    dense: dict[str, torch.Tensor] = {}
    routed: dict[int, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for file in sorted({file for file, _ in table.values()}):
        for name, tensor in _read_tensors(file, [n for n in wanted if table[n][0] == file], device):
            kind, target = wanted[name]
            if kind == "dense":
                dense[target] = tensor
            else:
                layer, expert, proj = target
                routed[layer][expert][proj] = tensor.to(dtype)
    if args.tie_word_embeddings and "head.weight" not in dense:
        dense["head.weight"] = dense["embed.weight"]
    for name, tensor in dense.items():
        dense[name] = tensor.to(compute_dtype_of(name, dtype))
    model.load_state_dict(dense, strict=True, assign=True)
    check_hash_tables(model, args, str(path))
    experts = ResidentStore(_routed_experts(args, routed), trace)
    return LoadedModel(path, config, args, model.eval(), experts)


def check_hash_tables(model: nn.Module, args: ModelArgs, source: str) -> None:
    """DeepSeek-V4's token -> experts tables hold expert ids of this model (an id beyond them would
    fail deep in a forward pass, or read another layer's expert)."""
    for name, table in model.named_buffers():
        if (
            name.endswith("tid2eid")
            and table.numel()
            and not 0 <= int(table.min()) <= int(table.max()) < args.n_routed_experts
        ):
            raise CheckpointError(
                f"{source}: {name} holds expert ids {int(table.min())}..{int(table.max())}, "
                f"config.json n_routed_experts={args.n_routed_experts} allows 0..{args.n_routed_experts - 1}"
            )


def _read_tensors(file: Path, names: list[str], device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors of one shard (its header already checked by checkpoint_files.read_header)."""
    try:
        with safe_open(file, framework="pt", device=device) as shard:
            for name in names:
                yield name, shard.get_tensor(name)
    except SafetensorError as exc:
        raise CheckpointError(f"{file}: unreadable safetensors file ({exc})") from None


def _routed_experts(
    args: ModelArgs, routed: dict[int, dict[int, dict[str, torch.Tensor]]]
) -> dict[int, dict[int, ExpertWeights]]:
    """Names were checked complete by check_tensors."""
    return {
        layer: {e: ExpertWeights(w["w1"], w["w2"], w["w3"]) for e, w in routed[layer].items()}
        for layer in args.moe_layers
    }


# ------------------------------------------------------------------------------ containers


def load_container(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    store: StoreConfig | None = None,
    trace: TraceWriter | None = None,
    int8_activations: bool = False,
    cluster: ClusterOptions | None = None,
) -> LoadedModel:
    """Dense part resident; experts all resident (``store`` None), streamed by a TieredExpertStore, or
    held by workers (``cluster``: ``store`` is then their budget together, split between local workers).
    ``int8_activations``: the model quantises its matmul inputs, int8 dense records stay int8, and experts
    that stay resident are held in the kernel's interleaved layout (codec.settled_expert)."""
    container = Container(path)
    args = container_args(container)
    model = _load_dense(container, args, dtype, int8_activations)
    model.int8_activations = int8_activations
    experts: ExpertStore
    if cluster is not None:
        experts = connect(container, cluster, store or StoreConfig(ram_bytes=container.expert_bytes), trace)
    elif store is None:
        experts = ResidentStore(_read_experts(container, int8_activations), trace)
    else:
        history = None
        if store.history_path is not None:
            history = UsageHistory.load(store.history_path, container.n_experts, container_fingerprint(container))
        materialize = lambda record: expert_from_record(container.layout, record)  # noqa: E731
        settle = Settler(container.layout) if int8_activations else None
        experts = TieredExpertStore(container, store, materialize, history, trace, settle)
        _preload(experts)
    return LoadedModel(Path(path), container.model_config, args, model, experts)


def _preload(store: TieredExpertStore) -> None:
    """Every expert into RAM now when the budget holds them all (``StoreConfig.preload``), with a progress
    bar on a terminal: a big model's experts take minutes to read, which the first prompt then skips. Each
    layer's resident experts are built (and settled: the store's ``settle``) as soon as its records are in,
    while the reader threads go on with the next layers', not in the first token."""
    if not store.preloads():
        return
    total = total_records(store.container) * store.record_bytes
    layers, per_layer = store.container.moe_layers, store.container.n_experts
    landed = 0

    def landed_one(done: int) -> None:  # records land in file order: layer by layer
        nonlocal landed
        bar.update(done * store.record_bytes)
        landed += done
        if landed % per_layer == 0 and landed // per_layer <= len(layers):
            store.resident(layers[landed // per_layer - 1])

    with tqdm(total=total, desc="reading experts", unit="B", unit_scale=True, disable=not sys.stderr.isatty()) as bar:
        try:
            store.preload(landed_one)
            for layer in layers:  # any left (records read before the preload): built now
                store.resident(layer)
        except BaseException:
            store.close()
            raise


def _load_dense(
    container: Container, args: ModelArgs, dtype: torch.dtype, int8_activations: bool = False
) -> Model[Any]:
    """The resident model. bf16 Linear weights of a float32 model stay bf16 on the CPU (engine/kernels/bf16.py:
    exact, half the memory and bytes per token); int8 and int4 Linear weights stay coded with int8
    activations (engine/kernels/int8_dense.py) and are dequantised otherwise; everything else is cast to ``dtype``."""
    path = str(container.path)
    model = meta_transformer(args)
    expected = dict(model.state_dict())
    check_complete([n for n in container.dense if n not in expected], expected.keys(), container.dense.keys(), path)
    held_bf16 = bf16_held_weights(container, args, dtype)
    held_int8 = linear_candidates(model) if int8_activations else set()  # the Linears, used only through forward
    state: dict[str, torch.Tensor] = {}
    coded: dict[str, tuple[torch.Tensor, torch.Tensor, int, str, int]] = {}
    kv_b_codes: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
    for name, entry in container.dense.items():
        if tuple(expected[name].shape) != entry.shape:
            raise FormatError(
                f"dense array {name}: shape {list(entry.shape)}, the model needs {list(expected[name].shape)}"
            )
        target = compute_dtype_of(name, dtype)
        if entry.dtype in ("int8", "int4"):
            assert entry.group_size is not None  # a coded array has its group size (storage.container.reader checks)
            q = torch.from_numpy(container.read_dense(name))
            scales = torch.from_numpy(container.read_dense_scales(name))
            if name in held_int8:
                coded[name] = (q, scales, entry.group_size, entry.dtype, entry.shape[1])
                continue
            if int8_activations and kv_b_codes_kept(name, entry.dtype):
                kv_b_codes[name.removesuffix(".wkv_b.weight")] = (q, scales, entry.group_size)
            matrix = QuantizedMatrix(q, scales, entry.dtype, entry.group_size, entry.shape[1])
            state[name] = matrix.dequantize(target)
        elif name in held_bf16:
            state[name] = from_stored(container.read_dense(name), entry.dtype)
        else:
            state[name] = from_stored(container.read_dense(name), entry.dtype).to(target)
    hold_codes(model, coded)
    for name, (q, scales, *_) in coded.items():
        module = name.removesuffix(".weight")
        state[f"{module}.q"], state[f"{module}.scales"] = q, scales
    model.load_state_dict(state, strict=True, assign=True)
    interleave_codes(model)
    model.hold_kv_b_int8(kv_b_codes)
    check_hash_tables(model, args, path)
    hold_in_bf16(model, held_bf16)
    return model.eval()


def kv_b_codes_kept(name: str, dtype: str) -> bool:
    """Whether dense array ``name`` of ``dtype`` is an int8 wkv_b whose records a model loaded with int8
    activations keeps beside its float32 weight for decode attention (MLA.hold_kv_b_int8)."""
    return dtype == "int8" and name.endswith(".attn.wkv_b.weight")


def _read_experts(container: Container, settle: bool = False) -> dict[int, dict[int, Expert]]:
    """Every expert read into memory; ``settle``: held as codec.Settler holds them (int8 activations)."""
    reader = ExpertReader(container)
    build = Settler(container.layout) if settle else partial(expert_from_record, container.layout)
    size = container.layout.record_bytes
    experts: dict[int, dict[int, Expert]] = {}
    for layer in container.moe_layers:
        container.check_expert_metadata(layer)
        block = aligned_empty(container.n_experts * size)  # one aligned allocation per layer
        experts[layer] = {}
        for expert in range(container.n_experts):
            record = block[expert * size : (expert + 1) * size]
            reader.read_into(layer, expert, record)
            experts[layer][expert] = build(record)
    return experts
