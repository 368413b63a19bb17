"""Which forward pass a model config gets: Transformer (MLA, MLA + DSA) or V4Transformer (DeepSeek-V4)."""

from __future__ import annotations

import torch
from torch import nn

from engine.args import ModelArgs
from engine.model import Transformer
from engine.v4_model import V4Transformer


def transformer_for(args: ModelArgs) -> nn.Module:
    """The model of ``args``' family, parameters uninitialised."""
    return V4Transformer(args) if args.v4 is not None else Transformer(args)


def meta_transformer(args: ModelArgs) -> nn.Module:
    """The model's modules and parameter shapes without memory (on torch's meta device): what loaders
    check names and shapes against before any tensor is read."""
    with torch.device("meta"):
        return transformer_for(args)
