"""KV bytes per token, the one place the library asks for them: the log's record (storage.kv.log's
geometries), the in-memory cache (plan), what compressed attention keeps per token, and a naive
uncompressed K/V cache (the comparison `kv info` prints). Each is the model family's (engine/families.py's
log format, family_memory.py's estimates):

MLA models (V3, V3.2, GLM-5) log per layer the latent and roped key, per DSA full layer the indexer key.
DeepSeek-V4's record (``kv_geometry``: what a prefix block stores) holds per layer every row its cache
keeps per position; its session log (``session_geometry``, storage/kv/lean_log.py) is lean: per position the
entries of the windows it closes, and snapshots of the window state, at most 2x the in-memory state.
"""

from __future__ import annotations

from colibri_stream.checkpoint.dtypes import dtype_bytes
from colibri_stream.planning.family_memory import family_memory
from engine.config.args import ModelArgs
from engine.families import family_of
from storage.kv.geometry import RECORD_GEOMETRY_OF_VERSION, AnyGeometry, Geometry, make_geometry


def kv_geometry(args: ModelArgs, dtype: str = "float32") -> Geometry:
    """The log record of one position, in the format the family's record needs (Family.kv_log.log_record)."""
    version, fields = family_of(args).kv_log.log_record()
    return RECORD_GEOMETRY_OF_VERSION[version](**fields, dtype=dtype)


def session_geometry(args: ModelArgs, dtype: str = "float32") -> AnyGeometry:
    """A session log's geometry (Family.kv_log.session_log_record): MLA models the record of ``kv_geometry``,
    DeepSeek-V4 the lean log's series with their snapshot interval."""
    version, fields = family_of(args).kv_log.session_log_record()
    return make_geometry(version, fields, dtype)


def cache_bytes_per_token(args: ModelArgs, dtype: str) -> int:
    """The engine's in-memory KV cache per position. MLA: latent + roped key in the compute dtype,
    indexer keys float32. DeepSeek-V4: the compressed entries (its rows are released once logged or
    when nothing logs them, but for the fixed windows of ``held_rows_bytes``)."""
    return family_memory(args).cache_bytes_per_token(dtype_bytes(dtype))


def held_rows_bytes(args: ModelArgs, dtype: str) -> int:
    """The rows a cache holds whatever the context: DeepSeek-V4's windows (0 for MLA)."""
    return family_memory(args).held_rows_bytes(dtype_bytes(dtype))


def compressed_kv_bytes_per_token(args: ModelArgs, dtype: str) -> float:
    """What compressed attention (DeepSeek-V4) works from per context position, past the sliding window."""
    compressed = family_memory(args).compressed_kv_bytes_per_token(dtype_bytes(dtype))
    if compressed is None:
        raise ValueError(f"{args.model_type} has no compressed attention (DeepSeek-V4 only)")
    return compressed


def naive_kv_bytes_per_token(args: ModelArgs, dtype: str) -> int:
    """An uncompressed cache of the model's own attention. MLA models: K [H, qk_head_dim] and V
    [H, v_head_dim] per layer (per-head MHA). DeepSeek-V4: its one shared K=V head [D] per layer (MQA)."""
    return family_memory(args).naive_kv_bytes_per_token(dtype_bytes(dtype))


def naive_kv_kind(args: ModelArgs) -> str:
    """What ``naive_kv_bytes_per_token`` counts, in words (`kv info` prints it beside the number)."""
    return family_memory(args).naive_kv_kind
