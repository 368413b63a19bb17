"""A decode step through every layer in one C call (engine/csrc/decode_step.c), for int8-activation models
whose routed experts are all resident.

Once the experts fit in RAM, a decode step of the module path spent about a third of its time in Python
between the kernels (module calls, routing glue, the store's acquire and release, prefetch guesses and
read-ahead requests; docs/benchmarks.md, "One call per decode step"). Where every layer's weights are in
the forms the C steps read and the expert source holds every expert for good (``LocalExperts.resident``),
the step is one call instead: per layer the fused MLA steps, the FFN norm, the router, the routed and
shared experts and the residuals, the same kernels in the same order as the module path, so the same
bits. The experts it used are then counted as the acquires it skipped would have (``count_resident``).

Taken when: int8 activations, one-sequence caches (any number of rows: several requests, or a verify
step's rows on one cache; the FFN runs over all rows, each expert of their union once), every layer's
attention fused (``FusedMLA``) without a DSA indexer, every FFN a coded MLP or a
score-routed MoE whose router runs in C and whose shared expert is coded, and a local expert source whose
every MoE layer is resident. Anything else keeps the module path.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from engine import decode_ops
from engine.cache import KVCache
from engine.experts import Expert, LocalExperts
from engine.layers import MLP, RMSNorm
from engine.mla_decode import FusedMLA
from engine.moe import Gate, HashGate, MoE
from engine.q8 import ISA_BEST, c_matrix_of
from engine.q8_experts import expert_table
from engine.rows import kernel_threads

try:
    from engine import _kernels
except ImportError:  # pragma: no cover - machines without a compiler
    _kernels = None  # type: ignore[assignment]  # no C extension built: callers check for None first

Matrix = tuple[int, int, int, int, int, int]  # a C matrix (engine/q8.py c_matrix_of)
MLPSpec = tuple[Matrix, Matrix, Matrix, int]  # w1, w3, w2, inter


_off: ContextVar[bool] = ContextVar("fused_decode_off", default=False)
# reflection: a build of the C extension older than decode_step.c lacks it; checked once
_BUILT = _kernels is not None and hasattr(_kernels, "decode_layers")


@contextmanager
def module_path() -> Iterator[None]:
    """Inside, decode steps keep the module path (the comparison of tests and benchmarks): same bits, slower."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


def available() -> bool:
    return _BUILT and decode_ops.available() and not _off.get()


@dataclass(frozen=True)
class LayerParts:
    """What one layer's C step reads: its fused attention, FFN norm and FFN."""

    attention: FusedMLA
    ffn_norm: RMSNorm
    ffn: MoE | MLP


def _mlp_spec(mlp: MLP) -> MLPSpec | None:
    """A SwiGLU MLP as layer_plan takes it; None when its weights are not all coded (or it is clamped)."""
    w1, w3, w2 = (c_matrix_of(m) for m in (mlp.w1, mlp.w3, mlp.w2))
    if mlp.limit is not None or w1 is None or w3 is None or w2 is None:
        return None
    return w1, w3, w2, w2[4]


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
    """The layer described to C (a capsule), or None where its FFN is not in forms the C step reads.
    ``layout``: the routed experts' (engine/q8_experts.py expert_table), for a MoE layer."""
    norm, ffn = parts.ffn_norm, parts.ffn
    if norm.weight.dtype != torch.float32 or not norm.weight.is_contiguous():
        return None
    head = (parts.attention.weights, norm.weight.data_ptr(), norm.eps)
    if not isinstance(ffn, MoE):  # a dense layer: its MLP
        mlp = _mlp_spec(ffn)
        return None if mlp is None else _kernels.layer_plan(*head, mlp, None, None)
    router = _router_spec(ffn.gate)
    shared = None if ffn.shared_experts is None else _mlp_spec(ffn.shared_experts)
    if router is None or layout is None or ffn.limit is not None or (ffn.shared_experts is not None and shared is None):
        return None
    return _kernels.layer_plan(*head, shared, router, layout)


