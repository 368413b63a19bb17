"""ModelArgs: everything the forward pass needs to know about a model, read from an HF config.json.

Supported model types: ``deepseek_v3`` and ``kimi_k2`` (DeepSeek-V3 semantics), ``deepseek_v32`` and
``glm_moe_dsa`` (MLA plus the DSA lightning indexer), ``deepseek_v4`` (its own attention and
hyper-connections: the fields it adds are in engine/config/v4_args.py, ``ModelArgs.v4``). Fields that would
change the maths and that we do not implement raise ConfigError instead of being guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
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
    check_routing,
    optional_bool,
    optional_float,
    optional_int,
    size,
)
from engine.config.v4_args import V4Args, parse_v4

__all__ = ["ConfigError", "ModelArgs", "RopeArgs", "MODEL_TYPES", "DSA_MODEL_TYPES"]

MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa", "deepseek_v4")
DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")

IndexerKind = Literal["full", "shared"]


@dataclass(frozen=True)
class RopeArgs:
    """Rotary embedding of the qk_rope part (and of the DSA indexer).

    Read from ``rope_parameters`` (transformers 5) merged over the legacy ``rope_scaling``; a key in
    ``rope_parameters`` wins. Plain rope sets only ``theta``; the other fields matter for YaRN only.
    """

    theta: float = 10000.0
    """Rope base. <- ``rope_parameters.rope_theta``, else top-level ``rope_theta``; default 10000."""
    kind: Literal["default", "yarn"] = "default"
    """Rope variant. <- ``rope_type`` (legacy ``type``); default "default"; others raise ConfigError."""
    factor: float = 1.0
    """YaRN context extension factor. <- ``factor`` (required for yarn)."""
    original_max_position_embeddings: int = 4096
    """Pretraining context length YaRN extends. <- ``original_max_position_embeddings`` (required for yarn)."""
    beta_fast: float = 32.0
    """YaRN: rotations bounding the extrapolated (high-frequency) band. <- ``beta_fast``; default 32."""
    beta_slow: float = 1.0
    """YaRN: rotations bounding the interpolated (low-frequency) band. <- ``beta_slow``; default 1."""
    mscale: float | None = None
    """YaRN mscale of the cos/sin attention factor. <- ``mscale``; optional."""
    mscale_all_dim: float | None = None
    """YaRN mscale_all_dim; also scales the softmax by mscale^2 (DeepSeek-V3). <- ``mscale_all_dim``; optional."""
    attention_factor: float | None = None
    """Explicit cos/sin scale; derived from mscale* when None. <- ``attention_factor``; optional."""
    truncate: bool = True
    """YaRN: round the correction band to whole frequency indices. <- ``truncate``; default True."""


@dataclass(frozen=True)
class ModelArgs:
    """Shapes and semantics of an MLA/DSA MoE model."""

    model_type: str
    """Architecture family, one of MODEL_TYPES. <- ``model_type``."""
    vocab_size: int
    """Rows of the embedding and the output head. <- ``vocab_size``."""
    dim: int
    """Hidden size. <- ``hidden_size``."""
    inter_dim: int
    """Intermediate size of the dense MLP layers. <- ``intermediate_size``."""
    moe_inter_dim: int
    """Intermediate size of one routed (and one shared) expert. <- ``moe_intermediate_size``."""
    n_layers: int
    """Number of transformer blocks. <- ``num_hidden_layers``."""
    n_heads: int
    """Attention heads (``num_key_value_heads`` must equal it if set: MLA). <- ``num_attention_heads``."""
    q_lora_rank: int
    """Rank of the q latent; 0: no q compression (q_proj from the hidden state). <- ``q_lora_rank``; null -> 0."""
    kv_lora_rank: int
    """Rank of the cached kv latent. <- ``kv_lora_rank``."""
    qk_nope_head_dim: int
    """Per-head q/k dims without rope. <- ``qk_nope_head_dim``."""
    qk_rope_head_dim: int
    """Per-head q/k dims with rope (the rope key is shared by all heads). <- ``qk_rope_head_dim``."""
    v_head_dim: int
    """Per-head value dims. <- ``v_head_dim``."""
    n_routed_experts: int
    """Routed experts per MoE layer. <- ``n_routed_experts``."""
    n_shared_experts: int
    """Always-on shared experts per MoE layer. <- ``n_shared_experts``; null -> 0."""
    n_activated_experts: int
    """Routed experts per token. <- ``num_experts_per_tok``."""
    n_expert_groups: int
    """Groups the routed experts are split into. <- ``n_group``; null -> 1."""
    n_limited_groups: int
    """Groups a token may route into. <- ``topk_group``; null -> 1."""
    route_scale: float
    """Multiplier on the routing weights. <- ``routed_scaling_factor``; default 1.0."""
    norm_topk_prob: bool
    """Renormalise the chosen experts' weights to sum to 1. <- ``norm_topk_prob``; default True."""
    dense_layers: tuple[bool, ...]
    """Per layer, True for a dense MLP instead of MoE. <- ``mlp_layer_types``, else ``first_k_dense_replace``."""
    rms_norm_eps: float
    """Epsilon of the block and final RMSNorms. <- ``rms_norm_eps``; default 1e-6."""
    rope: RopeArgs
    """Rope settings. <- ``rope_parameters``, or legacy ``rope_theta`` + ``rope_scaling``."""
    rope_interleave: bool = True
    """MLA rope pairs are (x0, x1), (x2, x3), ... in the checkpoint. <- ``rope_interleave``; default True."""
    index_n_heads: int = 0
    """DSA indexer heads; 0 means no DSA indexer. <- ``index_n_heads`` (DSA model types only)."""
    index_head_dim: int = 0
    """DSA indexer head dims (>= qk_rope_head_dim). <- ``index_head_dim`` (DSA only)."""
    index_topk: int = 0
    """Past positions the DSA indexer selects per query. <- ``index_topk`` (DSA only)."""
    indexer_types: tuple[IndexerKind, ...] = ()
    """Per layer "full" (own indexer) or "shared"; empty without DSA. <- ``indexer_types``; DSA default all "full"."""
    indexer_rope_interleave: bool = False
    """GLM-5 ropes its indexer interleaved, V3.2 half-split. No key: True iff model_type is ``glm_moe_dsa``."""
    tie_word_embeddings: bool = False
    """Output head shares the embedding weights. <- ``tie_word_embeddings``; default False."""
    max_position_embeddings: int = 4096
    """Longest context the model supports. <- ``max_position_embeddings``; default 4096."""
    v4: V4Args | None = None
    """DeepSeek-V4 only: attention types, compression, hyper-connections, hash routing (engine/config/v4_args.py).
    Its MLA-named fields then mean: kv_lora_rank = v_head_dim = head_dim (the one K=V head),
    qk_rope_head_dim = the roped tail of a head, ``rope`` = the sliding layers' rope."""
    compress_rope: RopeArgs | None = None
    """DeepSeek-V4 only: the rope of CSA/HCA layers and their compressors (``compress_rope_theta``, yarn)."""
    n_mtp_layers: int = 0
    """Multi-token-prediction modules loaded after the last block (DeepSeek-V3/R1, GLM-5, DeepSeek-V4: layer
    ids n_layers.., each a MoE block; engine/mla/mtp.py, engine/v4/mtp.py). Not read from the config
    (``num_nextn_predict_layers`` says what a model ships, not what a checkpoint or container holds): the
    loader sets it from the tensors present (``with_mtp_layers``), `plan` from the config
    (``shipped_mtp_layers``)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_dsa(self) -> bool:
        return self.index_n_heads > 0

    def is_moe(self, layer: int) -> bool:
        """Layers past the last block are MTP modules' blocks: MoE in every model that ships them."""
        return layer >= self.n_layers or not self.dense_layers[layer]

    def has_indexer(self, layer: int) -> bool:
        """True where ``layer`` runs its own indexer (and caches indexer keys); an MTP block runs its own."""
        return self.has_dsa and (layer >= self.n_layers or self.indexer_types[layer] == "full")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Every layer whose routed experts the expert source holds: the blocks', then the MTP modules'."""
        return tuple(i for i in range(self.n_layers + self.n_mtp_layers) if self.is_moe(i))

    @property
    def mtp_layers(self) -> tuple[int, ...]:
        """The layer ids of the loaded MTP modules' blocks (their experts are records like any layer's)."""
        return tuple(range(self.n_layers, self.n_layers + self.n_mtp_layers))

    def with_mtp_layers(self, count: int) -> ModelArgs:
        """These args with ``count`` MTP modules (0: none loaded)."""
        if self.v4 is not None and count > self.v4.n_mtp_layers:
            raise ConfigError(
                f"{count} MTP modules (mtp.0..{count - 1}) but config.json's num_nextn_predict_layers is "
                f"{self.v4.n_mtp_layers}: DeepSeek-V4's per-layer settings of their blocks are read from it"
            )
        return replace(self, n_mtp_layers=count)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        return _parse(config)


def shipped_mtp_layers(config: Mapping[str, Any]) -> int:
    """The MTP modules a model ships by its config (``num_nextn_predict_layers``; 0 when absent)."""
    return optional_int(config, "num_nextn_predict_layers", 0, 0, MAX_LAYERS)


# ----------------------------------------------------------------------------------------- parsing


def _expect(config: Mapping[str, Any], key: str, allowed: tuple[Any, ...], default: Any) -> None:
    value = config.get(key, default)
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        raise ConfigError(f"config.json: {key}={brief(value)} is not supported (supported: {list(allowed)})")


def _parse(config: Mapping[str, Any]) -> ModelArgs:
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        supported = list(MODEL_TYPES)
        raise ConfigError(f"config.json: model_type {brief(model_type)} is not supported (supported: {supported})")
    if model_type == "deepseek_v4":
        return _parse_deepseek_v4(config)
    _check_semantics(config)
    n_layers = size(config, "num_hidden_layers", maximum=MAX_LAYERS)  # bounded before any per-layer table
    n_routed = size(config, "n_routed_experts", maximum=MAX_EXPERTS)
    top_k = size(config, "num_experts_per_tok", maximum=MAX_EXPERTS)
    n_groups = optional_int(config, "n_group", 1, 1, MAX_EXPERTS)
    topk_groups = optional_int(config, "topk_group", 1, 1, MAX_EXPERTS)
    check_routing(n_routed, top_k, n_groups, topk_groups)
    rope_dim = size(config, "qk_rope_head_dim")
    if rope_dim % 2:
        raise ConfigError(f"config.json: qk_rope_head_dim={rope_dim}, expected an even number (rope rotates pairs)")
    dsa = _parse_dsa(config, model_type, n_layers, rope_dim)
    q_lora = optional_int(config, "q_lora_rank", 0, 0, MAX_SIZE)
    if dsa and not q_lora:
        raise ConfigError("config.json: q_lora_rank is required for DSA models (the indexer reads the q latent)")
    return ModelArgs(
        model_type=model_type,
        vocab_size=size(config, "vocab_size"),
        dim=size(config, "hidden_size"),
        inter_dim=size(config, "intermediate_size"),
        moe_inter_dim=size(config, "moe_intermediate_size"),
        n_layers=n_layers,
        n_heads=size(config, "num_attention_heads", maximum=MAX_HEADS),
        q_lora_rank=q_lora,
        kv_lora_rank=size(config, "kv_lora_rank"),
        qk_nope_head_dim=size(config, "qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=size(config, "v_head_dim"),
        n_routed_experts=n_routed,
        n_shared_experts=optional_int(config, "n_shared_experts", 0, 0, MAX_EXPERTS),
        n_activated_experts=top_k,
        n_expert_groups=n_groups,
        n_limited_groups=topk_groups,
        route_scale=optional_float(config, "routed_scaling_factor", 1.0),
        norm_topk_prob=optional_bool(config, "norm_topk_prob", True),
        dense_layers=_parse_dense_layers(config, n_layers),
        rms_norm_eps=optional_float(config, "rms_norm_eps", 1e-6),
        rope=_parse_rope(config),
        rope_interleave=optional_bool(config, "rope_interleave", True),
        tie_word_embeddings=optional_bool(config, "tie_word_embeddings", False),
        max_position_embeddings=optional_int(config, "max_position_embeddings", 4096, 1, 1 << 30),
        **dsa,
    )


def _parse_deepseek_v4(config: Mapping[str, Any]) -> ModelArgs:
    """V4's shared fields in ModelArgs' terms; what only V4 has goes to ``ModelArgs.v4``."""
    _refuse_quantization_config(config)
    n_layers = size(config, "num_hidden_layers", maximum=MAX_LAYERS)
    n_routed = size(config, "n_routed_experts", maximum=MAX_EXPERTS)
    top_k = size(config, "num_experts_per_tok", maximum=MAX_EXPERTS)
    check_routing(n_routed, top_k, 1, 1)
    v4, main_rope, compress_rope = parse_v4(config, n_layers)
    max_positions = optional_int(config, "max_position_embeddings", 4096, 1, 1 << 30)
    compress_rope.setdefault("original_max_position_embeddings", max_positions)
    moe_inter = size(config, "moe_intermediate_size")
    return ModelArgs(
        model_type="deepseek_v4",
        vocab_size=size(config, "vocab_size"),
        dim=size(config, "hidden_size"),
        inter_dim=moe_inter,  # V4 has no dense MLP layers
        moe_inter_dim=moe_inter,
        n_layers=n_layers,
        n_heads=size(config, "num_attention_heads", maximum=MAX_HEADS),
        q_lora_rank=size(config, "q_lora_rank"),
        kv_lora_rank=v4.head_dim,
        qk_nope_head_dim=v4.head_dim - v4.rope_dim,
        qk_rope_head_dim=v4.rope_dim,
        v_head_dim=v4.head_dim,
        n_routed_experts=n_routed,
        n_shared_experts=optional_int(config, "n_shared_experts", 0, 0, MAX_EXPERTS),
        n_activated_experts=top_k,
        n_expert_groups=1,
        n_limited_groups=1,
        route_scale=optional_float(config, "routed_scaling_factor", 1.0),
        norm_topk_prob=True,  # V4 always renormalises the chosen experts' weights
        dense_layers=(False,) * n_layers,
        rms_norm_eps=optional_float(config, "rms_norm_eps", 1e-6),
        rope=_parse_rope({"rope_parameters": main_rope}),
        rope_interleave=True,
        tie_word_embeddings=optional_bool(config, "tie_word_embeddings", False),
        max_position_embeddings=max_positions,
        v4=v4,
        compress_rope=_parse_rope({"rope_parameters": compress_rope}),
    )


def _check_semantics(config: Mapping[str, Any]) -> None:
    """Refuse fields whose other values would change the maths we implement."""
    _expect(config, "scoring_func", ("sigmoid",), "sigmoid")
    _expect(config, "topk_method", ("noaux_tc",), "noaux_tc")
    _expect(config, "hidden_act", ("silu",), "silu")
    _expect(config, "attention_bias", (False,), False)
    _expect(config, "mlp_bias", (False,), False)
    _expect(config, "moe_layer_freq", (1,), 1)
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise ConfigError(
            f"config.json: num_key_value_heads={brief(kv_heads)} must equal num_attention_heads={brief(heads)} (MLA)"
        )
    _refuse_quantization_config(config)


def _refuse_quantization_config(config: Mapping[str, Any]) -> None:
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ConfigError(f"config.json: quantization_config={brief(quant)}, expected an object (or null)")
    if quant:
        raise ConfigError(
            f"config.json: quantization_config ({brief(quant.get('quant_method', '?'))}) — quantised checkpoints "
            "are read by `colibri-stream convert`, not loaded directly"
        )


def _parse_dense_layers(config: Mapping[str, Any], n_layers: int) -> tuple[bool, ...]:
    kinds = config.get("mlp_layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != n_layers or not set(map(str, kinds)) <= {"dense", "sparse"}:
            raise ConfigError(f"config.json: mlp_layer_types must list 'dense'/'sparse' for {n_layers} layers")
        return tuple(kind == "dense" for kind in kinds)
    first_dense = optional_int(config, "first_k_dense_replace", 0, 0, n_layers)
    return tuple(i < first_dense for i in range(n_layers))


def _parse_dsa(config: Mapping[str, Any], model_type: str, n_layers: int, rope_dim: int) -> dict[str, Any]:
    if model_type not in DSA_MODEL_TYPES:
        return {}
    kinds = config.get("indexer_types")
    if kinds is None:
        kinds = ["full"] * n_layers
    if not isinstance(kinds, list) or len(kinds) != n_layers or not set(map(str, kinds)) <= {"full", "shared"}:
        raise ConfigError(f"config.json: indexer_types must list 'full'/'shared' for {n_layers} layers")
    if kinds[0] != "full":
        raise ConfigError("config.json: indexer_types[0] must be 'full' (a shared layer reuses an earlier selection)")
    head_dim = size(config, "index_head_dim")
    if head_dim < rope_dim:
        raise ConfigError(f"config.json: index_head_dim={head_dim} is smaller than qk_rope_head_dim={rope_dim}")
    return dict(
        index_n_heads=size(config, "index_n_heads", maximum=MAX_HEADS),
        index_head_dim=head_dim,
        index_topk=size(config, "index_topk", maximum=1 << 30),
        indexer_types=tuple(kinds),
        indexer_rope_interleave=model_type == "glm_moe_dsa",
    )


def _parse_rope(config: Mapping[str, Any]) -> RopeArgs:
    """Both spellings: transformers-5 ``rope_parameters`` and legacy ``rope_theta`` + ``rope_scaling``."""
    merged: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):  # a key in rope_parameters wins
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"config.json: {key}={brief(value)}, expected an object (or null)")
        merged.update(value or {})
    theta = as_float("rope_theta", merged.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return RopeArgs(theta=theta)
    if kind != "yarn":
        raise ConfigError(f"config.json: rope type {brief(kind)} is not supported (supported: ['default', 'yarn'])")
    for key in ("factor", "original_max_position_embeddings"):
        if merged.get(key) is None:
            raise ConfigError(f"config.json: yarn rope scaling needs {key!r}")

    def rope_float(key: str, default: float | None, positive: bool = True) -> Any:
        value = merged.get(key)
        return default if value is None else as_float(f"rope {key}", value, positive)

    return RopeArgs(
        theta=theta,
        kind="yarn",
        factor=as_float("rope factor", merged["factor"]),
        original_max_position_embeddings=as_int(
            "rope original_max_position_embeddings", merged["original_max_position_embeddings"], 1, 1 << 30
        ),
        beta_fast=rope_float("beta_fast", 32.0),
        beta_slow=rope_float("beta_slow", 1.0),
        mscale=rope_float("mscale", None, positive=False),
        mscale_all_dim=rope_float("mscale_all_dim", None, positive=False),
        attention_factor=rope_float("attention_factor", None),
        truncate=bool(merged.get("truncate", True)),
    )
