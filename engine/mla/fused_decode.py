"""A decode step through every layer in one C call (engine/csrc/decode_step.c) when every routed expert is
resident: with experts in RAM the module path spent much of a step in Python between kernels
(docs/benchmarks-log.md, "One call per decode step"). The same kernels in the same order, so the same bits.

Taken when decode_ops' C ops apply, caches are one-sequence float32 (any number of rows), every layer's
attention is fused and its FFN in forms the C step reads, and the source's ``ResidentSet`` holds every MoE
layer. Anything else keeps the module path.

DSA models: the C step returns at a layer with its own indexer once every row's projections are done; the
indexer runs here, each row's selection goes into that layer and the "shared" layers after it, and C resumes.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

import torch

from engine.core.cache import LayerCache
from engine.core.layers import MLP, RMSNorm
from engine.core.moe import Gate, HashGate, MoE
from engine.core.sources import Expert, Experts, ResidentSet
from engine.kernels import decode_ops
from engine.kernels.modes import activations_are_int8
from engine.kernels.native import BUILT, _kernels
from engine.kernels.nibble_experts import expert_table as float_expert_table
from engine.kernels.q8 import ISA_BEST, CMatrix, c_computes_as_modules, c_matrix_of
from engine.kernels.q8_experts import expert_table as int8_expert_table
from engine.kernels.rows import kernel_threads
from engine.mla.decode import FusedMLA

MLPSpec = tuple[CMatrix, CMatrix, CMatrix, int]  # w1, w3, w2, inter
Carry = tuple[int, int, int, int, int, int, int, int]  # decode_layers' carry: 4 addresses, their row strides


STEP = 6  # uint64 per layer and row: table, latents, rope keys, total, DSA positions, count

_off: ContextVar[bool] = ContextVar("fused_decode_off", default=False)


@contextmanager
def module_path() -> Iterator[None]:
    """Inside, decode steps keep the module path (for comparisons): same bits, slower."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


def available() -> bool:
    return BUILT and decode_ops.available() and not _off.get()


@dataclass(frozen=True)
class LayerParts:
    """What one layer's C step reads: its fused attention, FFN norm and FFN."""

    attention: FusedMLA
    ffn_norm: RMSNorm
    ffn: MoE | MLP


def _mlp_spec(mlp: MLP) -> MLPSpec | None:
    """A SwiGLU MLP as layer_plan takes it; None if clamped or the C step would not compute it as the module does."""
    w1, w3, w2 = (c_matrix_of(m) for m in (mlp.w1, mlp.w3, mlp.w2))
    if mlp.limit is not None or w1 is None or w3 is None or w2 is None or not c_computes_as_modules((w1, w3, w2)):
        return None
    return w1, w3, w2, w2[4]


def expert_table(experts: Sequence[object]) -> tuple[tuple[int, ...], array[int]] | None:
    """A layer's experts for decode_step.c: (layout (family, inter, kind13, kind2, scale kind, group13, group2,
    interleaved), six addresses each, flat); family 0: q8_moe (int8 activations), 1: nibble_moe. None: not all alike."""
    family = 0 if activations_are_int8() else 1
    described = (int8_expert_table if family == 0 else float_expert_table)(experts)
    return None if described is None else ((family, *described[0]), described[1])


def _router_spec(gate: Gate) -> tuple[int, int, int, int, int, int, int, bool, float, int] | None:
    routes = decode_ops.routes(gate.score_name, gate.weight, gate.n_groups, gate.topk_groups)
    if isinstance(gate, HashGate) or not routes or gate.bias.dtype != torch.float32:
        return None
    kind = decode_ops.SCORE_KINDS[gate.score_name]
    return (
        gate.weight.data_ptr(), gate.bias.data_ptr(), gate.weight.shape[0], kind, gate.n_groups,
        gate.topk_groups, gate.topk, gate.norm_topk_prob, gate.route_scale, gate.weight.stride(0),
    )  # fmt: skip


def layer_plan(parts: LayerParts, layout: tuple[int, ...] | None) -> _kernels.LayerPlanCapsule | None:
    """The layer described to C, or None where the C step would not compute it as the module path does.
    ``layout``: the routed experts' (expert_table)."""
    norm, ffn = parts.ffn_norm, parts.ffn
    if norm.weight.dtype != torch.float32 or not norm.weight.is_contiguous():
        return None
    if not parts.attention.computes_as_modules():
        return None
    head = (parts.attention.weights, norm.weight.data_ptr(), norm.eps)
    stops = parts.attention.mla.indexer is not None
    if not isinstance(ffn, MoE):  # a dense layer: its MLP
        mlp = _mlp_spec(ffn)
        return None if mlp is None else _kernels.layer_plan(*head, mlp, None, None, stops)
    router = _router_spec(ffn.gate)
    shared = None if ffn.shared_experts is None else _mlp_spec(ffn.shared_experts)
    if router is None or layout is None or ffn.limit is not None or (ffn.shared_experts is not None and shared is None):
        return None
    return _kernels.layer_plan(*head, shared, router, layout, stops)


