"""A tiny DeepSeek-V4 checkpoint in the format DeepSeek ships V4 in, built from a float one.

As the hub files hold it: DeepSeek's own tensor names (no "model." prefix, ``embed``, ``hc_head_fn``),
attention and shared-expert weights in FP8 e4m3 with ue8m0 (power-of-two) scales per 128 x 128 block,
routed experts in FP4 e2m1 (two codes per int8 byte, even column in the low nibble) with ue8m0 scales
per 32 inputs, each scale under ``<module>.scale``; compressor and indexer projections, embeddings and
the head in bf16, 1-D parameters in float32; ``quantization_config`` {fp8, e4m3, ue8m0, [128, 128],
expert_dtype fp4}. Expert inputs must be multiples of 32, as in every real V4 checkpoint.

``dequantised_v4_checkpoint`` writes the float checkpoint those bytes mean, decoded by transformers'
own FP8/FP4 dequantiser (not ours): the oracle for a converted V4-native container.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BLOCK = 128
FP4_GROUP = 32
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [BLOCK, BLOCK],
    "activation_scheme": "dynamic",
    "expert_dtype": "fp4",
}
_ROUTED = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
_FP8 = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight")
_HUB_NAMES = ((r"^embed_tokens\.", "embed."), (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"))


def _power_of_two_scale(amax: torch.Tensor, largest: float) -> torch.Tensor:
    """The smallest power of two s with amax / s <= largest (1 for all-zero blocks)."""
    return torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / largest, min=2.0**-126))))


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    return (torch.log2(scale).round().to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn [out, in], e8m0 scales [ceil(out/128), ceil(in/128)])."""
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // BLOCK), -(-in_dim // BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK)
    padded[:out_dim, :in_dim] = w.float()
    amax = padded.view(rows, BLOCK, cols, BLOCK).abs().amax(dim=(1, 3))
    scale = _power_of_two_scale(amax, FP8_MAX)
    expanded = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:out_dim, :in_dim]
    return (w.float() / expanded).to(torch.float8_e4m3fn), _e8m0(scale)


def fp4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (in a multiple of 32) -> (int8 [out, in / 2] e2m1 pairs, e8m0 scales [out, in / 32])."""
    out_dim, in_dim = w.shape
    if in_dim % FP4_GROUP:
        raise ValueError(f"FP4 experts need inputs in multiples of {FP4_GROUP}, not {in_dim}")
    groups = w.float().view(out_dim, -1, FP4_GROUP)
    scale = _power_of_two_scale(groups.abs().amax(dim=-1), FP4_MAX)
    scaled = (groups / scale[..., None]).view(out_dim, in_dim)
    magnitude = (scaled.abs()[..., None] - FP4_MAGNITUDES).abs().argmin(dim=-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), _e8m0(scale)


def _hub_name(name: str) -> str:
    name = name.removeprefix("model.")
    for pattern, target in _HUB_NAMES:
        name = re.sub(pattern, target, name)
    return name


def build_v4_native_checkpoint(float_checkpoint: str | Path, dst: str | Path) -> Path:
    """``float_checkpoint`` (a tiny V4 from fixtures.build_tiny_checkpoint) re-encoded as DeepSeek ships V4."""
    from safetensors.torch import load_file, save_file

    source, dst = Path(float_checkpoint), Path(dst)
    shutil.copytree(source, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    shipped: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        hub = _hub_name(name)
        base = hub.removesuffix(".weight")
        if _ROUTED.fullmatch(hub):
            shipped[hub], shipped[f"{base}.scale"] = fp4_groups(tensor)
        elif _FP8.fullmatch(hub):
            shipped[hub], shipped[f"{base}.scale"] = fp8_blocks(tensor)
        elif tensor.is_floating_point() and tensor.dim() == 2:
            shipped[hub] = tensor.to(torch.bfloat16)
        else:
            shipped[hub] = tensor
    save_file(shipped, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst


def dequantised_v4_checkpoint(native: str | Path, dst: str | Path) -> Path:
    """The float32 checkpoint a V4-native one means, each FP8/FP4 weight decoded by transformers'
    ``Fp8Dequantize`` (an independent decoder), names as save_pretrained writes them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    native, dst = Path(native), Path(dst)
    shutil.copytree(native, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    decoder = Fp8Dequantize(None)
    shipped = load_file(native / "model.safetensors")
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in shipped.items():
        if name.endswith(".scale") and f"{name[: -len('.scale')]}.weight" in shipped:
            continue
        scale = shipped.get(f"{name.removesuffix('.weight')}.scale")
        if scale is not None:
            tensor = decoder._dequantize_one(tensor, scale.view(torch.uint8), output_dtype=torch.float32)
        plain[name] = tensor.float() if tensor.is_floating_point() else tensor
    save_file(plain, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst
