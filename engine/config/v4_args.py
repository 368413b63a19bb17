"""V4Args: what DeepSeek-V4 adds to ModelArgs, read from an HF ``deepseek_v4`` config.json.

Both spellings are accepted: transformers' (``layer_types``, ``compress_rates``, ``mlp_layer_types``,
nested ``rope_parameters`` {"main", "compress"}) and the legacy one DeepSeek's own files use
(``compress_ratios`` per layer 0/4/128, ``compress_rate_csa``/``_hca``, ``num_hash_layers``,
``qk_rope_head_dim``, a flat yarn ``rope_scaling``). Defaults are transformers' defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from engine.config.checks import (
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_SIZE,
    ConfigError,
    as_float,
    as_int,
    brief,
    optional_bool,
    optional_float,
    optional_int,
    size,
)

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # legacy compress_ratios
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")

LayerType = Literal["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


@dataclass(frozen=True)
class V4Args:
    """DeepSeek-V4's attention, hyper-connection and routing settings (one value per layer where it varies)."""

    layer_types: tuple[LayerType, ...]
    """Per layer: sliding window only, + CSA (compressed, indexer-selected), + HCA (heavily compressed, dense).
    The per-layer tuples go on past the last block to the MTP modules' blocks (layer ids n_layers..), as
    DeepSeek's own code indexes its per-layer lists with an MTP block's id: an entry the config does not
    list is sliding-only and score-routed."""
    csa_rate: int
    """m: source positions folded into one CSA entry (entries overlap: each spans 2m). <- ``compress_rates``."""
    hca_rate: int
    """m': source positions folded into one HCA entry. <- ``compress_rates``."""
    head_dim: int
    """Width of the one shared K=V head (and of every query head). <- ``head_dim``."""
    rope_dim: int
    """Trailing channels of a head that are roped. <- head_dim * ``partial_rotary_factor``."""
    sliding_window: int
    """Positions each query sees uncompressed, itself included. <- ``sliding_window``."""
    o_groups: int
    """Head groups of the grouped output projection. <- ``o_groups``."""
    o_lora_rank: int
    """Per-group width of the grouped output projection. <- ``o_lora_rank``."""
    hc_mult: int
    """Residual streams of the hyper-connections. <- ``hc_mult``."""
    hc_sinkhorn_iters: int
    """Sinkhorn-Knopp iterations of the stream-mixing matrix. <- ``hc_sinkhorn_iters``."""
    hc_eps: float
    """Floor added by the hyper-connection weights and the Sinkhorn normalisation. <- ``hc_eps``."""
    hash_layers: tuple[bool, ...]
    """Per layer, True where the token id picks the experts (``tid2eid``). <- ``mlp_layer_types``."""
    scoring_func: str
    """Router score function, one of SCORING_FUNCS. <- ``scoring_func``."""
    swiglu_limit: float
    """Clamp of the experts' gate (above) and up (both sides) pre-activations. <- ``swiglu_limit``."""
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    """CSA lightning indexer: heads, head width, compressed entries kept per query. <- ``index_*``."""
    n_mtp_layers: int = 0
    """Multi-token-prediction modules the model ships (``mtp.I``, engine/v4/mtp.py). <- ``num_nextn_predict_layers``."""

    def rate(self, layer: int) -> int:
        """Positions per compressed entry of ``layer``; 0 for sliding-only layers."""
        kind = self.layer_types[layer]
        return self.csa_rate if kind == CSA else self.hca_rate if kind == HCA else 0

    def is_csa(self, layer: int) -> bool:
        return self.layer_types[layer] == CSA


def parse_v4(config: Mapping[str, Any], n_layers: int) -> tuple[V4Args, dict[str, Any], dict[str, Any]]:
    """-> (V4Args, main rope fields, compress rope fields) of a deepseek_v4 config."""
    _check_v4_semantics(config)
    head_dim = size(config, "head_dim")
    rope_dim = _rope_dim(config, head_dim)
    rates = _compress_rates(config)
    n_mtp = optional_int(config, "num_nextn_predict_layers", 0, 0, MAX_LAYERS)
    args = V4Args(
        layer_types=_layer_types(config, n_layers, n_mtp),
        csa_rate=rates[CSA],
        hca_rate=rates[HCA],
        head_dim=head_dim,
        rope_dim=rope_dim,
        sliding_window=size(config, "sliding_window"),
        o_groups=_o_groups(config),
        o_lora_rank=size(config, "o_lora_rank"),
        hc_mult=optional_int(config, "hc_mult", 4, 1, 64),
        hc_sinkhorn_iters=optional_int(config, "hc_sinkhorn_iters", 20, 1, 10_000),
        hc_eps=optional_float(config, "hc_eps", 1e-6),
        hash_layers=_hash_layers(config, n_layers, n_mtp),
        scoring_func=_scoring_func(config),
        swiglu_limit=optional_float(config, "swiglu_limit", 10.0),
        index_n_heads=size(config, "index_n_heads", maximum=MAX_HEADS),
        index_head_dim=size(config, "index_head_dim"),
        index_topk=size(config, "index_topk", maximum=1 << 30),
        n_mtp_layers=n_mtp,
    )
    if args.index_head_dim < rope_dim:
        raise ConfigError(
            f"config.json: index_head_dim={args.index_head_dim} is smaller than the rope width {rope_dim}"
        )
    main, compress = _rope_fields(config)
    return args, main, compress


def _check_v4_semantics(config: Mapping[str, Any]) -> None:
    heads = size(config, "num_attention_heads", maximum=MAX_HEADS)
    kv_heads = config.get("num_key_value_heads", 1)
    if kv_heads != 1:
        raise ConfigError(f"config.json: num_key_value_heads={brief(kv_heads)}, DeepSeek-V4 has one shared K=V head")
    groups = _o_groups(config)
    if heads % groups:
        raise ConfigError(f"config.json: num_attention_heads={heads} is not a multiple of o_groups={groups}")
    for key in ("attention_bias", "mlp_bias"):
        if optional_bool(config, key, False):
            raise ConfigError(f"config.json: {key}=true is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"config.json: hidden_act={brief(config.get('hidden_act'))} is not supported (supported: silu)"
        )
    if optional_int(config, "n_routed_experts", 1, 1, MAX_EXPERTS) < 1:
        raise ConfigError("config.json: n_routed_experts must be positive")


def _o_groups(config: Mapping[str, Any]) -> int:
    return size(config, "o_groups", maximum=MAX_HEADS)


def _rope_dim(config: Mapping[str, Any], head_dim: int) -> int:
    factor = config.get("partial_rotary_factor")
    if factor is not None:
        rope_dim = int(head_dim * as_float("partial_rotary_factor", factor))
    elif config.get("qk_rope_head_dim") is not None:
        rope_dim = size(config, "qk_rope_head_dim")
    else:
        rope_dim = head_dim * 64 // 512  # transformers' default factor
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ConfigError(
            f"config.json: rope width {rope_dim} of head_dim {head_dim}, expected an even number in (0, head_dim]"
        )
    return rope_dim


def _compress_rates(config: Mapping[str, Any]) -> dict[str, int]:
    given = config.get("compress_rates") or {}
    if not isinstance(given, dict):
        raise ConfigError(f"config.json: compress_rates={brief(given)}, expected an object")
    rates = {CSA: 4, HCA: 128, **given}
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if config.get(key) is not None:
            rates[kind] = config[key]
    return {kind: as_int(f"compress_rates[{kind!r}]", rates[kind], 1, MAX_SIZE) for kind in (CSA, HCA)}


def _layer_types(config: Mapping[str, Any], n_layers: int, n_mtp: int) -> tuple[LayerType, ...]:
    types = config.get("layer_types")
    ratios = config.get("compress_ratios")
    if types is None and ratios is not None:
        if not isinstance(ratios, list) or any(r not in _RATIO_TO_TYPE for r in ratios):
            raise ConfigError(f"config.json: compress_ratios={brief(ratios)}, expected a list of 0, 4 or 128")
        types = [_RATIO_TO_TYPE[r] for r in ratios]
    if types is None:  # transformers' default: two HCA layers, then HCA and CSA alternating
        types = [HCA] * min(n_layers, 2) + [CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0))]
    if not isinstance(types, list) or len(types) < n_layers or not set(map(str, types)) <= set(LAYER_TYPES):
        raise ConfigError(
            f"config.json: layer_types must list one of {list(LAYER_TYPES)} for each of {n_layers} layers"
        )
    mtp_types = [types[i] if i < len(types) else SLIDING for i in range(n_layers, n_layers + n_mtp)]
    return tuple([*types[:n_layers], *mtp_types])


def _hash_layers(config: Mapping[str, Any], n_layers: int, n_mtp: int) -> tuple[bool, ...]:
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        n_hash = optional_int(config, "num_hash_layers", 3, 0, MAX_LAYERS)
        return tuple(i < min(n_hash, n_layers) for i in range(n_layers + n_mtp))
    if not isinstance(kinds, list) or len(kinds) < n_layers or not set(map(str, kinds)) <= {"hash_moe", "moe"}:
        raise ConfigError(f"config.json: mlp_layer_types must list 'hash_moe'/'moe' for {n_layers} layers")
    mtp_kinds = [kinds[i] if i < len(kinds) else "moe" for i in range(n_layers, n_layers + n_mtp)]
    return tuple(kind == "hash_moe" for kind in [*kinds[:n_layers], *mtp_kinds])


def _scoring_func(config: Mapping[str, Any]) -> str:
    func: str = config.get("scoring_func", "sqrtsoftplus")  # checked just below
    if func not in SCORING_FUNCS:
        raise ConfigError(
            f"config.json: scoring_func={brief(func)} is not supported (supported: {list(SCORING_FUNCS)})"
        )
    return func


def _rope_fields(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The main (sliding layers) and compress (CSA/HCA layers) rope settings, as flat rope dicts.

    Compress rope is yarn-scaled when configured, but never multiplies cos/sin by yarn's mscale
    (transformers forces attention_factor 1.0, as DeepSeek's reference does)."""
    nested = config.get("rope_parameters") or {}
    if not isinstance(nested, dict):
        raise ConfigError(f"config.json: rope_parameters={brief(nested)}, expected an object (or null)")
    if isinstance(nested.get("main"), dict) and isinstance(nested.get("compress"), dict):
        main, compress = dict(nested["main"]), dict(nested["compress"])
    else:
        flat: dict[str, Any] = {}
        for key in ("rope_scaling", "rope_parameters"):
            value = config.get(key)
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"config.json: {key}={brief(value)}, expected an object (or null)")
            flat.update({k: v for k, v in (value or {}).items() if k not in ("main", "compress")})
        main = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
        compress = {**flat, "rope_theta": config.get("compress_rope_theta", 160000.0)}
        if "type" in compress and "rope_type" not in compress:
            compress["rope_type"] = compress.pop("type")
    if compress.get("rope_type", "default") == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress
