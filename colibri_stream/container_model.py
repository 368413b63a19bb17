"""Load a converted container into the engine with every expert resident (streaming comes with the
tiered store): dense arrays through zarr, expert records through the fast read path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from colibri_stream.checkpoint import FLOAT32_PARAMETERS, LoadedModel, load_checkpoint
from engine.args import ModelArgs
from engine.experts import Expert, ExpertWeights, ResidentExperts
from engine.model import Transformer
from engine.quant import QuantizedExpert, QuantizedMatrix
from engine.weights import check_complete
from storage.buffers import aligned_empty
from storage.container import Container, ExpertReader, is_container
from storage.errors import FormatError
from storage.layout import ExpertRecordLayout

MATRICES = ("w1", "w2", "w3")


def to_torch(array: np.ndarray, dtype_tag: str) -> torch.Tensor:
    """A numpy array from the container as torch (bfloat16 bits reinterpreted, no copy)."""
    tensor = torch.from_numpy(array)
    if dtype_tag == "bfloat16":
        return tensor.view(torch.int16).view(torch.bfloat16) if array.dtype == np.uint16 else tensor
    return tensor


def expert_from_record(layout: ExpertRecordLayout, record: np.ndarray, dtype: torch.dtype) -> Expert:
    """Engine expert over the views of one record (quantised records stay quantised)."""
    views = layout.views(record)
    if layout.scheme in ("int4", "int8"):
        bits = 4 if layout.scheme == "int4" else 8
        return QuantizedExpert(
            *(
                QuantizedMatrix(torch.from_numpy(views[f"{m}.q"]), torch.from_numpy(views[f"{m}.scale"]), bits)
                for m in MATRICES
            )
        )
    tag = "bfloat16" if layout.scheme == "bf16" else "float32"
    return ExpertWeights(*(to_torch(views[m], tag).to(dtype) for m in MATRICES))


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A converted container or a Hugging Face checkpoint directory, whichever ``path`` is."""
    return load_container(path, dtype) if is_container(path) else load_checkpoint(path, dtype)


def load_container(path: str | Path, dtype: torch.dtype = torch.float32, direct: bool = False) -> LoadedModel:
    container = Container(path)
    args = ModelArgs.from_hf_config(container.model_config)
    with torch.device("meta"):
        model = Transformer(args)
    expected = dict(model.state_dict())
    check_complete(
        [n for n in container.dense if n not in expected], expected.keys(), container.dense.keys(), str(path)
    )
    state = {}
    for name, entry in container.dense.items():
        if tuple(expected[name].shape) != entry.shape:
            raise FormatError(
                f"dense array {name}: shape {list(entry.shape)}, the model needs {list(expected[name].shape)}"
            )
        tensor = to_torch(container.read_dense(name), entry.dtype)
        state[name] = tensor.to(torch.float32 if name.endswith(FLOAT32_PARAMETERS) else dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return LoadedModel(
        Path(path),
        container.model_config,
        args,
        model.eval(),
        ResidentExperts(_read_experts(container, dtype, direct)),
    )


def _read_experts(container: Container, dtype: torch.dtype, direct: bool) -> dict[int, dict[int, Expert]]:
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
            experts[layer][expert] = expert_from_record(container.layout, record, dtype)
    return experts
