"""Tiny reference checkpoints and the transformers oracle.

Every correctness test compares colibri-stream against transformers running the same checkpoint.
This module builds those checkpoints locally — random weights from transformers' own model classes,
float32, fixed seeds, written with ``save_pretrained`` — so nothing is downloaded and nothing binary
is committed. It also runs the oracle: transformers' greedy continuation, teacher-forced argmax and
logits for a checkpoint directory.

transformers is a dev dependency; it is imported lazily so the runtime package never needs it.

Facts that shaped the configs (measured while building them):
- with few indexer heads (4) many DSA indexer scores are exactly 0.0 and ``torch.topk`` breaks those
  ties differently between cached and uncached runs, so DSA configs use ``index_n_heads >= 16``;
- ``initializer_range`` ~0.1 avoids degenerate (repeating) greedy output;
- bf16 is not a usable oracle (tokens differ from fp32 in most families); fp32 is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FAMILIES: tuple[str, ...] = ("deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa", "deepseek_v4")
V4_FAMILIES: tuple[str, ...] = ("deepseek_v4",)

# transformers has no kimi_k2 model type: Kimi-K2 ships DeepSeek-V3 weights and semantics under its
# own model_type, so the oracle loads it with the DeepSeek-V3 classes.
_ORACLE_MODEL_TYPE = {"kimi_k2": "deepseek_v3"}

# Shared by every family: small, but every structural feature of the real models is present
# (q_lora, dense-then-MoE layers, shared expert, routed scaling, correction bias).
_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,  # a multiple of the default int4 group size (64)
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=16,
    num_experts_per_tok=4,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=24,
    max_position_embeddings=512,
    initializer_range=0.1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=8.0,
    original_max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

# DSA configs: index_topk is smaller than the test contexts so the indexer really selects.
_DSA = dict(index_topk=8, index_head_dim=32, index_n_heads=16)


# DeepSeek-V4 shares little with the MLA configs. Every layer type (HCA, CSA, sliding), two hash-routed
# layers, 3 streams; CSA selects from 10 positions on (index_topk 4 x rate 2), HCA closes an entry every
# 8, the window (6) is shorter than the test contexts, the compress rope is yarn-scaled and the swiglu
# clamp (1.0) cuts a measured ~20% of the experts' pre-activations. Widths divide neither 64 nor 32.
_V4: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=80,
    moe_intermediate_size=40,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=40,
    qk_rope_head_dim=8,
    q_lora_rank=48,
    o_groups=2,
    o_lora_rank=24,
    n_shared_experts=1,
    n_routed_experts=16,
    num_experts_per_tok=4,
    layer_types=[
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "sliding_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
    sliding_window=6,
    index_n_heads=16,
    index_head_dim=24,
    index_topk=4,
    hc_mult=3,
    swiglu_limit=1.0,
    routed_scaling_factor=1.5,
    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128),
    num_nextn_predict_layers=0,
    max_position_embeddings=512,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class TinySpec:
    """How to build one family's tiny checkpoint."""

    family: str
    config_kwargs: dict[str, Any] = field(default_factory=dict)
    base: dict[str, Any] = field(default_factory=lambda: _COMMON)  # the shared config the kwargs override
    legacy_rope: bool = False  # rewrite config.json with rope_theta + rope_scaling (real V3/K2 files)
    seed: int = 0  # chosen so greedy output is varied, not a short loop


TINY_SPECS: dict[str, TinySpec] = {
    "deepseek_v3": TinySpec("deepseek_v3", dict(n_group=4, topk_group=2, rope_parameters=_YARN)),
    "kimi_k2": TinySpec(
        "kimi_k2",
        dict(
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            rope_parameters=dict(_YARN, rope_theta=50000.0),
            num_nextn_predict_layers=0,  # as Kimi-K2's config.json says (it ships no MTP layer)
        ),
        legacy_rope=True,
        seed=1,
    ),
    "deepseek_v32": TinySpec("deepseek_v32", dict(n_group=2, topk_group=1, **_DSA)),
    "glm_moe_dsa": TinySpec(
        "glm_moe_dsa",
        dict(
            n_group=1,
            topk_group=1,
            num_hidden_layers=4,
            indexer_types=["full", "shared", "full", "shared"],
            **_DSA,
        ),
    ),
    "deepseek_v4": TinySpec("deepseek_v4", base=_V4, seed=0),
}


