"""Load a model into the engine: a Hugging Face checkpoint directory (everything resident: the float
path of the tiny fixtures, small models, exactness tests) or a converted container (dense part
resident, routed experts resident or streamed by the tiered store under a budget).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from colibri_stream.config import StoreOptions, store_config
from colibri_stream.dtypes import COMPUTE_DTYPES, FLOAT32_PARAMETERS, from_stored
from colibri_stream.errors import CheckpointError
from colibri_stream.expert_codec import expert_from_record
from colibri_stream.expert_store import ExpertStore, ResidentStore
from colibri_stream.fingerprint import container_fingerprint
from colibri_stream.geometry import geometry_from_container
from colibri_stream.placement import bf16_held_weights, check_fits, plan
from engine.args import ModelArgs
from engine.bf16 import hold_in_bf16
from engine.experts import Expert, ExpertWeights
from engine.model import Transformer, meta_transformer
from engine.quant import dequantize
from engine.weights import check_complete, sort_names
from storage.buffers import aligned_empty
from storage.container import Container, ExpertReader, is_container
from storage.errors import FormatError
from storage.history import UsageHistory
from storage.tiered import StoreConfig, TieredExpertStore
from storage.trace import TraceWriter


@dataclass
class LoadedModel:
    path: Path
    config: dict[str, Any]
    args: ModelArgs
    model: Transformer
    experts: ExpertStore


def read_config(path: str | Path) -> dict[str, Any]:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found (expected a Hugging Face checkpoint directory)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path}: invalid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    return config


def model_config(path: str | Path) -> dict[str, Any]:
    """The HF config of a container (from its attributes) or of a checkpoint directory."""
    return Container(path).model_config if is_container(path) else read_config(path)


def shard_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in model.safetensors.index.json but missing")
    return files


def check_dense_names(args: ModelArgs, unmapped: list[str], loaded: set[str], source: str) -> Transformer:
    """The meta-device model, after refusing tensors it does not use and parameters nobody provides
    (a tied LM head may be absent: it is the embedding)."""
    model = meta_transformer(args)
    expected = set(model.state_dict())
    if args.tie_word_embeddings and "head.weight" not in loaded:
        expected.discard("head.weight")
    check_complete(unmapped, expected, loaded, source)
    return model


def load(path: str | Path, dtype: str = "float32", store: StoreOptions | None = None) -> LoadedModel:
    """What `run`, `chat`, `serve` and `demo` load: a container streams its experts under the budget
    ``store`` describes (refused with the numbers when it cannot fit); an HF directory is resident."""
    store = store or StoreOptions()
    trace = TraceWriter(store.trace) if store.trace else None
    if not is_container(path):
        return load_checkpoint(path, COMPUTE_DTYPES[dtype], trace=trace)
    geometry = geometry_from_container(Container(path))
    config = store_config(store, geometry, dtype)
    check_fits(plan(geometry, config, dtype))
    return load_container(path, COMPUTE_DTYPES[dtype], config, trace)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A converted container or a Hugging Face checkpoint directory, every expert resident."""
    return load_container(path, dtype) if is_container(path) else load_checkpoint(path, dtype)


