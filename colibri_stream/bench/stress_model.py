"""Generated DeepSeek-V3-shaped checkpoints big enough to stress streaming, written shard by shard.

transformers' model classes would materialise the whole model in RAM; this writes the same HF layout
(config.json, one safetensors shard per layer, model.safetensors.index.json) one layer at a time, so
a model several times larger than RAM can be generated on a small machine. Weights are random
(seeded), scaled like a trained model's (std 0.02 inputs, larger router spread so routing is skewed).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm


@dataclass(frozen=True)
class StressShape:
    hidden_size: int = 2048
    moe_intermediate_size: int = 1024
    intermediate_size: int = 4096
    n_routed_experts: int = 64
    num_experts_per_tok: int = 6
    num_hidden_layers: int = 20
    first_k_dense_replace: int = 1
    num_attention_heads: int = 16
    kv_lora_rank: int = 256
    q_lora_rank: int = 512
    qk_rope_head_dim: int = 32
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    vocab_size: int = 8192
    n_group: int = 8
    topk_group: int = 4
    max_position_embeddings: int = 4096  # the context (an agent bench's 4k preamble needs more)


QUICK = StressShape(
    hidden_size=256,
    moe_intermediate_size=128,
    intermediate_size=512,
    n_routed_experts=16,
    num_experts_per_tok=4,
    num_hidden_layers=4,
    num_attention_heads=4,
    kv_lora_rank=64,
    q_lora_rank=96,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    vocab_size=1024,
    n_group=4,
    topk_group=2,
)


def config_for(shape: StressShape) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **asdict(shape),
        "num_key_value_heads": shape.num_attention_heads,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }


def checkpoint_bytes(shape: StressShape) -> int:
    """The bytes ``write_stress_checkpoint`` writes for ``shape`` (bf16 tensors, as ``_layer_tensors`` and
    the global shard make them; headers aside), computed without making them."""
    h, heads = shape.hidden_size, shape.num_attention_heads
    qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    attention = (
        2 * h
        + shape.q_lora_rank * (h + 1 + heads * qk)
        + (shape.kv_lora_rank + shape.qk_rope_head_dim) * h
        + shape.kv_lora_rank * (1 + heads * (shape.qk_nope_head_dim + shape.v_head_dim))
        + h * heads * shape.v_head_dim
    )
    dense_mlp = 3 * shape.intermediate_size * h
    moe_mlp = shape.n_routed_experts * (h + 2) + (shape.n_routed_experts + 1) * 3 * shape.moe_intermediate_size * h
    dense_layers = min(shape.first_k_dense_replace, shape.num_hidden_layers)
    layers = shape.num_hidden_layers * attention + dense_layers * dense_mlp
    layers += (shape.num_hidden_layers - dense_layers) * moe_mlp
    return 2 * (layers + 2 * shape.vocab_size * h + h)


def _layer_tensors(shape: StressShape, layer: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def w(*dims: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * std).to(torch.bfloat16)

    h, p = shape.hidden_size, f"model.layers.{layer}."
    heads, qk = shape.num_attention_heads, shape.qk_nope_head_dim + shape.qk_rope_head_dim
    t = {
        p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        p + "self_attn.q_a_proj.weight": w(shape.q_lora_rank, h),
        p + "self_attn.q_a_layernorm.weight": torch.ones(shape.q_lora_rank, dtype=torch.bfloat16),
        p + "self_attn.q_b_proj.weight": w(heads * qk, shape.q_lora_rank),
        p + "self_attn.kv_a_proj_with_mqa.weight": w(shape.kv_lora_rank + shape.qk_rope_head_dim, h),
        p + "self_attn.kv_a_layernorm.weight": torch.ones(shape.kv_lora_rank, dtype=torch.bfloat16),
        p + "self_attn.kv_b_proj.weight": w(heads * (shape.qk_nope_head_dim + shape.v_head_dim), shape.kv_lora_rank),
        p + "self_attn.o_proj.weight": w(h, heads * shape.v_head_dim),
    }
    if layer < shape.first_k_dense_replace:
        for name, dims in (("gate", (shape.intermediate_size, h)), ("up", (shape.intermediate_size, h))):
            t[p + f"mlp.{name}_proj.weight"] = w(*dims)
        t[p + "mlp.down_proj.weight"] = w(h, shape.intermediate_size)
        return t
    inter = shape.moe_intermediate_size
    # A wide router spread and a skewed bias give the non-uniform expert usage real routers have.
    t[p + "mlp.gate.weight"] = w(shape.n_routed_experts, h, std=0.5 / h**0.5 * 4)
    t[p + "mlp.gate.e_score_correction_bias"] = torch.randn(shape.n_routed_experts, generator=gen) * 0.05
    for prefix in [f"mlp.experts.{e}." for e in range(shape.n_routed_experts)] + ["mlp.shared_experts."]:
        t[p + prefix + "gate_proj.weight"] = w(inter, h)
        t[p + prefix + "up_proj.weight"] = w(inter, h)
        t[p + prefix + "down_proj.weight"] = w(h, inter)
    return t


def write_stress_checkpoint(
    dst: str | Path, shape: StressShape = StressShape(), seed: int = 0, progress: bool = True
) -> Path:
    """Write the checkpoint one layer-shard at a time; peak memory is one layer's tensors."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shards = shape.num_hidden_layers + 1
    for index in tqdm(range(shards), desc="stress model", unit="shard", disable=not progress):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        if index < shape.num_hidden_layers:
            tensors = _layer_tensors(shape, index, gen)
        else:
            h = shape.hidden_size
            tensors = {
                "model.embed_tokens.weight": (torch.randn(shape.vocab_size, h, generator=gen) * 0.5).to(torch.bfloat16),
                "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                "lm_head.weight": (torch.randn(shape.vocab_size, h, generator=gen) * 0.02).to(torch.bfloat16),
            }
        save_file(tensors, dst / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (dst / "config.json").write_text(json.dumps(config_for(shape), indent=2, sort_keys=True) + "\n")
    return dst