def _transformers_classes(model_type: str) -> tuple[Any, Any]:  # transformers classes, looked up by name
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - dev dependency
        raise ImportError("colibri_stream.devtools.fixtures needs transformers: pip install -e '.[dev]'") from exc
    names = {
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
        "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
        "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
        "kimi_k25": ("Kimi_K25Config", "Kimi_K25ForConditionalGeneration"),
        "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
    }
    if model_type not in names:
        raise ValueError(f"no transformers oracle for model_type {model_type!r}; known: {sorted(names)}")
    config_name, model_name = names[model_type]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def build_tiny_checkpoint(
    family: str, dst: str | Path, seed: int | None = None, config_overrides: dict[str, Any] | None = None
) -> Path:
    """Write a tiny random float32 checkpoint of ``family`` into ``dst`` and return the path.

    ``config_overrides`` builds variants (e.g. ``q_lora_rank=None``) of a family's tiny config."""
    if family not in TINY_SPECS:
        raise ValueError(f"unknown family {family!r}; known: {list(TINY_SPECS)}")
    spec = TINY_SPECS[family]
    dst = Path(dst)
    config_cls, model_cls = _transformers_classes(_ORACLE_MODEL_TYPE.get(family, family))
    config = config_cls(**{**spec.base, **spec.config_kwargs, **(config_overrides or {})})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed if seed is None else seed)
        model = model_cls(config).float().eval()
        _randomise_untrained_defaults(model)
    model.save_pretrained(dst)
    _rewrite_config(dst / "config.json", family, spec.legacy_rope)
    write_tiny_tokenizer(dst, config.vocab_size)
    return dst


# transformers initialises these to constants (zeros, ones) that would hide bugs in how they are used
# (a zero sink, a zero position bias, unit scales); real checkpoints carry trained values.
_CONSTANT_INITS = ("sinks", "position_bias", "attn_hc.base", "ffn_hc.base", "hc_head.hc_base")
_UNIT_INITS = ("attn_hc.scale", "ffn_hc.scale", "hc_head.hc_scale")


def _randomise_untrained_defaults(model: torch.nn.Module) -> None:
    """Random values where transformers' init leaves constants: the router correction bias, and in
    DeepSeek-V4 the sinks, compressor position biases, hyper-connection biases and scales, and the
    token -> experts hash table (all zeros would send every token to expert 0, k times)."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
            elif name.endswith("tid2eid"):
                experts: int = model.config.n_routed_experts  # type: ignore[union-attr,assignment]  # transformers config
                rows = [torch.randperm(experts)[: buffer.shape[1]] for _ in range(buffer.shape[0])]
                buffer.copy_(torch.stack(rows))
        for name, parameter in model.named_parameters():
            if name.endswith(_CONSTANT_INITS):
                parameter.copy_(torch.randn_like(parameter) * 0.5)
            elif name.endswith(_UNIT_INITS):
                parameter.copy_(1 + torch.randn_like(parameter) * 0.3)


def _rewrite_config(path: Path, family: str, legacy_rope: bool) -> None:
    config = json.loads(path.read_text())
    config["model_type"] = family
    if legacy_rope:
        # Real DeepSeek-V3 / Kimi-K2 config.json files predate rope_parameters.
        rope = dict(config.pop("rope_parameters"))
        config["rope_theta"] = rope.pop("rope_theta")
        rope["type"] = rope.pop("rope_type")
        config["rope_scaling"] = rope
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def legacy_v4_config(path: str | Path) -> Path:
    """Rewrite a tiny DeepSeek-V4 checkpoint's config.json in the legacy spellings DeepSeek's own files
    use (per-layer ``compress_ratios`` 0/4/128 with ``compress_rate_csa``/``_hca``, ``num_hash_layers``,
    ``qk_rope_head_dim``, a flat yarn ``rope_scaling`` with ``compress_rope_theta``); the same model."""
    path = Path(path) / "config.json"
    config = json.loads(path.read_text())
    ratio = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    config["compress_ratios"] = [ratio[kind] for kind in config.pop("layer_types")]
    rates = config.pop("compress_rates")
    config["compress_rate_csa"] = rates["compressed_sparse_attention"]
    config["compress_rate_hca"] = rates["heavily_compressed_attention"]
    config["num_hash_layers"] = config.pop("mlp_layer_types").count("hash_moe")
    config["qk_rope_head_dim"] = round(config.pop("partial_rotary_factor") * config["head_dim"])
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["main"]["rope_theta"]
    config["compress_rope_theta"] = rope["compress"].pop("rope_theta")
    for key in ("partial_rotary_factor", "attention_factor"):  # implied: the files do not carry them
        rope["compress"].pop(key, None)
    config["rope_scaling"] = rope["compress"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path.parent


_TOKENIZER_CORPUS = """\
The quick brown fox jumps over the lazy dog. Mixture-of-Experts models route every token to a few experts.
Experts stream from disk into a RAM cache and then into VRAM. The router decides; storage places.
A conversation resumes after a restart with zero re-prefill because the compressed KV state is on disk.
Placement changes speed, never tokens. Only routed bytes move. Hello, world! 0123456789
"""


# A minimal chat template in the Hugging Face convention (tokenizer_config.json "chat_template").
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


# A GLM-like template (tools as JSON lines, calls as <tool_call>NAME <arg_key>/<arg_value>) with a thinking
# switch (``enable_thinking``, as GLM names it): on, the generation prompt opens a think block (as DeepSeek-V3.1's
# does), so the answer starts in its reasoning; off (the default) it closes an empty one (as GLM's does). An
# assistant's ``reasoning_content`` is rendered back in its think block; messages of any role where they stand.
TINY_THINKING_TEMPLATE = (
    "{{ bos_token }}{% if tools %}system: # Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>{{ eos_token }}"
    "{% endif %}{% for message in messages %}{{ message['role'] }}: "
    "{% if message['role'] == 'assistant' and message['reasoning_content'] %}"
    "<think>{{ message['reasoning_content'] }}</think>{% endif %}{{ message['content'] }}"
    "{% for tc in message['tool_calls'] or [] %}<tool_call>{{ tc.function.name }}"
    "{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v | tojson if v is not string else v }}</arg_value>{% endfor %}</tool_call>{% endfor %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and enable_thinking %}<think>{% else %}<think></think>{% endif %}{% endif %}"
)


def with_chat_template(source: str | Path, dst: str | Path, template: str, positions: int | None = None) -> Path:
    """A copy of checkpoint ``source`` whose tokenizer_config.json has ``template`` as its chat template
    (``positions``: and that max_position_embeddings, for prompts longer than the tiny models' 512)."""
    import shutil

    source, dst = Path(source), Path(dst)
    shutil.copytree(source, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}, indent=2) + "\n")
    if positions is not None:
        model = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**model, "max_position_embeddings": positions}, indent=2) + "\n")
    return dst