# ------------------------------------------------------------------------------ HF checkpoints


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", trace: TraceWriter | None = None
) -> LoadedModel:
    path = Path(path)
    config = read_config(path)
    args = ModelArgs.from_hf_config(config)
    dense: dict[str, torch.Tensor] = {}
    routed: dict[int, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    unmapped: list[str] = []
    for file in shard_files(path):
        with safe_open(file, framework="pt", device=device) as shard:
            names = sort_names(shard.keys(), args.n_layers)
            unmapped += names.unmapped
            for (layer, expert, proj), name in names.routed.items():
                routed[layer][expert][proj] = shard.get_tensor(name).to(dtype)
            for name, target in names.dense.items():
                dense[target] = shard.get_tensor(name)
    model = check_dense_names(args, unmapped, set(dense), str(path))
    if args.tie_word_embeddings and "head.weight" not in dense:
        dense["head.weight"] = dense["embed.weight"]
    for name, tensor in dense.items():
        dense[name] = tensor.to(torch.float32 if name.endswith(FLOAT32_PARAMETERS) else dtype)
    model.load_state_dict(dense, strict=True, assign=True)
    experts = ResidentStore(_routed_experts(args, routed, path), trace)
    return LoadedModel(path, config, args, model.eval(), experts)


def _routed_experts(args: ModelArgs, routed: dict, path: Path) -> dict[int, dict[int, ExpertWeights]]:
    unexpected = sorted(set(routed) - set(args.moe_layers))
    if unexpected:
        raise CheckpointError(f"{path}: routed experts in dense layer(s) {unexpected}")
    experts: dict[int, dict[int, ExpertWeights]] = {}
    for layer in args.moe_layers:
        found = routed.get(layer, {})
        if sorted(found) != list(range(args.n_routed_experts)):
            raise CheckpointError(
                f"{path}: layer {layer} has routed experts {sorted(found)[:8]}... "
                f"({len(found)}), expected 0..{args.n_routed_experts - 1}"
            )
        for expert, weights in found.items():
            if set(weights) != {"w1", "w2", "w3"}:
                raise CheckpointError(
                    f"{path}: layer {layer} expert {expert} lacks {sorted({'w1', 'w2', 'w3'} - set(weights))}"
                )
        experts[layer] = {e: ExpertWeights(w["w1"], w["w2"], w["w3"]) for e, w in found.items()}
    return experts


# ------------------------------------------------------------------------------ containers


def load_container(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    store: StoreConfig | None = None,
    trace: TraceWriter | None = None,
) -> LoadedModel:
    """Dense part resident; experts all resident (``store`` None) or streamed by a TieredExpertStore."""
    container = Container(path)
    args = ModelArgs.from_hf_config(container.model_config)
    model = _load_dense(container, args, dtype)
    experts: ExpertStore
    if store is None:
        experts = ResidentStore(_read_experts(container), trace)
    else:
        history = None
        if store.history_path is not None:
            history = UsageHistory.load(store.history_path, container.n_experts, container_fingerprint(container))
        materialize = lambda record: expert_from_record(container.layout, record)  # noqa: E731
        experts = TieredExpertStore(container, store, materialize, history, trace)
    return LoadedModel(Path(path), container.model_config, args, model, experts)


def _load_dense(container: Container, args: ModelArgs, dtype: torch.dtype) -> Transformer:
    """The resident model. bf16 Linear weights of a float32 model stay bf16 on the CPU (engine/bf16.py:
    exact, half the memory and bytes per token); everything else is cast to ``dtype``."""
    path = str(container.path)
    model = meta_transformer(args)
    expected = dict(model.state_dict())
    check_complete([n for n in container.dense if n not in expected], expected.keys(), container.dense.keys(), path)
    held_bf16 = bf16_held_weights(container, args, dtype)
    state = {}
    for name, entry in container.dense.items():
        if tuple(expected[name].shape) != entry.shape:
            raise FormatError(
                f"dense array {name}: shape {list(entry.shape)}, the model needs {list(expected[name].shape)}"
            )
        target = torch.float32 if name.endswith(FLOAT32_PARAMETERS) else dtype
        if entry.dtype == "int8":
            q, scales = (
                torch.from_numpy(container.read_dense(name)),
                torch.from_numpy(container.read_dense_scales(name)),
            )
            state[name] = dequantize(q, scales, 8, target)
        elif name in held_bf16:
            state[name] = from_stored(container.read_dense(name), entry.dtype)
        else:
            state[name] = from_stored(container.read_dense(name), entry.dtype).to(target)
    model.load_state_dict(state, strict=True, assign=True)
    hold_in_bf16(model, held_bf16)
    return model.eval()


def _read_experts(container: Container) -> dict[int, dict[int, Expert]]:
    reader = ExpertReader(container, direct=False)
    size = container.layout.record_bytes
    experts: dict[int, dict[int, Expert]] = {}
    for layer in container.moe_layers:
        container.check_expert_metadata(layer)
        block = aligned_empty(container.n_experts * size)  # one aligned allocation per layer
        experts[layer] = {}
        for expert in range(container.n_experts):
            record = block[expert * size : (expert + 1) * size]
            reader.read_into(layer, expert, record)
            experts[layer][expert] = expert_from_record(container.layout, record)
    return experts