class FusedDecode:
    """Layers (a model's, or an MTP block) described to C once, with their source's expert tables."""

    def __init__(self, parts: Sequence[LayerParts], layer_ids: Sequence[int]):
        self.parts = parts  # keeps every array the plans point to alive
        self.layer_ids = list(layer_ids)
        self.moe_parts = [i for i, p in enumerate(parts) if isinstance(p.ffn, MoE)]
        self.topk = max([p.ffn.gate.topk for p in parts if isinstance(p.ffn, MoE)], default=1)
        self._sources: list[Sequence[Expert]] = []  # what resident() gave, by MoE part
        self._int8 = False  # plans for int8 activations, else float32
        self._tables: list[array[int]] = []  # kept alive: C reads them
        self._plans: tuple[_kernels.LayerPlanCapsule, ...] | None = None
        self._counter: ResidentSet | None = None  # counts a step's experts
        self._table_addresses = [0] * len(parts)  # 0 on a dense layer
        # per row, what attention carries across a DSA stop (DecodeCarry): the widest layer's
        attention = [p.attention for p in parts]
        self._widths = (
            max(a.normed.numel() for a in attention),
            max(a.q_latent.numel() for a in attention),
            max(a.q_nope.numel() for a in attention),
            max(a.q_rope.numel() for a in attention),
        )
        self._carry_rows = 0
        self.normed = self.q_latent = self.q_nope = self.q_rope = torch.empty(0)

    def _carry(self, rows: int) -> Carry:
        """The carry's addresses and row strides for ``rows`` rows (grown when a step has more)."""
        if rows > self._carry_rows:
            self.normed, self.q_latent, self.q_nope, self.q_rope = (torch.empty(rows, w) for w in self._widths)
            self._carry_rows = rows
        addresses = (self.normed.data_ptr(), self.q_latent.data_ptr(), self.q_nope.data_ptr(), self.q_rope.data_ptr())
        return addresses + self._widths

    def ready_for(self, experts: ResidentSet) -> bool:
        """Whether every MoE layer's experts are resident and the plans built for them (rebuilt when the
        source gives other experts). False: the module path."""
        sources = []
        for part in self.moe_parts:
            source = experts.resident(self.layer_ids[part])
            if source is None:
                return False
            sources.append(source)
        built = self._plans is not None and self._int8 == activations_are_int8()
        self._counter = experts
        if built and all(a is b for a, b in zip(sources, self._sources, strict=True)):
            return True
        self._plans = None
        layouts, tables = set(), []
        for source in sources:
            described = expert_table(source)
            if described is None:
                return False
            layouts.add(described[0])
            tables.append(described[1])
        if len(layouts) > 1:
            return False
        layout = layouts.pop() if layouts else None
        plans = []
        for parts in self.parts:
            plan = layer_plan(parts, layout)
            if plan is None:
                return False
            plans.append(plan)
        self._sources, self._tables, self._plans = sources, tables, tuple(plans)
        self._int8 = activations_are_int8()
        for part, table in zip(self.moe_parts, tables, strict=True):
            self._table_addresses[part] = table.buffer_info()[0]
        return True

    def step(
        self, x: torch.Tensor, starts: list[int], ropes: list[tuple[torch.Tensor, torch.Tensor]],
        caches: Sequence[Sequence[LayerCache]],
    ) -> torch.Tensor:  # fmt: skip
        """Embeddings x [B, dim], row b at starts[b] of caches[b] (a verify step's rows share one list) -> hidden
        [B, dim] after the last layer, positions appended (``ready_for`` must hold)."""
        appended: dict[int, tuple[Sequence[LayerCache], int]] = {}  # id(caches[b]) -> (them, length before)
        try:
            for layers, start in zip(caches, starts, strict=True):
                if layers[0].length != start:
                    raise ValueError(f"cache holds {layers[0].length} positions but start_pos is {start}")
                appended.setdefault(id(layers), (layers, start))
                for layer in layers:
                    layer.next_row()
            return self._run(x, starts, ropes, caches)
        except BaseException:
            for layers, length in appended.values():
                for layer in layers:
                    layer.trim(length)
            raise

    def _run(
        self, x: torch.Tensor, starts: list[int], ropes: list[tuple[torch.Tensor, torch.Tensor]],
        caches: Sequence[Sequence[LayerCache]],
    ) -> torch.Tensor:  # fmt: skip
        rows = len(starts)
        x = x.clone(memory_format=torch.contiguous_format)  # written in place by the C step
        cos = torch.cat([cos for cos, _ in ropes])  # [B, rope / 2]
        sin = torch.cat([sin for _, sin in ropes])
        steps = array("Q", [
            value
            for i, table in enumerate(self._table_addresses)
            for layers, start in zip(caches, starts, strict=True)
            for value in (table, layers[i].latent.data_ptr(), layers[i].rope_key.data_ptr(), start + 1)
            + (0, 0)  # DSA's chosen positions and count: set by _share
        ])  # fmt: skip
        width = rows * self.topk  # room for a layer's union of experts
        ids = torch.empty((len(self.parts), width), dtype=torch.int64)
        assert self._plans is not None  # ready_for held
        selections: list[torch.Tensor] = []  # kept alive while C reads them
        carry = self._carry(rows)
        at: int | None = 0
        projected = False
        while at is not None:
            at = _kernels.decode_layers(
                self._plans, steps.buffer_info()[0], rows, x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                ids.data_ptr(), width, carry, (at, projected), ISA_BEST, kernel_threads(),
            )  # fmt: skip
            if at is not None:  # a DSA layer stopped: its indexer, then resume
                for row, selection in enumerate(self._select(at, starts, (cos, sin), caches)):
                    if selection is not None:
                        selections.append(selection)
                        self._share(steps, at, row, rows, selection)
                projected = True
        chosen = ids.tolist()
        assert self._counter is not None  # ready_for held
        self._counter.count_resident({self.layer_ids[i]: [e for e in chosen[i] if e >= 0] for i in self.moe_parts})
        return x

    def _select(
        self, layer: int, starts: list[int], angles: tuple[torch.Tensor, torch.Tensor],
        caches: Sequence[Sequence[LayerCache]],
    ) -> list[torch.Tensor | None]:  # fmt: skip
        """``layer``'s indexer for every row (projections in the carry) -> each row's chosen positions (int64 [K])
        or None (all). Keys and queries of all rows in one pass (each position alone: each row's bits), then
        per row its key appended and its choice."""
        attention = self.parts[layer].attention
        indexer = attention.mla.indexer
        assert indexer is not None  # only such layers stop
        rows, dim, q_rank = len(starts), attention.normed.numel(), attention.mla.q_lora_rank
        normed = self.normed[None, :rows, :dim]  # [1, rows, dim]
        keys = indexer.keys(normed, *angles)[0].float()  # [rows, D]
        choosing = [indexer.chooses(start + 1) for start in starts]  # a row sees its own key and those before
        if any(choosing):  # DSA models have a q LoRA (wq_b reads it)
            q, weights = (part[0] for part in indexer.queries(normed, self.q_latent[None, :rows, :q_rank], angles))
        chosen: list[torch.Tensor | None] = []
        for row, (start, layers) in enumerate(zip(starts, caches, strict=True)):
            with layers[layer].as_seen_at(start):  # the step counted all its rows at the start
                cached = layers[layer].append_index_key(keys[None, row : row + 1])  # [1, start + 1, D]
                if not choosing[row]:
                    chosen.append(None)
                    continue
                selection = indexer.choose(q[None, row : row + 1], weights[None, row : row + 1], cached, start)
            chosen.append(selection.reshape(-1).to(torch.int64).contiguous())
        return chosen

    def _share(self, steps: array[int], layer: int, row: int, rows: int, selection: torch.Tensor) -> None:
        """The row attends to ``selection`` at ``layer`` and the "shared" layers up to the next indexer."""
        for i in range(layer, len(self.parts)):
            if i > layer and self.parts[i].attention.mla.indexer is not None:
                break
            at = (i * rows + row) * STEP
            steps[at + 4], steps[at + 5] = selection.data_ptr(), selection.numel()


