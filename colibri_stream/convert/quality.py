"""Quantisation quality measures: per-matrix relative error, and top-1 agreement / KL between the
next-token distributions of a quantised and a float model."""

from __future__ import annotations

import torch

from engine.kernels.quant import quantized_matrix


def relative_error(w: torch.Tensor, bits: int, group_size: int) -> float:
    """||dequant(quant(w)) - w|| / ||w|| (Frobenius)."""
    return ((quantized_matrix(w, bits, group_size).dequantize() - w.float()).norm() / w.float().norm()).item()


def top1_agreement(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Share of positions whose argmax agrees; logits [T, vocab]."""
    return (reference.argmax(-1) == candidate.argmax(-1)).float().mean().item()


def mean_kl(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Mean over positions of KL(reference || candidate) in nats; logits [T, vocab]."""
    p_log = reference.float().log_softmax(-1)
    q_log = candidate.float().log_softmax(-1)
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean().item()
