"""The docs/planning.md table: `colibri-stream plan` on the real configs of DeepSeek-V3/R1, DeepSeek-V3.2,
Kimi-K2, GLM-5 and DeepSeek-V4-Flash, for machines of 32/64/128 GB RAM and 0/24 GB VRAM, with this machine's bandwidths.

    python tools/plan_table.py                       # probes this machine's memory and disk
    python tools/plan_table.py --memory-bandwidth 40GB --disk-bandwidth 3GB

Each machine is planned as `plan --ram auto --dtype bfloat16` would plan it there: MemAvailable is 90% of
the RAM, the VRAM tier is 22 GiB of a 24 GB card, the container is `convert`'s default (int4 g64
experts, bf16 dense). Only the config fields that sizes depend on are kept below; the sources are
cited in docs/planning.md.
"""

from __future__ import annotations

import argparse
from typing import Any

from colibri_stream.planning.bandwidth import Bandwidth, measure
from colibri_stream.planning.budget import auto_ram_bytes, parse_size
from colibri_stream.planning.geometry import ContainerTarget, ModelGeometry, geometry_from_config
from colibri_stream.planning.placement import Machine, expected_speed, floor_bytes, plan, verdict
from storage.tiers.config import StoreConfig

GIB = 2**30
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}
MLA = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3",
    **MLA,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "num_attention_heads": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "rope_scaling": YARN,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}
MODELS: dict[str, dict[str, Any]] = {
    "DeepSeek-V3 / R1": DEEPSEEK_V3,
    "DeepSeek-V3.2": {
        **DEEPSEEK_V3,
        "model_type": "deepseek_v32",
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 2048,
    },
    "Kimi-K2": {
        **DEEPSEEK_V3,
        "model_type": "kimi_k2",
        "first_k_dense_replace": 1,
        "n_routed_experts": 384,
        "n_group": 1,
        "topk_group": 1,
        "num_attention_heads": 64,
        "vocab_size": 163840,
        "max_position_embeddings": 131072,
        "rope_scaling": {**YARN, "factor": 32},
    },
    "GLM-5": {
        "model_type": "glm_moe_dsa",
        "hidden_size": 6144,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 78,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "num_attention_heads": 64,
        "q_lora_rank": 2048,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "vocab_size": 154880,
        "max_position_embeddings": 202752,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
    },
    # Its layer layout as the public transcriptions of the Flash config give it (2 sliding, 21 CSA, 20 HCA
    # layers; the 44th entry is the MTP layer's), shipped FP8 dense + FP4 experts (copied as mxfp4).
    "DeepSeek-V4-Flash": {
        "model_type": "deepseek_v4",
        "vocab_size": 129280,
        "hidden_size": 4096,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 43,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "num_hash_layers": 3,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "sliding_window": 128,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
        "max_position_embeddings": 1048576,
        "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
            "expert_dtype": "fp4",
        },
    },
}
RAM_GB = (32, 64, 128)
VRAM_GB = (0, 24)
AVAILABLE = 0.90  # of the RAM: MemAvailable on an idle machine
VRAM_BUDGET = 22 * GIB  # of a 24 GB card, leaving the CUDA context room
DTYPE = "bfloat16"


def row(geometry: ModelGeometry, name: str, ram_gb: int, vram_gb: int, bandwidth: Bandwidth) -> str:
    machine = Machine(ram_gb * GIB, int(AVAILABLE * ram_gb * GIB))
    provisional = plan(geometry, StoreConfig(ram_bytes=0), DTYPE, machine)
    ram = auto_ram_bytes(
        provisional.dense_bytes, provisional.kv_bytes_at_max_context, floor_bytes(provisional), machine.available_bytes
    )
    vram = VRAM_BUDGET if vram_gb else 0
    placement = plan(geometry, StoreConfig(ram_bytes=ram, vram_bytes=vram), DTYPE, machine)
    result = verdict(placement)
    speed = expected_speed(placement, bandwidth)
    tok_s = f"{speed.low_tok_per_s:.2f}-{speed.high_tok_per_s:.2f}" if result.fits else "-"
    cached = f"{placement.cached_fraction:.1%}" if result.fits else "-"
    return f"| {name} | {ram_gb} | {vram_gb} | {cached} | {tok_s} | {result.line} |"


def sizes(geometry: ModelGeometry, name: str) -> str:
    p = plan(geometry, StoreConfig(ram_bytes=0), DTYPE, Machine(0, 0))
    return (
        f"| {name} | {p.dense_bytes / GIB:.1f} | {p.expert_bytes / GIB:.1f} | {p.expert_record_bytes / 2**20:.2f} | "
        f"{p.kv_bytes_per_token} | {p.kv_bytes_at_max_context / GIB:.1f} ({p.max_context}) | "
        f"{p.minimum_ram_slots} | {p.bytes_per_token_at_zero_hits / GIB:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-bandwidth", help="bytes per second instead of the probe, e.g. 40GB")
    parser.add_argument("--disk-bandwidth", help="bytes per second instead of the probe, e.g. 3GB")
    args = parser.parse_args()
    measured = None if args.memory_bandwidth and args.disk_bandwidth else measure(".")
    memory = parse_size(args.memory_bandwidth, 0) if args.memory_bandwidth else measured.memory_bytes_per_s
    disk = parse_size(args.disk_bandwidth, 0) if args.disk_bandwidth else measured.disk_bytes_per_s
    bandwidth = Bandwidth(memory, disk, "given" if args.disk_bandwidth else measured.disk_method)
    print(f"memory {memory / 1e9:.1f} GB/s, disk {disk / 1e9:.2f} GB/s ({bandwidth.disk_method})\n")
    print("| model | dense GiB | experts GiB | record MiB | KV B/token | KV GiB (context) | floor | GiB/token at 0% |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    geometries = {name: geometry_from_config(config, ContainerTarget()) for name, config in MODELS.items()}
    for name, geometry in geometries.items():
        print(sizes(geometry, name))
    print("\n| model | RAM GB | VRAM GB | experts cached | tok/s (0%-100% hits) | verdict |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, geometry in geometries.items():
        for ram_gb in RAM_GB:
            for vram_gb in VRAM_GB:
                print(row(geometry, name, ram_gb, vram_gb, bandwidth))


if __name__ == "__main__":
    main()
