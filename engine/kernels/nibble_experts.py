"""A MoE layer's routed 4-bit experts with float32 activations in one C call (engine/csrc/nibble_moe.c).

Instead of three kernel calls and a few torch ops per expert: gate and up of every expert as one threaded job,
SwiGLU, every down as a second, gate-weighted terms added into the float64 sum. Each product's bits are those
``QuantizedMatrix.matmul`` gives (decode rows as alone). SwiGLU is C's ``expf`` silu, so which experts a call
takes must depend on the routing alone.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

import torch

from engine.kernels.expert_calls import common_table, parts_within
from engine.kernels.modes import activations_are_int8
from engine.kernels.native import BUILT, _kernels
from engine.kernels.quant import KERNEL_CODES, KERNEL_SCALES, PROMPT_KERNEL_ROWS, QuantizedExpert, QuantizedMatrix
from engine.kernels.rows import computing_alone, kernel_threads

MAX_WORK_BYTES = 32 << 20  # one call's work area at most: a long batch's experts are split over calls


def in_one_call(
    batch: Sequence[tuple[int, object]], x: torch.Tensor, rows_routed: Callable[[int], int]
) -> list[tuple[int, QuantizedExpert]]:
    """The (id, expert) pairs ``add_nibble_experts`` takes with x (float32 CPU, int8 activations off): experts
    of one common layout, for a prompt only those ``rows_routed(id)`` keeps within PROMPT_KERNEL_ROWS."""
    if not batch or not BUILT or activations_are_int8():
        return []
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[0] == 0:
        return []
    batch = [(i, e) for i, e in batch if takes_rows(x, rows_routed(i))]
    planned = [(i, e, plan) for i, e in batch if isinstance(e, QuantizedExpert) and (plan := _plan(e)) is not None]
    if any(plan[0] != planned[0][2][0] for _, _, plan in planned):
        return []
    return [(i, e) for i, e, _ in planned]


def takes_rows(x: torch.Tensor, rows: int) -> bool:
    """Whether the call takes an expert routed ``rows`` rows of x (past PROMPT_KERNEL_ROWS dequantising wins)."""
    return decode_rows(x) or rows <= PROMPT_KERNEL_ROWS


def decode_rows(x: torch.Tensor) -> bool:
    """Whether x's rows are decode rows, each computed as alone: one row, or any inside rows_alone()."""
    return computing_alone() or x.shape[0] == 1


def expert_table(experts: Sequence[object]) -> tuple[tuple[int, ...], array[int]] | None:
    """A layer's experts for engine/csrc/decode_step.c's float32 path: ((inter, code13, code2, scale kind,
    group13, group2, 0), addresses [n, 6] flat); None unless the call takes them all alike."""
    table = common_table([_plan(e) for e in experts])
    return None if table is None else ((*table[0][1:], 0), table[1])  # the layout without dim (the plan's own)


def _plan(expert: object) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(layout, addresses of w1, scales, w3, scales, w2, scales) of an expert the call takes, else None;
    cached on the expert."""
    if not isinstance(expert, QuantizedExpert):
        return None
    if expert.nibble_plan is None:
        layout = _layout(expert)
        addresses = tuple(p for m in (expert.w1, expert.w3, expert.w2) for p in (m.q.data_ptr(), m.scales.data_ptr()))
        object.__setattr__(expert, "nibble_plan", () if layout is None else (layout, addresses))  # frozen dataclass
    return expert.nibble_plan or None


def _layout(expert: QuantizedExpert) -> tuple[int, ...] | None:
    """(dim, inter, code13, code2, scale kind, group13, group2) when the kernel takes all three matrices alike."""
    w1, w2 = expert.w1, expert.w2
    if not expert.fusable() or not all(_kernel_takes(m) for m in (w1, w2)):
        return None
    codes = (KERNEL_CODES[w1.code], KERNEL_CODES[w2.code], KERNEL_SCALES[w1.scales.dtype])
    return w1.in_dim, w1.out_dim, *codes, w1.group_size, w2.group_size


def _kernel_takes(m: QuantizedMatrix) -> bool:
    return m.code in KERNEL_CODES and m.group_size >= 2 and m.group_size % 2 == 0 and m.scales.dtype in KERNEL_SCALES


def add_nibble_experts(
    out: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: Sequence[int],
    experts: Sequence[QuantizedExpert],
    limit: float | None = None,
    segments: Sequence[int] = (),
) -> None:
    """out [N, dim] float64 += sum over the listed experts e of weight[r, e] * e(x[r]) for every row r routed
    to e. x [N, dim] float32, ids and weights [N, topk]; experts[i] is expert_ids[i]; ``limit``: the SwiGLU
    clamp; ``segments``: runs of rows, each the bits of its own call."""
    x, weights = x.contiguous(), weights.float().contiguous()
    ids = ids.to(torch.int64).contiguous()
    layout = _plan(experts[0])[0]  # type: ignore[index]  # in_one_call chose it
    dim, inter = layout[0], layout[1]
    row_bytes = 4 * (3 * inter + 3 * dim) + 8  # gate, up, y, x, the laid-out x and h (float32); row, weight
    runs = array("i", segments)
    for part in parts_within(ids, list(expert_ids), row_bytes, MAX_WORK_BYTES):
        mats = array("Q", [p for i in part for p in _plan(experts[i])[1]])  # type: ignore[index]  # [n, 6]
        part_ids = array("q", [expert_ids[i] for i in part])
        _kernels.nibble_moe(
            x.data_ptr(), x.shape[0], ids.data_ptr(), weights.data_ptr(), ids.shape[1],
            part_ids.buffer_info()[0], len(part), mats.buffer_info()[0], layout,
            limit is not None, float(limit or 0.0), out.data_ptr(), kernel_threads(), decode_rows(x),
            runs.buffer_info()[0] if runs else 0, len(runs),
        )  # fmt: skip
