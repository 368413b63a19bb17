"""Tiny checkpoints whose routed experts ship quantised by compressed-tensors, built with its own
machinery, and their dequantised twin for the transformers oracle.

The path is llm-compressor's: ``apply_quantization_config`` attaches a scheme and scale parameters to
every targeted ``nn.Linear`` (modules matching ``ignore`` are left alone), the scales are calibrated with
compressed-tensors' ``calculate_qparams`` from each group's min/max (llm-compressor's min-max observer),
``ModelCompressor.compress_model`` packs the weights, and ``update_config`` writes config.json's
``quantization_config``. transformers 5 holds a DeepSeek-V3 layer's experts fused in 3-D parameters, which
compressed-tensors does not target, so the tensors of a float checkpoint are re-hosted in one
``nn.Linear`` per checkpoint module (the names a safetensors file has, as llm-compressor's MoE
calibration modules unfuse them). Routed experts are cast to bfloat16 first, so their scales are
bfloat16 as in a bf16 model (Kimi-K2-Thinking); every other tensor stays float32.

The oracle's checkpoint is dequantised by compressed-tensors' model-free ``CompressedTensorsDequantizer``
with the scales widened to float32 first (exactly: bf16 -> f32 loses nothing), so its float32 weights are
exactly q * scale, the values the codes mean (dequantising in bf16 would round the products).

compressed-tensors and transformers are dev dependencies, imported lazily.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

ROUTED = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
# Everything but routed experts stays in floats (Kimi-K2-Thinking's ignore list is of this kind).
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*\.mlp\.(gate|up|down)_proj$"]
FORMATS = ("pack-quantized", "mxfp4-pack-quantized")


def _scheme(fmt: str, group_size: int, **weight_overrides):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    if fmt == "mxfp4-pack-quantized":
        return preset_name_to_scheme("MXFP4A16", ["Linear"])
    weights = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**{**weights, **weight_overrides}))


def _linear_tree(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """One nn.Linear per checkpoint projection, at the module path its tensor name says."""
    root = torch.nn.Module()
    for name, weight in tensors.items():
        if not (name.endswith(".weight") and weight.dim() == 2 and ("_proj." in name or name.startswith("lm_head"))):
            continue
        path = name[: -len(".weight")].split(".")
        parent = root
        for part in path[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        routed = ROUTED.match(".".join(path)) is not None
        linear.weight = torch.nn.Parameter(weight.to(torch.bfloat16) if routed else weight, requires_grad=False)
        parent.add_module(path[-1], linear)
    return root


def _calibrate(root: torch.nn.Module) -> None:
    """Static weight scales from each group's min/max, as llm-compressor's min-max observer sets them."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams

    for module in root.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        groups = module.weight.unflatten(-1, (-1, scheme.weights.group_size))  # type: ignore[operator]  # nn.Module types its attributes as Tensor | Module
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))  # type: ignore[operator]  # nn.Module types its attributes as Tensor | Module
        module.quantization_status = QuantizationStatus.FROZEN


def build_quantized_checkpoint(
    source: str | Path, dst: str | Path, fmt: str = "pack-quantized", group_size: int = 32, **weight_overrides
) -> Path:
    """Copy the float checkpoint ``source`` to ``dst`` with its routed experts quantised by compressed-tensors
    (``fmt`` one of FORMATS; ``weight_overrides`` bend the scheme's weight arguments, for refusal tests)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file, save_file

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {FORMATS}")
    source, dst = Path(source), Path(dst)
    shutil.copytree(source, dst)
    tensors = load_file(source / "model.safetensors")
    root = _linear_tree(tensors)
    config = QuantizationConfig(config_groups={"group_0": _scheme(fmt, group_size, **weight_overrides)}, ignore=IGNORE)
    apply_quantization_config(root, config, show_progress=False)
    _calibrate(root)
    compressor = ModelCompressor.from_pretrained_model(root)
    compressor.compress_model(root)
    compressed = {name: t.detach().contiguous() for name, t in root.state_dict().items()}
    packed = {name.removesuffix("_packed") for name in compressed if name.endswith(".weight_packed")}
    kept = {name: t for name, t in tensors.items() if name not in compressed and name not in packed}
    save_file({**kept, **compressed}, dst / "model.safetensors", metadata={"format": "pt"})
    compressor.update_config(str(dst))
    _sort_config(dst / "config.json")
    return dst


def _sort_config(path: Path) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()), indent=2, sort_keys=True) + "\n")


def build_dequantized_checkpoint(quantized: str | Path, dst: str | Path) -> Path:
    """The float32 checkpoint compressed-tensors' dequantiser makes of ``quantized`` (scales widened to
    float32 first, so every weight is exactly q * scale), for the transformers oracle."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file, save_file

    quantized, dst = Path(quantized), Path(dst)
    shutil.copytree(quantized, dst)
    tensors = load_file(quantized / "model.safetensors")
    widened = {n: t.float() if n.endswith(".weight_scale") and t.is_floating_point() else t for n, t in tensors.items()}
    dequantizer = CompressedTensorsDequantizer(quantized, dtype=torch.float32)
    save_file(dequantizer.process(widened), dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst
