"""A tiny checkpoint laid out as the Hub ships big ones: FP8 with block scales, cut into several
safetensors shards with ``model.safetensors.index.json``, tensors in the order ``save_pretrained`` writes
them (embeddings, layer by layer, final norm, head). Small shards put boundaries inside a layer's
experts: an expert's projections, or an FP8 weight and its ``weight_scale_inv``, land in two shards,
which is what a streaming `pull` must handle."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from colibri_stream.devtools import fixtures

INDEX = "model.safetensors.index.json"


def _save_order(name: str) -> tuple[int, int, str]:
    """embed_tokens first, layers in order (experts by number), norm and lm_head last."""
    if match := re.match(r"model\.layers\.(\d+)\.(.*)", name):
        rest = re.sub(r"experts\.(\d+)\.", lambda m: f"experts.{int(m[1]):06d}.", match[2])
        return 1, int(match[1]), rest
    return (0 if "embed" in name else 2), 0, name


def reshard(src: str | Path, dst: str | Path, max_shard_bytes: int) -> Path:
    """Copy checkpoint ``src`` (one model.safetensors) to ``dst`` cut into shards of at most
    ``max_shard_bytes`` (a bigger tensor gets a shard of its own, as ``save_pretrained`` does)."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", INDEX))
    tensors = load_file(src / "model.safetensors")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors, key=_save_order):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, dst / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return dst


def build_sharded_fp8_checkpoint(
    root: str | Path, family: str = "deepseek_v3", max_shard_bytes: int = 48 << 10, block: int = 32
) -> Path:
    """``root/<family>-fp8-sharded``: the tiny ``family`` checkpoint as FP8 (``block`` x ``block`` scales),
    in shards of at most ``max_shard_bytes``."""
    root = Path(root)
    base = fixtures.build_tiny_checkpoint(family, root / f"{family}-f32")
    fp8 = fixtures.build_fp8_checkpoint(base, root / f"{family}-fp8", block=block)
    return reshard(fp8, root / f"{family}-fp8-sharded", max_shard_bytes)
