"""Load a converted container into the engine with every expert resident (streaming comes with the
tiered store): dense arrays through zarr, expert records through the fast read path."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from colibri_stream.checkpoint import FLOAT32_PARAMETERS, LoadedModel, load_checkpoint
from engine.args import ModelArgs
from engine.bf16 import bf16_candidates, bf16_kernel_available, hold_in_bf16
from engine.experts import Expert, ExpertWeights, ResidentExperts
from engine.model import Transformer
from engine.quant import QuantizedExpert, QuantizedMatrix, dequantize
from engine.weights import check_complete
from storage.buffers import aligned_empty
from storage.container import Container, ExpertReader, is_container
from storage.errors import FormatError
from storage.history import UsageHistory
from storage.layout import ExpertRecordLayout
from storage.tiered import StoreConfig, TieredExpertStore

MATRICES = ("w1", "w2", "w3")


def to_torch(array: np.ndarray, dtype_tag: str) -> torch.Tensor:
    """A dense numpy array from the container as torch (bfloat16 bits reinterpreted, no copy)."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype_tag == "bfloat16" else tensor


TORCH_DTYPES = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float16": torch.float16,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}


def record_views(layout: ExpertRecordLayout, record: np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero-copy typed torch views of every field of a record (host numpy buffer or device tensor)."""
    data = torch.from_numpy(record) if isinstance(record, np.ndarray) else record
    return {f.name: data[f.offset : f.end].view(TORCH_DTYPES[f.dtype]).view(f.shape) for f in layout.fields}


def expert_from_record(layout: ExpertRecordLayout, record: np.ndarray | torch.Tensor) -> Expert:
    """Engine expert over the views of one record, copying nothing: quantised records stay quantised,
    float records are cast to the activations' dtype per call."""
    views = record_views(layout, record)
    if layout.scheme in ("int4", "int8"):
        bits = 4 if layout.scheme == "int4" else 8
        return QuantizedExpert(*(QuantizedMatrix(views[f"{m}.q"], views[f"{m}.scale"], bits) for m in MATRICES))
    return ExpertWeights(*(views[m] for m in MATRICES))


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A converted container or a Hugging Face checkpoint directory, whichever ``path`` is."""
    return load_container(path, dtype) if is_container(path) else load_checkpoint(path, dtype)


def load_container(
    path: str | Path, dtype: torch.dtype = torch.float32, store: StoreConfig | None = None
) -> LoadedModel:
    """Dense part resident; experts all resident (``store`` None) or streamed by a TieredExpertStore."""
    container = Container(path)
    args = ModelArgs.from_hf_config(container.model_config)
    model = _load_dense(container, args, dtype)
    if store is None:
        experts = ResidentExperts(_read_experts(container, direct=False))
    else:
        history = None
        if store.history_path is not None:
            history = UsageHistory.load(store.history_path, container.n_experts, container_fingerprint(container))
        experts = TieredExpertStore(
            container, store, lambda record: expert_from_record(container.layout, record), history
        )
    return LoadedModel(Path(path), container.model_config, args, model, experts)


def container_fingerprint(container: Container) -> str:
    """Identifies the container's contents (its expert checksums and config), for histories and KV logs."""
    payload = json.dumps({"config": container.model_config, "experts": container.attrs["experts"]}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def bf16_held_weights(container: Container, candidates: set[str], dtype: torch.dtype) -> set[str]:
    """The dense arrays a float32 model on this CPU keeps in bf16: bf16 in the container and candidates
    of engine.bf16 (bias-free Linears used only through forward). None without the C kernel."""
    if dtype != torch.float32 or not bf16_kernel_available():
        return set()
    return {name for name, entry in container.dense.items() if entry.dtype == "bfloat16" and name in candidates}


def _load_dense(container: Container, args: ModelArgs, dtype: torch.dtype) -> Transformer:
    """The resident model. bf16 Linear weights of a float32 model stay bf16 on the CPU (engine/bf16.py:
    exact, half the memory and bytes per token); everything else is cast to ``dtype``."""
    with torch.device("meta"):
        model = Transformer(args)
    expected = dict(model.state_dict())
    path = str(container.path)
    check_complete([n for n in container.dense if n not in expected], expected.keys(), container.dense.keys(), path)
    held_bf16 = bf16_held_weights(container, bf16_candidates(model), dtype)
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
            state[name] = to_torch(container.read_dense(name), entry.dtype)
        else:
            state[name] = to_torch(container.read_dense(name), entry.dtype).to(target)
    model.load_state_dict(state, strict=True, assign=True)
    hold_in_bf16(model, held_bf16)
    return model.eval()


def _read_experts(container: Container, direct: bool) -> dict[int, dict[int, Expert]]:
    reader = ExpertReader(container, direct=direct)
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
