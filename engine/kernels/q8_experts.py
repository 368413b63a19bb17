"""A MoE layer's routed experts with int8 activations in one C call (engine/csrc/q8_moe.c).

Instead of three kernel calls and a few torch ops per expert: x quantised once, gate and up of every expert
as one threaded job, SwiGLU, every down as a second, gate-weighted terms added into the float64 sum. Each row
is computed as alone, as the q8 kernels do.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TypeGuard, cast

import torch

from engine.kernels.expert_calls import common_table, parts_within
from engine.kernels.interleaved_expert import InterleavedExpert
from engine.kernels.modes import activations_are_int8
from engine.kernels.native import _kernels
from engine.kernels.q8 import BLOCK, WEIGHT_KINDS, q8_isa
from engine.kernels.quant import KERNEL_SCALES, QuantizedExpert, QuantizedMatrix
from engine.kernels.rows import kernel_threads

MAX_WORK_BYTES = 32 << 20  # one call's work area at most: a prefill's experts are split over calls


CallExpert = QuantizedExpert | InterleavedExpert  # what the call takes


def fused_experts_handle(experts: Sequence[object], x: torch.Tensor) -> TypeGuard[Sequence[CallExpert]]:
    """Whether ``add_experts`` takes these experts with x: int8 activations on, float32 CPU x, one layout."""
    if not experts or not activations_are_int8() or _kernels is None:
        return False
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[0] == 0:
        return False
    first = _plan(experts[0])
    return first is not None and all((plan := _plan(e)) is not None and plan[0] == first[0] for e in experts[1:])


def expert_table(experts: Sequence[object]) -> tuple[tuple[int, ...], array[int]] | None:
    """A layer's experts for engine/csrc/decode_step.c: ((inter, kind13, kind2, scale kind, group13, group2,
    interleaved), addresses [n, 6] flat); None unless q8_moe takes them all alike."""
    table = common_table([_plan(e) for e in experts])
    if table is None:
        return None
    dim, inter, *call_layout = _call_layout(table[0])
    return (inter, *call_layout), table[1]


def _call_layout(layout: tuple[object, ...]) -> tuple[int, ...]:
    """A plan's layout as q8_moe takes it: (dim, inter, kind13, kind2, scale kind, group13, group2, interleaved)."""
    code13, code2, scale_dtype, group13, group2, dim, inter, interleaved = layout
    kinds = (
        WEIGHT_KINDS[cast(str, code13)],
        WEIGHT_KINDS[cast(str, code2)],
        KERNEL_SCALES[cast(torch.dtype, scale_dtype)],
    )
    return cast(tuple[int, ...], (dim, inter, *kinds, group13, group2, int(cast(bool, interleaved))))


def _plan(expert: object) -> tuple[tuple[object, ...], tuple[int, ...]] | None:
    """(layout, addresses of w1, scales, w3, scales, w2, scales) of an expert the call takes, else None;
    cached on the expert so a decode step does not re-check 18 matrices per layer. An interleaved matrix's
    address stands for its scales too."""
    if not isinstance(expert, (InterleavedExpert, QuantizedExpert)):
        return None
    if expert.q8_plan is None:
        plan = _interleaved_plan(expert) if isinstance(expert, InterleavedExpert) else _row_major_plan(expert)
        object.__setattr__(expert, "q8_plan", plan)  # frozen dataclass
    return expert.q8_plan or None


def _row_major_plan(expert: QuantizedExpert) -> tuple[()] | tuple[tuple[object, ...], tuple[int, ...]]:
    layout = _layout(expert)
    return () if layout is None else (layout, _addresses(expert))


def _interleaved_plan(expert: InterleavedExpert) -> tuple[tuple[object, ...], tuple[int, ...]]:
    w1, w2 = expert.w1, expert.w2
    layout = (w1.code, w2.code, w1.scale_dtype, w1.group_size, w2.group_size, w1.in_dim, w1.out_dim, True)
    return layout, tuple(p for t in expert.tensors() for p in (t.data_ptr(), t.data_ptr()))


def _addresses(expert: QuantizedExpert) -> tuple[int, ...]:
    return tuple(p for m in (expert.w1, expert.w3, expert.w2) for p in (m.q.data_ptr(), m.scales.data_ptr()))


def _layout(expert: QuantizedExpert) -> tuple[object, ...] | None:
    """What one call needs alike in every expert (codes, groups, scale dtype, shape); None if it cannot."""
    w1, w2 = expert.w1, expert.w2
    if not expert.fusable() or not all(_kernel_takes(m) for m in (w1, w2)):
        return None
    return w1.code, w2.code, w1.scales.dtype, w1.group_size, w2.group_size, w1.in_dim, w1.out_dim, False


def _kernel_takes(m: QuantizedMatrix) -> bool:
    return m.code in WEIGHT_KINDS and m.group_size % BLOCK == 0 and m.scales.dtype in KERNEL_SCALES


def add_experts(
    out: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: Sequence[int],
    experts: Sequence[CallExpert],
    limit: float | None = None,
) -> None:
    """out [N, dim] float64 += sum over the listed experts e of weight[r, e] * e(x[r]) for every row r routed
    to e. x [N, dim] float32, ids and weights [N, topk]; experts[i] is expert_ids[i]; fused_experts_handle
    must hold; ``limit``: the SwiGLU clamp."""
    x, weights = x.contiguous(), weights.float().contiguous()
    ids = ids.to(torch.int64).contiguous()
    plans = [_plan(e) for e in experts]
    dim, inter, kind13, kind2, scale_kind, group13, group2, interleaved = _call_layout(plans[0][0])  # type: ignore[index]
    for part in _parts(ids, list(expert_ids), dim, inter):
        mats = array("Q", [p for i in part for p in plans[i][1]])  # type: ignore[index]  # [n, 6] addresses
        part_ids = array("q", [expert_ids[i] for i in part])
        _kernels.q8_moe(
            x.data_ptr(), x.shape[0], dim, inter,
            ids.data_ptr(), weights.data_ptr(), ids.shape[1],
            part_ids.buffer_info()[0], len(part), mats.buffer_info()[0],
            kind13, kind2, scale_kind, group13, group2, bool(interleaved),
            limit is not None, float(limit or 0.0),
            out.data_ptr(), q8_isa(), kernel_threads(),
        )  # fmt: skip


def _parts(ids: torch.Tensor, expert_ids: list[int], dim: int, inter: int) -> list[list[int]]:
    row_bytes = 4 * (2 * inter + dim) + 2 * (dim + inter) + 16  # gate, up, y float32; x, h int8 + scales
    return parts_within(ids, expert_ids, row_bytes, MAX_WORK_BYTES)
