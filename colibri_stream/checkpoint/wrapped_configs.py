"""Multimodal wrappers around a supported text model: the config of the text model they carry.

Kimi-K2.5 ships ``model_type: kimi_k25`` with the DeepSeek-V3 text model's fields under ``text_config``
(model_type deepseek_v3 or kimi_k2), a ``vision_config`` and, at the top level, the checkpoint-wide
``quantization_config`` and ``tie_word_embeddings`` (transformers' Kimi_K25ForConditionalGeneration
ties by the top-level flag). This runtime runs the text model; engine/config/weights.py matches its
prefixed tensor names and sorts the vision tower's tensors as skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colibri_stream.errors import CheckpointError
from engine.config.checks import brief

# wrapper model_type -> the key holding the text model's config
WRAPPERS = {"kimi_k25": "text_config"}
# top-level keys that describe the whole checkpoint and so apply to the text model too
CARRIED_KEYS = ("quantization_config", "tie_word_embeddings")


def text_model_config(config: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """``config`` itself, or for a multimodal wrapper the text model's config with the carried keys."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in WRAPPERS:
        return dict(config)
    key = WRAPPERS[model_type]
    inner = config.get(key)
    if not isinstance(inner, dict):
        raise CheckpointError(f"{where}: model_type {model_type} needs a {key} object, got {brief(inner)}")
    text = {**inner, **{k: config[k] for k in CARRIED_KEYS if k in config}}
    text.setdefault("model_type", "deepseek_v3")  # transformers' default for kimi_k25's text_config
    return text
