"""Load a Hugging Face checkpoint directory into the engine: resident dense part + resident experts.

This is the float path (the tiny fixtures, small models, exactness tests). Large models go through
`colibri-stream convert` and the tiered expert store instead.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.args import ModelArgs
from engine.experts import ExpertWeights, ResidentExperts
from engine.model import Transformer
from engine.weights import check_complete, engine_name, is_extra_layer, routed_expert_key

# Kept in float32 whatever the compute dtype, as the reference keeps them.
FLOAT32_PARAMETERS = ("ffn.gate.bias", "attn.indexer.weights_proj.weight")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file."""


@dataclass
class LoadedModel:
    path: Path
    config: dict[str, Any]
    args: ModelArgs
    model: Transformer
    experts: ResidentExperts


def read_config(path: str | Path) -> dict[str, Any]:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found (expected a Hugging Face checkpoint directory)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path}: invalid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    return config


def shard_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in model.safetensors.index.json but missing")
    return files


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedModel:
    path = Path(path)
    config = read_config(path)
    args = ModelArgs.from_hf_config(config)
    dense: dict[str, torch.Tensor] = {}
    routed: dict[int, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    unmapped: list[str] = []
    for file in shard_files(path):
        with safe_open(file, framework="pt", device=device) as shard:
            for name in shard.keys():
                if is_extra_layer(name, args.n_layers):
                    continue
                if (key := routed_expert_key(name)) is not None:
                    layer, expert, proj = key
                    routed[layer][expert][proj] = shard.get_tensor(name).to(dtype)
                elif (target := engine_name(name)) is not None:
                    dense[target] = shard.get_tensor(name)
                else:
                    unmapped.append(name)
    if args.tie_word_embeddings and "head.weight" not in dense and "embed.weight" in dense:
        dense["head.weight"] = dense["embed.weight"]
    with torch.device("meta"):
        model = Transformer(args)
    check_complete(unmapped, model.state_dict().keys(), dense.keys(), str(path))
    for name, tensor in dense.items():
        dense[name] = tensor.to(torch.float32 if name.endswith(FLOAT32_PARAMETERS) else dtype)
    model.load_state_dict(dense, strict=True, assign=True)
    return LoadedModel(path, config, args, model.eval(), ResidentExperts(_routed_experts(args, routed, path)))


def _routed_experts(args: ModelArgs, routed: dict, path: Path) -> dict[int, dict[int, ExpertWeights]]:
    unexpected = sorted(set(routed) - set(args.moe_layers))
    if unexpected:
        raise CheckpointError(f"{path}: routed experts in dense layer(s) {unexpected}")
    experts: dict[int, dict[int, ExpertWeights]] = {}
    for layer in args.moe_layers:
        found = routed.get(layer, {})
        if sorted(found) != list(range(args.n_routed_experts)):
            raise CheckpointError(
                f"{path}: layer {layer} has routed experts {sorted(found)[:8]}... "
                f"({len(found)}), expected 0..{args.n_routed_experts - 1}"
            )
        for expert, weights in found.items():
            if set(weights) != {"w1", "w2", "w3"}:
                raise CheckpointError(
                    f"{path}: layer {layer} expert {expert} lacks {sorted({'w1', 'w2', 'w3'} - set(weights))}"
                )
        experts[layer] = {e: ExpertWeights(w["w1"], w["w2"], w["w3"]) for e, w in found.items()}
    return experts
