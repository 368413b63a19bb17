"""The one HF -> engine weight-name table, and the strict "every tensor consumed" check.

Pure string logic, no file I/O. Routed experts are recognised separately (``routed_expert_key``): they live
with the expert source, not in the Transformer module.

Multimodal wrappers (Kimi-K2.5) ship the text model under a prefix beside a vision tower; text names match
as if unprefixed, and vision tensors are skipped only when a wrapped text model is present.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

# (HF pattern, engine name); \1 is the layer index where present.
HF_TO_ENGINE: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "head.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", r"layers.\1.attn.wq.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_a_proj\.weight", r"layers.\1.attn.wq_a.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_a_layernorm\.weight", r"layers.\1.attn.q_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_b_proj\.weight", r"layers.\1.attn.wq_b.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.kv_a_proj_with_mqa\.weight", r"layers.\1.attn.wkv_a.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.kv_a_layernorm\.weight", r"layers.\1.attn.kv_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight", r"layers.\1.attn.wkv_b.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"layers.\1.attn.wo.weight"),
    (
        r"model\.layers\.(\d+)\.self_attn\.indexer\.(wq_b|wk|weights_proj)\.weight",
        r"layers.\1.attn.indexer.\2.weight",
    ),
    (r"model\.layers\.(\d+)\.self_attn\.indexer\.k_norm\.(weight|bias)", r"layers.\1.attn.indexer.k_norm.\2"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"layers.\1.ffn.w1.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"layers.\1.ffn.w2.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"layers.\1.ffn.w3.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate\.weight", r"layers.\1.ffn.gate.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", r"layers.\1.ffn.gate.bias"),
    (
        r"model\.layers\.(\d+)\.mlp\.shared_experts\.gate_proj\.weight",
        r"layers.\1.ffn.shared_experts.w1.weight",
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.shared_experts\.down_proj\.weight",
        r"layers.\1.ffn.shared_experts.w2.weight",
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.shared_experts\.up_proj\.weight",
        r"layers.\1.ffn.shared_experts.w3.weight",
    ),
)
_COMPILED = tuple((re.compile(pattern), target) for pattern, target in HF_TO_ENGINE)

# DeepSeek-V4: DeepSeek's own names (transformers' save_pretrained adds "model.", removed before matching).
V4_TO_ENGINE: tuple[tuple[str, str], ...] = (
    (r"(?:embed|embed_tokens)\.weight", "embed.weight"),
    (r"(?:head|lm_head)\.weight", "head.weight"),
    (r"norm\.weight", "norm.weight"),
    (r"hc_head[._](?:hc_)?(fn|base|scale)", r"hc_head.\1"),
    (r"layers\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)", r"layers.\1.hc_\2.\3"),
    (r"layers\.(\d+)\.(attn_norm|ffn_norm)\.weight", r"layers.\1.\2.weight"),
    (r"layers\.(\d+)\.attn\.attn_sink", r"layers.\1.attn.sink"),
    (r"layers\.(\d+)\.attn\.norm\.weight", r"layers.\1.attn.kv_norm.weight"),
    (r"layers\.(\d+)\.attn\.(wq_a|q_norm|wq_b|wkv|wo_a|wo_b)\.weight", r"layers.\1.attn.\2.weight"),
    (
        r"layers\.(\d+)\.attn\.(compressor|indexer\.compressor)\.(wkv\.weight|wgate\.weight|norm\.weight|ape)",
        r"layers.\1.attn.\2.\3",
    ),
    (r"layers\.(\d+)\.attn\.indexer\.(wq_b|weights_proj)\.weight", r"layers.\1.attn.indexer.\2.weight"),
    (r"layers\.(\d+)\.ffn\.gate\.(weight|bias|tid2eid)", r"layers.\1.ffn.gate.\2"),
    (r"layers\.(\d+)\.ffn\.shared_experts\.(w[123])\.weight", r"layers.\1.ffn.shared_experts.\2.weight"),
)
_V4_COMPILED = tuple((re.compile(pattern), target) for pattern, target in V4_TO_ENGINE)
_V4_ROUTED = re.compile(r"(?:model\.)?layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight")
_V4_MTP = ("mtp.", "model.mtp.")  # DeepSeek-V4's multi-token-prediction modules

# wrapped text-model prefixes -> the plain names the table matches
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."), ("language_model.", ""))
_VISION_PREFIXES = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")

_ROUTED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
ROUTED_PROJ_TO_ENGINE = {"gate": "w1", "down": "w2", "up": "w3"}
_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


class WeightNameError(ValueError):
    """Checkpoint tensors and engine parameters do not match one to one."""


def text_name(hf_name: str) -> str:
    """The name without a multimodal wrapper's text-model prefix."""
    for prefix, plain in _TEXT_PREFIXES:
        if hf_name.startswith(prefix):
            return plain + hf_name[len(prefix) :]
    return hf_name