def write_tiny_tokenizer(dst: str | Path, vocab_size: int) -> Path:
    """Train a byte-level BPE tokenizer (ids < vocab_size, <bos>=0, <eos>=1), save tokenizer.json and a
    tokenizer_config.json with the special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TOKENIZER_CORPUS.splitlines() * 10, trainer)
    path = Path(dst) / "tokenizer.json"
    tokenizer.save(str(path))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": TINY_CHAT_TEMPLATE}
    (Path(dst) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


_FP8_SKIP = ("embed_tokens", "lm_head", "mlp.gate.weight", "layernorm", "norm.weight", "weights_proj")


def build_fp8_checkpoint(source: str | Path, dst: str | Path, block: int = 128, scale_fmt: str = "float") -> Path:
    """Re-save a float checkpoint the way DeepSeek-V3/V3.2/Kimi-K2 ship FP8: every 2-D projection
    as float8_e4m3fn plus a float32 ``weight_scale_inv`` per ``block``x``block`` tile (the multiplier
    that dequantises it), and ``quantization_config`` in config.json.

    ``scale_fmt="ue8m0"`` writes the scales as DeepSeek-V4's dense weights have them, following
    transformers' FineGrainedFP8 quantiser (integrations/finegrained_fp8.py): each tile's scale rounded
    up to a power of two and stored as float8_e8m0fnu, the weight divided by exactly that."""
    import shutil

    from safetensors.torch import load_file, save_file

    source, dst = Path(source), Path(dst)
    shutil.copytree(source, dst)
    tensors = load_file(source / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if w.dim() != 2 or any(part in name for part in _FP8_SKIP):
            out[name] = w
            continue
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        padded = torch.zeros(rows * block, cols * block)
        padded[: w.shape[0], : w.shape[1]] = w
        tiles = padded.view(rows, block, cols, block)
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # e4m3's largest finite value
        if scale_fmt == "ue8m0":
            scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
        q = (tiles / scale[:, None, :, None]).view(rows * block, cols * block)[: w.shape[0], : w.shape[1]]
        out[name] = q.to(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = scale.to(torch.float8_e8m0fnu) if scale_fmt == "ue8m0" else scale.float()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        **({"scale_fmt": "ue8m0"} if scale_fmt == "ue8m0" else {}),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst


def dequantised_experts_checkpoint(loaded: Any, source: str | Path, dst: str | Path) -> Path:
    """``source`` copied to ``dst`` with every routed expert replaced by the float32 weights the
    quantised container ``loaded`` (a loader.LoadedModel) holds: the oracle for "our int4 run is exact
    for the int4 model"."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst = Path(dst)
    shutil.copytree(source, dst)
    tensors = load_file(dst / "model.safetensors")
    names = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
    for layer, experts in loaded.experts._experts.items():
        for expert_id, expert in experts.items():
            for field_name, hf in names.items():
                weight = getattr(expert, field_name).dequantize(torch.float32)
                v3_name = f"model.layers.{layer}.mlp.experts.{expert_id}.{hf}.weight"
                v4_name = f"model.layers.{layer}.ffn.experts.{expert_id}.{field_name}.weight"  # DeepSeek's names
                tensors[v4_name if v4_name in tensors else v3_name] = weight.contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# A tiny Kimi-K2.5 vision tower: present so the checkpoint has its real shape, never run here.
_TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    pos_emb_height=4,
    pos_emb_width=4,
    pos_emb_time=2,
)


def build_kimi_k25_checkpoint(dst: str | Path, seed: int = 1) -> Path:
    """A tiny Kimi-K2.5 (``model_type`` kimi_k25: the kimi_k2 text model in ``text_config``, a vision
    tower and projector) from transformers' Kimi_K25ForConditionalGeneration. Tensor names as the shipped
    files have them: ``language_model.model.layers.N...`` (transformers 5.23's save_pretrained writes
    ``...model.blocks.N`` for the text layers, its vision tower's rename applied to them; it reads both)."""
    from safetensors.torch import load_file, save_file

    dst = Path(dst)
    config_cls, model_cls = _transformers_classes("kimi_k25")
    spec = TINY_SPECS["kimi_k2"]
    text = {**_COMMON, **spec.config_kwargs, "model_type": "deepseek_v3"}
    config = config_cls(
        text_config=text, vision_config=_TINY_VISION, projection_hidden_size=32, tie_word_embeddings=False
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).float().eval()
        _randomise_untrained_defaults(model)
    model.save_pretrained(dst)
    tensors = load_file(dst / "model.safetensors")
    renamed = {
        name.replace("language_model.model.blocks.", "language_model.model.layers."): t for name, t in tensors.items()
    }
    save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})
    write_tiny_tokenizer(dst, text["vocab_size"])
    return dst


def build_all(root: str | Path, families: Iterable[str] = FAMILIES) -> dict[str, Path]:
    """Build every family's checkpoint under ``root/<family>``."""
    root = Path(root)
    return {family: build_tiny_checkpoint(family, root / family) for family in families}


# --------------------------------------------------------------------------------------------- oracle


def load_reference(checkpoint: str | Path, **config_overrides: Any) -> torch.nn.Module:
    """The transformers model of ``checkpoint`` in float32 eval mode (config fields overridable)."""
    checkpoint = Path(checkpoint)
    raw = json.loads((checkpoint / "config.json").read_text())
    model_type = _ORACLE_MODEL_TYPE.get(raw["model_type"], raw["model_type"])
    config_cls, model_cls = _transformers_classes(model_type)
    raw = {**raw, "model_type": model_type, **config_overrides}
    config = config_cls.from_dict(raw)
    return model_cls.from_pretrained(checkpoint, config=config, dtype=torch.float32).eval()


@dataclass(frozen=True)
class TeacherForced:
    argmax: list[int]  # [T] argmax of the logits at every position
    logits: torch.Tensor  # [T, vocab] float32


@torch.no_grad()
def oracle_greedy(
    checkpoint: str | Path | torch.nn.Module,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    use_cache: bool = True,
) -> list[int]:
    """transformers' greedy continuation of ``prompt_ids`` (new ids only, no EOS stop)."""
    model = _as_model(checkpoint)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    out = model.generate(  # type: ignore[operator]  # a transformers model: nn.Module types generate as an attribute
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=use_cache,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, ids.shape[1] :].tolist()


@torch.no_grad()
def oracle_teacher_forced(checkpoint: str | Path | torch.nn.Module, ids: Sequence[int]) -> TeacherForced:
    """One uncached forward over ``ids``: argmax and float32 logits at every position."""
    model = _as_model(checkpoint)
    logits = model(torch.tensor([list(ids)], dtype=torch.long), use_cache=False).logits[0].float()
    return TeacherForced(argmax=logits.argmax(-1).tolist(), logits=logits)


def _as_model(checkpoint: str | Path | torch.nn.Module) -> torch.nn.Module:
    return checkpoint if isinstance(checkpoint, torch.nn.Module) else load_reference(checkpoint)


def make_prompt(vocab_size: int, length: int, seed: int = 1) -> list[int]:
    """A deterministic pseudo-random prompt (ids 2.. so no BOS/EOS) for oracle comparisons."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (length,), generator=gen).tolist()
