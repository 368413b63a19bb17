"""Expert records <-> engine experts, both directions: what ``convert`` packs and what the store's
slots are read back as. The record layout itself (fields, offsets, alignment) is storage's."""

from __future__ import annotations

import numpy as np
import torch

from colibri_stream.dtypes import TORCH_DTYPES, bf16_bits
from engine.experts import Expert, ExpertWeights
from engine.quant import QuantizedExpert, QuantizedMatrix, quantize
from storage.layout import QUANTISED, ExpertRecordLayout

MATRICES = ("w1", "w2", "w3")


def scheme_bits(scheme: str) -> int:
    return 4 if scheme == "int4" else 8


def record_views(layout: ExpertRecordLayout, record: np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero-copy typed torch views of every field of a record (host numpy buffer or device tensor)."""
    data = torch.from_numpy(record) if isinstance(record, np.ndarray) else record
    return {f.name: data[f.offset : f.end].view(TORCH_DTYPES[f.dtype]).view(f.shape) for f in layout.fields}


def expert_from_record(layout: ExpertRecordLayout, record: np.ndarray | torch.Tensor) -> Expert:
    """Engine expert over the views of one record, copying nothing: quantised records stay quantised,
    float records are cast to the activations' dtype per call."""
    views = record_views(layout, record)
    if layout.scheme in QUANTISED:
        bits = scheme_bits(layout.scheme)
        return QuantizedExpert(*(QuantizedMatrix(views[f"{m}.q"], views[f"{m}.scale"], bits) for m in MATRICES))
    return ExpertWeights(*(views[m] for m in MATRICES))


def record_from_expert(layout: ExpertRecordLayout, weights: dict[str, torch.Tensor]) -> np.ndarray:
    """One record's bytes from an expert's float matrices {w1, w2, w3}, in the layout's scheme."""
    arrays: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if layout.scheme in QUANTISED:
            q, scales = quantize(w, scheme_bits(layout.scheme), layout.group_size)
            arrays[f"{name}.q"], arrays[f"{name}.scale"] = q.numpy(), scales.numpy()
        elif layout.scheme == "bf16":
            arrays[name] = bf16_bits(w)
        else:
            arrays[name] = w.float().numpy()
    return layout.pack(arrays)
