"""The one table of dtypes by name, and bfloat16's bits as numpy (which has no bfloat16).

Names are the tags stored in containers and KV logs ("float32", "bfloat16", ...); byte sizes come from
storage's table (storage.container.layout.DTYPES), so a name means the same bytes everywhere.
"""

from __future__ import annotations

import numpy as np
import torch

from storage.container.layout import DTYPES as STORED_DTYPES

# What a model computes in (--dtype); float32 is the token-exact path.
COMPUTE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Kept in float32 whatever the compute dtype, as the reference keeps them (engine parameter suffixes).
FLOAT32_PARAMETERS = (
    "ffn.gate.bias",
    "attn.indexer.weights_proj.weight",
    # DeepSeek-V4: attention sinks, compressor position biases, hyper-connection weights
    "attn.sink",
    "compressor.ape",
    *(f"{hc}.{part}" for hc in ("hc_attn", "hc_ffn", "hc_head") for part in ("fn", "base", "scale")),
)

# Integer tables among the dense parameters (DeepSeek-V4's token -> experts hash), held as int64.
INTEGER_PARAMETERS = ("ffn.gate.tid2eid",)

# Every stored tag as torch (record fields, dense arrays).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "float16": torch.float16,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "e8m0": torch.uint8,  # power-of-two scale exponents (engine.kernels.quant.scale_values)
}


def dtype_bytes(name: str) -> int:
    """Bytes per value of a stored or compute dtype tag."""
    return np.dtype(STORED_DTYPES[name]).itemsize


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """Any float tensor rounded to bfloat16, as its raw bits (numpy uint16, same shape; a copy)."""
    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def compute_dtype_of(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a dense parameter is held in when the model computes in ``dtype``."""
    if name.endswith(INTEGER_PARAMETERS):
        return torch.long
    return torch.float32 if name.endswith(FLOAT32_PARAMETERS) else dtype


def from_stored(array: np.ndarray, tag: str) -> torch.Tensor:
    """A stored numpy array as torch with the tag's dtype: bfloat16 bits are reinterpreted, no copy."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if tag == "bfloat16" else tensor


# Under --dense int4 these 2-D weights stay int8: the embedding and output head (every token's first and
# last step, as llama.cpp's Q4_0 files keep the output tensor wider), the router and the DSA indexer (a
# choice of experts or positions, not a sum), and MLA's wkv_b (absorbed decode reads its int8 codes per head).
INT8_UNDER_INT4 = ("embed.weight", "head.weight", ".wkv_b.weight", ".ffn.gate.weight")


def stored_dense_dtype(name: str, shape: tuple[int, ...], scheme: str, group_size: int) -> str:
    """The dtype tag a conversion stores one dense parameter as, under the dense ``scheme``.

    int8 applies to 2-D weights (any width: the last group of a row may be partial), int4 to those but
    ``INT8_UNDER_INT4`` and the indexer's (int8); other tensors (norms, biases) keep bf16, and the
    float32-only parameters always stay float32."""
    if name.endswith(INTEGER_PARAMETERS):
        return "int32"
    if scheme == "f32" or name.endswith(FLOAT32_PARAMETERS):
        return "float32"
    if scheme in ("int8", "int4") and len(shape) == 2:
        wider = name.endswith(INT8_UNDER_INT4) or ".indexer." in name
        return "int4" if scheme == "int4" and not wider else "int8"
    return "bfloat16"
