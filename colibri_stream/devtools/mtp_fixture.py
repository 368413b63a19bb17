"""An MTP layer added to a tiny checkpoint, as DeepSeek-V3/R1, GLM-5 and DeepSeek-V4 ship theirs.

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
_UNPERTURBED = ("e_score_correction_bias", "ffn.gate.bias")  # router correction biases (V3's, V4's)
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
    return _perturbed(block, f"model.layers.{n_layers}.", generator, scale)


def _perturbed(
    block: dict[str, torch.Tensor], prefix: str, generator: torch.Generator, scale: float
) -> dict[str, torch.Tensor]:
    """``block``'s tensors under ``prefix``, each plus noise of ``scale`` times its spread; norms, router
    biases and integer tables unchanged."""
    out = {}
    for name, t in block.items():
        if not t.is_floating_point():
            out[prefix + name] = t.clone()
            continue
        noise = torch.randn(t.shape, generator=generator) * scale * t.float().std().nan_to_num(0.0)
        kept = name.endswith(_UNPERTURBED) or re.search(r"norm\.(weight|bias)$", name)
        out[prefix + name] = t.clone() if kept else (t.float() + noise).to(t.dtype)
    return out


def add_v4_mtp_module(checkpoint: str | Path, seed: int = 0, scale: float = 0.05) -> Path:
    """Add DeepSeek-V4's MTP module mtp.0 to a tiny V4 ``checkpoint`` in place: its block a copy of the last
    layer's (perturbed); config.json ships it (num_nextn_predict_layers 1) and lists its block's attention
    as CSA, so a draft's own compressors and indexer run too."""
    path = Path(checkpoint)
    config = json.loads((path / "config.json").read_text())
    n_layers, dim, streams = int(config["num_hidden_layers"]), int(config["hidden_size"]), int(config["hc_mult"])
    tensors = _read_all(path)
    generator = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n_layers - 1}."
    block = {name.removeprefix(last): t for name, t in tensors.items() if name.startswith(last)}
    module = _perturbed(block, "mtp.0.", generator, scale)
    for norm in ("enorm", "hnorm", "norm"):
        module[f"mtp.0.{norm}.weight"] = 1 + scale * torch.randn(dim, generator=generator)
    for proj in ("e_proj", "h_proj"):
        module[f"mtp.0.{proj}.weight"] = torch.randn(dim, dim, generator=generator) / dim**0.5
    module["mtp.0.hc_head_fn"] = torch.randn(streams, streams * dim, generator=generator) / (streams * dim) ** 0.5
    module["mtp.0.hc_head_base"] = scale * torch.randn(streams, generator=generator)
    module["mtp.0.hc_head_scale"] = torch.ones(1)
    dtype = tensors["model.embed_tokens.weight"].dtype
    save_file(
        {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in module.items()},
        str(path / MTP_SHARD),
    )
    _index(path, sorted(module))
    config["num_nextn_predict_layers"] = 1
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [*config["layer_types"][:n_layers], "compressed_sparse_attention"]
    if isinstance(config.get("mlp_layer_types"), list):
        config["mlp_layer_types"] = [*config["mlp_layer_types"][:n_layers], "moe"]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


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