def caches_taken(caches: Sequence[Sequence[LayerCache]]) -> bool:
    """Whether the C step writes these caches: one sequence each, float32, contiguous (rows may share them)."""
    return all(
        layer.latent.dtype == torch.float32
        and layer.latent.shape[0] == 1
        and layer.latent.is_contiguous()
        and layer.rope_key.is_contiguous()
        for layers in caches
        for layer in layers
    )


class OneCall:
    """Where blocks' decode steps may run as one C call: ``parts_for(x, layers)`` describes them (None: not in
    C forms), built the first time a step could take it."""

    def __init__(
        self,
        parts_for: Callable[[torch.Tensor, Sequence[LayerCache]], list[LayerParts] | None],
        layer_ids: Sequence[int],
    ):
        self.parts_for, self.layer_ids = parts_for, layer_ids
        self._built: FusedDecode | Literal[False] | None = None  # None: not built yet, False: n/a

    def forget(self) -> None:
        """The blocks' tensors changed (.to(), .float(), ...): describe them again."""
        self._built = None

    def applies(self, x: torch.Tensor, caches: Sequence[Sequence[LayerCache]], experts: Experts) -> FusedDecode | None:
        """The C step for rows x [B, 1, dim] on these caches with these experts, or None: the module path."""
        if not (decode_ops.small_ops_take(x) and available()):
            return None
        resident = experts.offers().resident  # None: experts may move, or are remote
        if resident is None or not caches_taken(caches):
            return None
        if self._built is None:
            parts = self.parts_for(x, caches[0])
            self._built = False if parts is None else FusedDecode(parts, self.layer_ids)
        if self._built is False or not self._built.ready_for(resident):
            return None
        return self._built
