"""An MTP layer added to a tiny checkpoint, as DeepSeek-V3/R1 and GLM-5 ship theirs.

transformers' classes neither build nor save the multi-token-prediction layer (``num_nextn_predict_layers``
is read and ignored), so the oracle fixtures have none. This writes one beside the checkpoint's shards:
``model.layers.N.*`` (N = num_hidden_layers) holding a decoder block (its tensors those of the last
MoE layer, perturbed, with a DSA indexer from a "full" layer where the model has DSA), ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm``, and the copies of the embedding and output head the real
checkpoints carry. The weights are random: drafts are rarely right, which is what a governor test
wants; verification keeps the tokens exact whatever the drafts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MTP_SHARD = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"


def add_mtp_layer(checkpoint: str | Path, seed: int = 0, scale: float = 0.05) -> Path:
    """Add one MTP layer to ``checkpoint`` in place (a new shard, the index and config.json updated)."""
    path = Path(checkpoint)
    config = json.loads((path / "config.json").read_text())
    n_layers = int(config["num_hidden_layers"])
    tensors = _read_all(path)
    generator = torch.Generator().manual_seed(seed)
    layer = _block_tensors(tensors, config, n_layers, generator, scale)
    dim = int(config["hidden_size"])
    prefix = f"model.layers.{n_layers}."
    layer[prefix + "enorm.weight"] = 1 + scale * torch.randn(dim, generator=generator)
    layer[prefix + "hnorm.weight"] = 1 + scale * torch.randn(dim, generator=generator)
    layer[prefix + "eh_proj.weight"] = torch.randn(dim, 2 * dim, generator=generator) / (2 * dim) ** 0.5
    layer[prefix + "shared_head.norm.weight"] = 1 + scale * torch.randn(dim, generator=generator)
    layer[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    layer[prefix + "shared_head.head.weight"] = head.clone()
    dtype = tensors["model.embed_tokens.weight"].dtype
    save_file({k: v.to(dtype).contiguous() for k, v in layer.items()}, str(path / MTP_SHARD))
    _index(path, sorted(layer))
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        if shard.name == MTP_SHARD:
            continue
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = f.get_tensor(name)
    return tensors


def _block_tensors(
    tensors: dict[str, torch.Tensor], config: dict, n_layers: int, generator: torch.Generator, scale: float
) -> dict[str, torch.Tensor]:
    """The last layer's block tensors renamed to layer n_layers and perturbed; the indexer's from the last
    layer that has one (GLM-5 and V3.2 "shared" layers have none, an MTP block runs its own)."""
    last = f"model.layers.{n_layers - 1}."
    block = {name.removeprefix(last): t for name, t in tensors.items() if name.startswith(last)}
    if not any(".indexer." in name for name in block):
        for layer in reversed(range(n_layers)):
            own = f"model.layers.{layer}."
            found = {n.removeprefix(own): t for n, t in tensors.items() if n.startswith(own) and ".indexer." in n}
            if found:
                block.update(found)
                break
    out = {}
    for name, t in block.items():
        noise = torch.randn(t.shape, generator=generator) * scale * t.float().std().nan_to_num(0.0)
        keep = name.endswith("e_score_correction_bias") or re.search(r"norm\.(weight|bias)$", name)
        out[f"model.layers.{n_layers}.{name}"] = t.clone() if keep else (t.float() + noise).to(t.dtype)
    return out


def _index(path: Path, names: list[str]) -> None:
    """Name the new shard in the index; a single-file checkpoint gets an index naming both files."""
    index_path = path / INDEX
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        (single,) = [p for p in path.glob("*.safetensors") if p.name != MTP_SHARD]
        with safe_open(single, framework="pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), single.name)}
    index["weight_map"].update(dict.fromkeys(names, MTP_SHARD))
    index_path.write_text(json.dumps(index, indent=2))