class FusedDecode:
    """A model's layers described to C once, with the expert tables of the source they were built for."""

    def __init__(self, parts: Sequence[LayerParts]):
        self.parts = parts  # keeps every array the plans point to alive
        self.moe_layers = [i for i, p in enumerate(parts) if isinstance(p.ffn, MoE)]
        self.topk = max([p.ffn.gate.topk for p in parts if isinstance(p.ffn, MoE)], default=1)
        self._sources: list[Sequence[Expert]] = []  # what resident() gave, by MoE layer: the tables' origin
        self._tables: list[array[int]] = []  # the C tables derived from them (kept alive: C reads them)
        self._plans: tuple[_kernels.LayerPlanCapsule, ...] | None = None
        self._table_addresses = [0] * len(parts)  # per layer: its expert table's, 0 on a dense layer

    def ready_for(self, experts: LocalExperts) -> bool:
        """Whether every MoE layer's experts are resident in ``experts`` and the plans are built for them;
        rebuilt when the source gives other experts than last time. False: the module path."""
        sources = []
        for layer in self.moe_layers:
            source = experts.resident(layer)
            if source is None:
                return False
            sources.append(source)
        if self._plans is not None and all(a is b for a, b in zip(sources, self._sources, strict=True)):
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
        for part in self.parts:
            plan = layer_plan(part, layout)
            if plan is None:
                return False
            plans.append(plan)
        self._sources, self._tables, self._plans = sources, tables, tuple(plans)
        for layer, table in zip(self.moe_layers, tables, strict=True):
            self._table_addresses[layer] = table.buffer_info()[0]
        return True

    def step(
        self, x: torch.Tensor, starts: list[int], ropes: list[tuple[torch.Tensor, torch.Tensor]],
        caches: list[KVCache], experts: LocalExperts,
    ) -> torch.Tensor:  # fmt: skip
        """Rows x [B, dim] (their tokens' embeddings), row b at position starts[b] of caches[b] (rows of one
        sequence at consecutive positions, a verify step) -> the hidden states [B, dim] after the last layer;
        each position is appended to its cache (``ready_for`` must hold)."""
        appended: dict[int, tuple[KVCache, int]] = {}  # id(cache) -> (cache, its length before this step)
        try:
            for cache, start in zip(caches, starts, strict=True):
                if cache.length != start:
                    raise ValueError(f"cache holds {cache.length} positions but start_pos is {start}")
                appended.setdefault(id(cache), (cache, start))
                for layer in cache.layers:
                    layer.next_row()
            return self._run(x, starts, ropes, caches, experts)
        except BaseException:
            for cache, length in appended.values():
                cache.trim(length)
            raise

    def _run(
        self, x: torch.Tensor, starts: list[int], ropes: list[tuple[torch.Tensor, torch.Tensor]],
        caches: list[KVCache], experts: LocalExperts,
    ) -> torch.Tensor:  # fmt: skip
        rows = len(starts)
        x = x.clone(memory_format=torch.contiguous_format)  # written in place by the C step
        cos = torch.cat([cos for cos, _ in ropes])  # [B, rope / 2]
        sin = torch.cat([sin for _, sin in ropes])
        steps = array("Q", [
            value
            for i, table in enumerate(self._table_addresses)
            for cache, start in zip(caches, starts, strict=True)
            for value in (table, cache.layers[i].latent.data_ptr(), cache.layers[i].rope_key.data_ptr(), start + 1)
        ])  # fmt: skip
        width = rows * self.topk  # room for a layer's union of experts
        ids = torch.empty((len(self.parts), width), dtype=torch.int64)
        assert self._plans is not None  # ready_for held
        _kernels.decode_layers(
            self._plans, steps.buffer_info()[0], rows, x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            ids.data_ptr(), width, ISA_BEST, kernel_threads(),
        )  # fmt: skip
        chosen = ids.tolist()
        experts.count_resident({layer: [e for e in chosen[layer] if e >= 0] for layer in self.moe_layers})
        return x


def caches_taken(caches: Sequence[KVCache]) -> bool:
    """Whether the C step writes these rows' caches: each one sequence's, float32, contiguous, without DSA
    indexer keys (rows may share one: a verify step)."""
    return all(
        layer.latent.dtype == torch.float32
        and layer.latent.shape[0] == 1
        and layer.index_key is None
        and layer.latent.is_contiguous()
        and layer.rope_key.is_contiguous()
        for cache in caches
        for layer in cache.layers
    )
