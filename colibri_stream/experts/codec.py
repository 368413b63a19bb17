"""Expert records <-> engine experts, both directions: what ``convert`` packs and what the store's
slots are read back as. The record layout itself (fields, offsets, alignment) is storage's."""

from __future__ import annotations

import numpy as np
import torch

from colibri_stream.checkpoint.dtypes import TORCH_DTYPES, bf16_bits
from engine.core.sources import Expert, ExpertWeights
from engine.kernels.interleaved_expert import interleave_into, interleaves
from engine.kernels.quant import QuantizedExpert, QuantizedMatrix, quantize
from storage.container.layout import ExpertRecordLayout

MATRICES = ("w1", "w2", "w3")


def record_views(layout: ExpertRecordLayout, record: np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero-copy typed torch views of every field of a record (host numpy buffer or device tensor)."""
    data = torch.from_numpy(record) if isinstance(record, np.ndarray) else record
    return {f.name: data[f.offset : f.end].view(TORCH_DTYPES[f.dtype]).view(f.shape) for f in layout.fields}


def expert_from_record(layout: ExpertRecordLayout, record: np.ndarray | torch.Tensor) -> Expert:
    """Engine expert over the views of one record, copying nothing: quantised records stay quantised,
    float records are cast to the activations' dtype per call."""
    views = record_views(layout, record)
    kind = layout.quant_kind
    if kind is not None:
        assert layout.group_size is not None  # ExpertRecordLayout.build gives every quantised scheme a group
        return QuantizedExpert(
            *(
                QuantizedMatrix(views[f"{m}.q"], views[f"{m}.scale"], kind[0], layout.group_size, layout.in_dim(m))
                for m in MATRICES
            )
        )
    return ExpertWeights(*(views[m] for m in MATRICES))


def settled_expert(
    layout: ExpertRecordLayout, record: np.ndarray | torch.Tensor, scratch: torch.Tensor | None = None
) -> Expert:
    """The expert of a record that stays in this memory for the rest of the run, for a model with int8
    activations: its bytes rearranged in place into the q8 kernel's interleaved layout where its matrices
    allow (engine/kernels/interleaved_expert.py; same products, read as one stream per 4 rows), else
    ``expert_from_record``'s views. The memory then no longer holds the container's bytes. ``scratch``:
    uint8 memory of ``layout.record_bytes`` or more to reuse (``Settler``)."""
    expert = expert_from_record(layout, record)
    if not isinstance(expert, QuantizedExpert) or not interleaves(expert):
        return expert
    data = torch.from_numpy(record) if isinstance(record, np.ndarray) else record
    return interleave_into(expert, data.view(-1), scratch)


class Settler:
    """``settled_expert`` for one container's records, one scratch buffer reused for every record (the
    store's ``settle``, called from one thread)."""

    def __init__(self, layout: ExpertRecordLayout):
        self.layout = layout
        self.scratch = torch.empty(layout.record_bytes + 6 * 64, dtype=torch.uint8)  # six arrays, 64-aligned

    def __call__(self, record: np.ndarray | torch.Tensor) -> Expert:
        return settled_expert(self.layout, record, self.scratch)


def record_from_expert(layout: ExpertRecordLayout, weights: dict[str, torch.Tensor]) -> np.ndarray:
    """One record's bytes from an expert's float matrices {w1, w2, w3}, quantised by our own quantiser
    (int4 / int8 schemes) or stored as floats (bf16 / f32)."""
    arrays: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if layout.scheme in ("int4", "int8"):
            assert layout.group_size is not None  # ExpertRecordLayout.build gives every quantised scheme a group
            q, scales = quantize(w, 4 if layout.scheme == "int4" else 8, layout.group_size)
            arrays[f"{name}.q"], arrays[f"{name}.scale"] = q.numpy(), scales.numpy()
        elif layout.scheme == "bf16":
            arrays[name] = bf16_bits(w)
        elif layout.scheme == "f32":
            arrays[name] = w.float().numpy()
        else:
            raise ValueError(f"{layout.scheme} records are copied from a quantised source, not quantised here")
    return layout.pack(arrays)


def record_from_quantized(layout: ExpertRecordLayout, matrices: dict[str, QuantizedMatrix]) -> np.ndarray:
    """One record's bytes from already-quantised matrices {w1, w2, w3} (a pre-quantised source's codes
    and scales, copied without dequantising)."""
    arrays: dict[str, np.ndarray] = {}
    for name, m in matrices.items():
        arrays[f"{name}.q"] = m.q.contiguous().numpy()
        # numpy has no bfloat16: its bits travel as uint16, as the layout stores them
        bf16 = m.scales.dtype == torch.bfloat16
        arrays[f"{name}.scale"] = bf16_bits(m.scales) if bf16 else m.scales.contiguous().numpy()
    return layout.pack(arrays)
