"""KV bytes per token, the one place they are computed: the log's record (storage.kvlog.KVGeometry),
the in-memory cache (plan), and a naive per-head K/V cache (the comparison `kv info` prints)."""

from __future__ import annotations

from colibri_stream.dtypes import dtype_bytes
from engine.args import ModelArgs
from storage.kvlog import KVGeometry

INDEX_KEY_BYTES = 4  # the in-memory DSA indexer keys stay float32 whatever the compute dtype


def kv_geometry(args: ModelArgs, dtype: str = "float32") -> KVGeometry:
    """Per position: latent (kv_lora) + roped key (qk_rope) per layer, indexer key per DSA full layer."""
    index_layers = tuple(layer for layer in range(args.n_layers) if args.has_indexer(layer))
    return KVGeometry(args.n_layers, args.kv_lora_rank, args.qk_rope_head_dim, index_layers, args.index_head_dim, dtype)


def cache_bytes_per_token(args: ModelArgs, dtype: str) -> int:
    """The engine's in-memory KV cache: latent + roped key in the compute dtype, indexer keys float32."""
    geometry = kv_geometry(args, dtype)
    per_layer = (geometry.kv_lora_rank + geometry.qk_rope_head_dim) * dtype_bytes(dtype)
    return geometry.n_layers * per_layer + len(geometry.index_layers) * geometry.index_head_dim * INDEX_KEY_BYTES


def naive_kv_bytes_per_token(args: ModelArgs, dtype: str) -> int:
    """What a plain per-head K/V cache would hold: K [H, qk_head_dim] and V [H, v_head_dim] per layer."""
    return args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * dtype_bytes(dtype)
