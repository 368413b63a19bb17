"""KV bytes per token, the one place they are computed: the log's record (storage.kvlog's geometries),
the in-memory cache (plan), what DeepSeek-V4's compressed attention keeps per token, and a naive
uncompressed K/V cache (the comparison `kv info` prints).

MLA models (V3, V3.2, GLM-5) log per layer the latent and roped key, per DSA full layer the indexer key.
DeepSeek-V4 logs per layer every row its cache keeps per position (``v4_layer_rows``): the state is a
function of them, so a restored log continues exactly and can be cut back anywhere.
"""

from __future__ import annotations

import math
from fractions import Fraction

from colibri_stream.checkpoint.dtypes import dtype_bytes
from engine.args import ModelArgs
from engine.v4_args import V4Args
from storage.kvlog import Geometry, KVGeometry, RowsGeometry

INDEX_KEY_BYTES = 4  # the in-memory DSA indexer keys stay float32 whatever the compute dtype
# DeepSeek-V4: the order of a layer's rows in a record (those the layer has; V4LayerCache.rows names).
V4_ROW_ORDER = ("kv", "compressor.kv", "compressor.gate", "indexer.kv", "indexer.gate")


def v4_layer_rows(v4: V4Args, layer: int) -> dict[str, int]:
    """Name -> width of the rows ``layer`` keeps per position, in record order (V4_ROW_ORDER):
    kv [D] on every layer; on compressed layers the compressor's kv and gate [c * D] (c = 2: CSA's
    windows overlap, 1: HCA's do not); on CSA layers the indexer's kv and gate [2 * index_head_dim]."""
    rows = {"kv": v4.head_dim}
    if v4.rate(layer):
        series = 2 if v4.is_csa(layer) else 1
        rows |= {"compressor.kv": series * v4.head_dim, "compressor.gate": series * v4.head_dim}
    if v4.is_csa(layer):
        rows |= {"indexer.kv": 2 * v4.index_head_dim, "indexer.gate": 2 * v4.index_head_dim}
    return rows


def kv_geometry(args: ModelArgs, dtype: str = "float32") -> Geometry:
    """The log record of one position. MLA: latent (kv_lora) + roped key (qk_rope) per layer, indexer
    key per DSA full layer. DeepSeek-V4: every layer's rows (``v4_layer_rows``)."""
    if args.v4 is not None:
        layers = tuple(tuple(v4_layer_rows(args.v4, i).values()) for i in range(args.n_layers))
        return RowsGeometry(layers, dtype)
    index_layers = tuple(layer for layer in range(args.n_layers) if args.has_indexer(layer))
    return KVGeometry(args.n_layers, args.kv_lora_rank, args.qk_rope_head_dim, index_layers, args.index_head_dim, dtype)


def cache_bytes_per_token(args: ModelArgs, dtype: str) -> int:
    """The engine's in-memory KV cache per position. MLA: latent + roped key in the compute dtype,
    indexer keys float32. DeepSeek-V4: the compressed entries (one per m positions per compressed layer),
    rounded up to a whole byte: its rows are released once logged or when nothing logs them
    (engine/position_rows.py), but for the fixed windows of ``held_rows_bytes``."""
    if args.v4 is not None:
        return math.ceil(_v4_entry_values(args) * dtype_bytes(dtype))
    geometry = kv_geometry(args, dtype)
    per_layer = (geometry.kv_lora_rank + geometry.qk_rope_head_dim) * dtype_bytes(dtype)
    return geometry.n_layers * per_layer + len(geometry.index_layers) * geometry.index_head_dim * INDEX_KEY_BYTES


def held_rows_bytes(args: ModelArgs, dtype: str) -> int:
    """DeepSeek-V4's rows held whatever the context (0 for MLA): per layer the sliding window's K=V rows
    (window - 1 of D), and per compressor its open window's projections (kv and gate; an overlapping one
    also the window before it). A session logging rows in another dtype than it computes keeps them all."""
    if args.v4 is None:
        return 0
    v4, values = args.v4, 0
    for layer in range(args.n_layers):
        widths = v4_layer_rows(v4, layer)
        values += (v4.sliding_window - 1) * widths["kv"]
        if v4.rate(layer):
            overlap = v4.is_csa(layer)
            values += (v4.rate(layer) - 1 + overlap * v4.rate(layer)) * 2 * widths["compressor.kv"]
        if v4.is_csa(layer):
            values += (2 * v4.csa_rate - 1) * 2 * widths["indexer.kv"]
    return values * dtype_bytes(dtype)


def compressed_kv_bytes_per_token(args: ModelArgs, dtype: str) -> float:
    """DeepSeek-V4: what its attention works from per context position once the sliding window has
    passed (the window's rows are a constant, window x D per layer, not a cost per token): per
    compressed layer its entries (D / m), on CSA layers also the indexer's entries (index_head_dim / m).
    HCA attends to all of its entries; CSA to the index_topk its indexer picks after scoring all of its."""
    if args.v4 is None:
        raise ValueError(f"{args.model_type} has no compressed attention (DeepSeek-V4 only)")
    return float(_v4_entry_values(args) * dtype_bytes(dtype))


def _v4_entry_values(args: ModelArgs) -> Fraction:
    """Values of compressed entries per position: D / m per compressed layer, index_head_dim / m per CSA layer."""
    v4, values = args.v4, Fraction(0)
    for layer in range(args.n_layers):
        if v4.rate(layer):
            values += Fraction(v4.head_dim, v4.rate(layer))
        if v4.is_csa(layer):
            values += Fraction(v4.index_head_dim, v4.csa_rate)
    return values


def naive_kv_bytes_per_token(args: ModelArgs, dtype: str) -> int:
    """An uncompressed cache of the model's own attention. MLA models: K [H, qk_head_dim] and V
    [H, v_head_dim] per layer (per-head MHA). DeepSeek-V4: its one shared K=V head [D] per layer (MQA)."""
    if args.v4 is not None:
        return args.n_layers * args.v4.head_dim * dtype_bytes(dtype)
    return args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * dtype_bytes(dtype)


def naive_kv_kind(args: ModelArgs) -> str:
    """What ``naive_kv_bytes_per_token`` counts, in words (`kv info` prints it beside the number)."""
    if args.v4 is not None:
        return "one uncompressed K=V head per layer (MQA)"
    return "uncompressed per-head K and V per layer (MHA)"