def is_wrapped(hf_names: Iterable[str]) -> bool:
    """Whether the text model sits under a multimodal wrapper's prefix."""
    return any(text_name(name) != name for name in hf_names)


def is_vision_tensor(hf_name: str) -> bool:
    return hf_name.startswith(_VISION_PREFIXES)


def layer_of(hf_name: str) -> int | None:
    match = _LAYER.match(text_name(hf_name))
    return int(match.group(1)) if match else None


def is_extra_layer(hf_name: str, n_layers: int) -> bool:
    """Multi-token-prediction layers: model.layers.N with N >= num_hidden_layers (DeepSeek-V3/R1, GLM-5),
    mtp.I... (DeepSeek-V4)."""
    if hf_name.startswith(_V4_MTP):
        return True
    layer = layer_of(hf_name)
    return layer is not None and layer >= n_layers


# An MTP layer's own tensors (the rest is a decoder block): name after "model.layers.N." -> after "mtp.I."
_MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "norm.weight",
}
# Copies of the main embedding and head in each MTP layer: trained shared (DeepSeek-V3 report §2.2), so
# not stored twice.
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


# DeepSeek-V4's mtp.I: its own tensors; the rest is a V4 block named as layers.{n_layers + I}
_V4_MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "norm.weight": "norm.weight",
    **{f"hc_head{sep}{part}": f"hc_head.{part}" for sep in ("_", ".", ".hc_") for part in ("fn", "base", "scale")},
}
V4_MTP_SHARED_COPIES = ("embed.weight", "head.weight", "emb.tok_emb.weight")
_V4_MTP_NAME = re.compile(r"(?:model\.)?mtp\.(\d+)\.(.+)")


def v4_mtp_layer(hf_name: str, n_layers: int) -> tuple[int, str] | None:
    """DeepSeek-V4's mtp.I.X -> (n_layers + I, "layers.{n_layers + I}.X"), else None."""
    match = _V4_MTP_NAME.fullmatch(hf_name)
    if match is None:
        return None
    layer = n_layers + int(match.group(1))
    return layer, f"layers.{layer}.{match.group(2)}"


def mtp_engine_name(hf_name: str, n_layers: int) -> str | None:
    """The engine parameter of an MTP layer's dense tensor (mtp.I.X for its own, mtp.I.block.X for its
    decoder block's), else None."""
    plain = text_name(hf_name)
    if (v4 := v4_mtp_layer(plain, n_layers)) is not None:
        index, rest = v4[0] - n_layers, v4[1].removeprefix(f"layers.{v4[0]}.")
        if rest in _V4_MTP_OWN:
            return f"mtp.{index}.{_V4_MTP_OWN[rest]}"
        target = engine_name(v4[1])
        return None if target is None else f"mtp.{index}.block." + target.removeprefix(f"layers.{v4[0]}.")
    layer = layer_of(plain)
    if layer is None or layer < n_layers:
        return None
    prefix = f"model.layers.{layer}."
    rest = plain.removeprefix(prefix)
    index = layer - n_layers
    if rest in _MTP_OWN:
        return f"mtp.{index}.{_MTP_OWN[rest]}"
    target = engine_name(plain)
    if target is None:
        return None
    return f"mtp.{index}.block." + target.removeprefix(f"layers.{layer}.")


def routed_expert_key(hf_name: str) -> tuple[int, int, str] | None:
    """(layer, expert, "w1"|"w2"|"w3") for a routed-expert tensor name, else None."""
    match = _ROUTED.fullmatch(text_name(hf_name))
    if match is not None:
        return int(match.group(1)), int(match.group(2)), ROUTED_PROJ_TO_ENGINE[match.group(3)]
    match = _V4_ROUTED.fullmatch(hf_name)
    return None if match is None else (int(match.group(1)), int(match.group(2)), match.group(3))


def mtp_routed_key(hf_name: str, n_layers: int) -> tuple[int, int, str] | None:
    """routed_expert_key of an MTP layer's expert tensor (DeepSeek-V4's mtp.I as layer n_layers + I)."""
    v4 = v4_mtp_layer(text_name(hf_name), n_layers)
    return routed_expert_key(hf_name if v4 is None else v4[1])


def engine_name(hf_name: str) -> str | None:
    """The engine parameter a dense HF tensor loads into, or None if the table has no rule for it."""
    plain = text_name(hf_name)
    for pattern, target in _COMPILED:
        if pattern.fullmatch(plain):
            return pattern.sub(target, plain)
    plain = plain.removeprefix("model.")
    for pattern, target in _V4_COMPILED:
        if pattern.fullmatch(plain):
            return pattern.sub(target, plain)
    return None


def check_complete(unmapped: Iterable[str], expected: Iterable[str], loaded: Iterable[str], source: str) -> None:
    """Raise WeightNameError naming leftover checkpoint tensors and missing engine parameters."""
    unmapped = sorted(unmapped)
    missing = sorted(set(expected) - set(loaded))
    problems = []
    if unmapped:
        problems.append(f"{len(unmapped)} tensor(s) the engine does not use, e.g. {unmapped[:5]}")
    if missing:
        problems.append(f"{len(missing)} parameter(s) missing, e.g. {missing[:5]}")
    if problems:
        raise WeightNameError(f"{source}: " + "; ".join(problems))


@dataclass
class SortedNames:
    """A checkpoint's tensor names by destination (see ``sort_names``)."""

    dense: dict[str, str] = field(default_factory=dict)  # hf name -> engine parameter
    routed: dict[tuple[int, int, str], str] = field(default_factory=dict)  # (layer, expert, w1|w2|w3) -> hf name
    unmapped: list[str] = field(default_factory=list)  # names no rule claims (check_complete refuses them)
    skipped: list[str] = field(default_factory=list)  # a wrapped model's vision tower and projector
    mtp_layers: int = 0  # MTP layers whose tensors are present (their names are in dense and routed)
    left_out: list[str] = field(default_factory=list)  # MTP tensors not loaded: shared copies, or all with mtp=False


def sort_names(hf_names: Iterable[str], n_layers: int, mtp: bool = True) -> SortedNames:
    """Every tensor name classified once: routed, dense, skipped, unmapped; MTP layers' tensors sort as dense
    and routed, or are left out with ``mtp`` False."""
    sorted_names = SortedNames()
    hf_names = list(hf_names)
    wrapped = is_wrapped(hf_names)
    for name in hf_names:
        if is_extra_layer(name, n_layers):
            _sort_mtp_name(name, n_layers, mtp, sorted_names)
            continue
        if wrapped and is_vision_tensor(name):
            sorted_names.skipped.append(name)
            continue
        if (key := routed_expert_key(name)) is not None:
            sorted_names.routed[key] = name
        elif (target := engine_name(name)) is not None:
            sorted_names.dense[name] = target
        else:
            sorted_names.unmapped.append(name)
    return sorted_names


def _sort_mtp_name(name: str, n_layers: int, mtp: bool, sorted_names: SortedNames) -> None:
    v4 = v4_mtp_layer(text_name(name), n_layers)
    layer = v4[0] if v4 is not None else layer_of(name)
    assert layer is not None  # is_extra_layer found it
    rest = v4[1].removeprefix(f"layers.{layer}.") if v4 is not None else text_name(name).split(".", 3)[-1]
    if not mtp or rest in (V4_MTP_SHARED_COPIES if v4 is not None else MTP_SHARED_COPIES):
        sorted_names.left_out.append(name)
        return
    sorted_names.mtp_layers = max(sorted_names.mtp_layers, layer - n_layers + 1)
    if (key := mtp_routed_key(name, n_layers)) is not None:
        sorted_names.routed[key] = name
    elif (target := mtp_engine_name(name, n_layers)) is not None:
        sorted_names.dense[name] = target
    else:
        sorted_names.unmapped.append(name)
