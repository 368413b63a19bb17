"""The router (Gate) and the MoE layer, whose routed experts come from an expert source."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.args import ModelArgs
from engine.core.layers import MLP, stable_topk_indices
from engine.core.sources import Expert, Experts, ExpertSource, is_remote
from engine.kernels import decode_ops
from engine.kernels.nibble_experts import add_nibble_experts, in_one_call, takes_rows
from engine.kernels.q8_experts import add_experts, fused_experts_handle
from engine.kernels.rows import linear, one_segment, per_row, row_segments, rows_in_segments

T = TypeVar("T")


# Prefetch guesses only for decode-sized steps: a prompt's rows route to nearly every expert anyway.
GUESS_MAX_NEW_POSITIONS = 4


SCORES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: logits.softmax(dim=-1),
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),  # DeepSeek-V4
}


class Gate(nn.Module):
    """Router with DeepSeek's auxiliary-loss-free correction bias and group-limited top-k.

    The bias steers *which* experts are chosen, never their weights (those come from the unbiased
    scores). Groups rank by the sum of their two best biased scores; only the best ``n_limited_groups``
    may be chosen from.
    """

    by_score = True  # chosen by score (not HashGate's table): decode_ops.route may choose

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.score_name = args.v4.scoring_func if args.v4 else "sigmoid"
        self.score = SCORES[self.score_name]
        self.topk = args.n_activated_experts
        self.n_groups = args.n_expert_groups
        self.topk_groups = args.n_limited_groups
        self.norm_topk_prob = args.norm_topk_prob
        self.route_scale = args.route_scale
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        self.bias = nn.Parameter(torch.zeros(args.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, dim] -> (weights [N, topk] float32, expert ids [N, topk]). ``tokens`` [N]: hash routing only."""
        if self._routes_in_c(x):
            return self._route_in_c(x)
        scores, ids = self._scores_and_ids(x, tokens)
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, ids

    def route(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, dim] -> expert ids [N, topk], without weights (a prefetch guess)."""
        if self._routes_in_c(x):
            return self._route_in_c(x)[1]
        return self._scores_and_ids(x, tokens)[1]

    def _routes_in_c(self, x: torch.Tensor) -> bool:
        return (
            self.by_score
            and decode_ops.small_ops_take(x)
            and self.bias.dtype == torch.float32
            and decode_ops.routes(self.score_name, self.weight, self.n_groups, self.topk_groups)
        )

    def _route_in_c(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_ops.route(
            x, self.weight, self.bias, self.score_name, self.n_groups, self.topk_groups,
            self.topk, self.norm_topk_prob, self.route_scale,
        )  # fmt: skip

    def _scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, dim] -> unbiased scores [N, n_routed] float32."""
        return per_row(self.score, linear(x.float(), self.weight.float()))

    def _scores_and_ids(self, x: torch.Tensor, tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self._scores(x)
        biased = scores + self.bias.float()
        if self.n_groups > 1:
            biased = self._mask_unchosen_groups(biased)
        return scores, stable_topk_indices(biased, self.topk)

    def _mask_unchosen_groups(self, biased: torch.Tensor) -> torch.Tensor:
        grouped = biased.view(biased.shape[0], self.n_groups, -1)  # [N, groups, experts per group]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, groups]
        chosen = stable_topk_indices(group_scores, self.topk_groups)
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, chosen, False)
        return grouped.masked_fill(dropped[..., None], float("-inf")).flatten(1)


class HashGate(Gate):
    """DeepSeek-V4's first layers: the token id picks the experts (``tid2eid`` [vocab, topk]), the scores
    weight them; prefetch is exact."""

    by_score = False
    tid2eid: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        del self.bias
        self.register_buffer("tid2eid", torch.zeros(args.vocab_size, args.n_activated_experts, dtype=torch.long))

    def _scores_and_ids(self, x: torch.Tensor, tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if tokens is None:
            raise ValueError("a hash-routed MoE layer needs the token ids")
        return self._scores(x), self.route(x, tokens)

    def route(self, x: torch.Tensor | None, tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self.tid2eid[tokens.reshape(-1)]  # type: ignore[union-attr]  # a hash gate is given the ids


class MoE(nn.Module):
    """Routed experts (from the expert source, per call) plus always-on shared experts."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        hashed = args.v4 is not None and args.v4.hash_layers[layer_id]
        self.gate = HashGate(args) if hashed else Gate(args)
        self.limit = args.v4.swiglu_limit if args.v4 else None
        self.shared_experts = (
            MLP(args.dim, args.n_shared_experts * args.moe_inter_dim, self.limit) if args.n_shared_experts else None
        )

    @property
    def hashed(self) -> bool:
        return isinstance(self.gate, HashGate)

    def predict(self, x: torch.Tensor | None, tokens: torch.Tensor | None = None) -> list[int]:
        """The experts the router would pick for normalised x [B, S, dim] (a prefetch guess); x is None
        only on a hash-routed layer, where ``tokens`` [B, S] make it exact."""
        rows = self.gate.route(None if x is None else x.reshape(-1, x.shape[-1]), tokens).tolist()  # type: ignore[arg-type]
        return sorted({expert for row in rows for expert in row})

    def forward(self, x: torch.Tensor, experts: Experts, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, dim] -> [B, S, dim]; the shared expert runs while the routed experts load (or a remote
        source computes their sum). ``tokens`` [B, S]: for hash-routed layers."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x, tokens)
        if is_remote(experts):
            remote = experts.routed_sum()
            pending = remote.start_routed_sum(self.layer_id, x, weights, ids)  # workers compute...
            shared = self._shared(x)  # ...meanwhile
            routed = pending()
        else:
            routed, shared = routed_sum(x, weights, ids, experts, self.layer_id, self.limit, lambda: self._shared(x))
        return (routed.to(x.dtype) + shared).view(shape)

    def forward_window(self, xs: list[torch.Tensor], experts: Experts) -> list[torch.Tensor]:
        """Prompt chunks x_i [B, S_i, dim] -> outputs, each bit-equal to ``forward`` alone, with each expert
        acquired once for all chunks. Score-routed layers only (hash routing needs each chunk's tokens)."""
        if is_remote(experts) or len(xs) == 1:
            return [self.forward(x, experts) for x in xs]
        sizes = [x.numel() // x.shape[-1] for x in xs]
        with rows_in_segments(sizes):
            out = self.forward_segments(torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]), experts)
        return [part.view(x.shape) for part, x in zip(out.split(sizes), xs, strict=True)]

    def forward_segments(self, x: torch.Tensor, experts: ExpertSource) -> torch.Tensor:
        """Inside rows_in_segments(): x [N, dim], several segments' rows -> [N, dim], each segment bit-equal to
        ``forward`` alone; router, shared expert and each expert's read run once over all. Score-routed only."""
        sizes = row_segments(x.shape[0]) or (x.shape[0],)
        weights, ids = self.gate(x)
        routed = RoutedSum(x, weights, ids, self.limit, sizes)

        def shared() -> torch.Tensor:  # while the first experts load
            with rows_in_segments(sizes):
                return self._shared(x)

        with one_segment():  # RoutedSum splits its products by segment itself
            side = add_routed([routed], experts, self.layer_id, shared)
        return routed.total().to(x.dtype) + side

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)


def routed_sum(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: ExpertSource,
    layer: int,
    limit: float | None = None,
    meanwhile: Callable[[], T] = lambda: None,  # type: ignore[assignment,return-value]  # T is None when not given
    owned: Callable[[int], bool] | None = None,
) -> tuple[torch.Tensor, T]:
    """x [N, dim], weights [N, topk] float32, ids [N, topk] -> (float64 routed sum [N, dim], ``meanwhile()``).

    Each distinct expert is acquired once for all rows, in chunks of ``max_acquire``; ``meanwhile`` runs
    while the first chunk's misses load. ``owned``: sum only the experts it accepts (a worker's share)."""
    routed = RoutedSum(x, weights, ids, limit)
    side = add_routed([routed], experts, layer, meanwhile, owned)
    return routed.total(), side


def add_routed(
    sums: Sequence[RoutedSum],
    experts: ExpertSource,
    layer: int,
    meanwhile: Callable[[], T] = lambda: None,  # type: ignore[assignment,return-value]  # T is None when not given
    owned: Callable[[int], bool] | None = None,
) -> T:
    """Add each sum's routed experts, each of the union acquired once (see ``routed_sum``) -> ``meanwhile()``."""
    wanted = sorted({e for routed in sums for e in routed.rows_of if owned is None or owned(e)})
    side = None
    for i, chunk in enumerate(chunks(wanted, experts.offers().max_acquire)):
        acquired = experts.acquire(layer, chunk)  # misses start loading...
        try:
            if i == 0:  # ...meanwhile
                side = meanwhile()
            for batch in _in_arrival_order(chunk, acquired.ready):
                for routed in sums:
                    mine = [(expert_id, acquired[expert_id]) for expert_id in batch if expert_id in routed.rows_of]
                    if mine:
                        routed.add_batch(mine)
        finally:
            experts.release(layer, chunk)
    # side is meanwhile()'s: chunks() gives at least one chunk (an empty one when no expert is wanted)
    return cast(T, side)


def _in_arrival_order(expert_ids: list[int], ready: Callable[[int], bool]) -> Iterator[list[int]]:
    """expert_ids in batches: those in memory first, else the lowest still loading alone. The float64 sum
    does not depend on the order (RoutedSum), so this changes speed only."""
    pending = expert_ids
    while pending:
        here = [e for e in pending if ready(e)]
        batch = here or pending[:1]
        yield batch
        done = set(batch)
        pending = [e for e in pending if e not in done]


def _rows_routed_to(ids: torch.Tensor) -> dict[int, tuple[torch.Tensor | None, torch.Tensor | int]]:
    """ids [N, topk] -> expert id -> (rows, slots) routed to it; one row (decode): (None, int slot), no search."""
    if ids.shape[0] == 1:
        return {expert: (None, slot) for slot, expert in enumerate(ids[0].tolist())}
    # torch.where(condition) of a 2-D ids is (rows, slots)
    return {expert: torch.where(ids == expert) for expert in ids.unique().tolist()}  # type: ignore[misc]


# Rows of x routed to an expert and their top-k places: (rows, slots), or (None, slot) for one row (a decode step)
_Routing = tuple[torch.Tensor | None, torch.Tensor | int]


def _rows_per_segment(ids: torch.Tensor, segments: Sequence[int]) -> list[list[int]]:
    """ids [N, topk] of N rows in runs of ``segments`` -> [expert id][segment]: rows routed to it there."""
    n = len(segments)
    segment_of = torch.repeat_interleave(torch.arange(n, device=ids.device), torch.tensor(segments, device=ids.device))
    width = int(ids.max()) + 1
    counts = torch.bincount((segment_of[:, None] * width + ids).flatten(), minlength=n * width)
    return counts.view(n, width).t().tolist()


def _count(rows: torch.Tensor | None) -> int:
    """Rows in a routing's rows (None: the one row of a decode step)."""
    return 1 if rows is None else rows.numel()


def chunks(expert_ids: list[int], size: int | None) -> list[list[int]]:
    """expert_ids in consecutive chunks of at most ``size`` (None: no limit, one chunk)."""
    if size is not None and size < 1:
        raise ValueError(f"an expert source must pin at least one expert at once, not {size}")
    if size is None or size >= len(expert_ids):
        return [expert_ids]
    return [expert_ids[start : start + size] for start in range(0, len(expert_ids), size)]


class RoutedSum:
    """sum over experts e of gate weight * e(x[rows]), kept on each expert's device until the end.

    float32 terms, float64 sum: adding up to top-k float32 terms in float64 is exact unless one is 2^26
    times smaller than another in the same element, so the float32 result does not depend on the order
    (worker shares, devices, partial sums in any order give the same bits).

    An expert computes where its weights are; x and the weights go to its device once per layer, and each
    device's partial sum comes back once at ``total()``: a transfer per expert would stall the CPU on every
    GPU matmul.
    """

    def __init__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        limit: float | None = None,
        segments: Sequence[int] = (),
    ):
        self.home = x.device
        self.limit = limit  # V4's swiglu clamp
        self.ids = ids  # [N, topk]
        self.rows_of = _rows_routed_to(ids)
        # x's rows in runs (prompt chunks): each chunk's terms as its own sum computes them; (): one run
        self.segments = tuple(segments) if len(segments) > 1 else ()
        self._per_segment = _rows_per_segment(ids, self.segments) if self.segments else None
        self._inputs = {x.device: (x, weights)}  # device -> (x [N, dim], weights [N, topk]) there
        self._sums: dict[torch.device, torch.Tensor] = {}

    def add_batch(self, batch: Sequence[tuple[int, Expert]]) -> None:
        """Add (id, expert) pairs: all in one C call where they all take it (int8 activations); else the 4-bit
        CPU experts with few enough rows in one C call whatever the others are (so an expert's term does
        not depend on them), the rest one by one. Each segment's rows go where its own sum sends them."""
        experts = [expert for _, expert in batch]
        x, weights = self._inputs[self.home]
        if fused_experts_handle(experts, x):
            add_experts(self._sum_on(self.home), x, self.ids, weights, [i for i, _ in batch], experts, self.limit)
            return
        in_c = dict(in_one_call(batch, x, self.rows_routed))
        outside = {i: self._outside_call(i, i in in_c, x) for i, _ in batch}
        if in_c:  # an expert's segments with more rows than the call takes are left out of it (ids -1)
            over = [part for i in in_c for part in outside[i]]
            ids = self._without(over) if over else self.ids
            quantized = list(in_c.values())
            add_nibble_experts(
                self._sum_on(self.home), x, ids, weights, list(in_c), quantized, self.limit, self.segments
            )
        for expert_id, expert in batch:
            for rows, slot in outside[expert_id]:
                self.add(expert, rows, slot)

    def rows_routed(self, expert_id: int) -> int:
        """Rows of x routed to the expert (with segments: the fewest in any segment that has some, so the C
        call takes it where some segment's own sum would)."""
        if self._per_segment is None:
            return _count(self.rows_of[expert_id][0])
        return min(n for n in self._per_segment[expert_id] if n)

    def _outside_call(self, expert_id: int, in_call: bool, x: torch.Tensor) -> list[_Routing]:
        """The expert's (rows, slots) left to ``add``: all if not in the C call, else its segments too big for it."""
        if not in_call:
            return self._parts_of(expert_id)
        if self._per_segment is None or all(takes_rows(x, n) for n in self._per_segment[expert_id]):
            return []
        return [part for part in self._parts_of(expert_id) if not takes_rows(x, _count(part[0]))]

    def _parts_of(self, expert_id: int) -> list[_Routing]:
        """The (rows, slots) routed to an expert, one part per non-empty segment, or the whole."""
        rows, slot = self.rows_of[expert_id]
        if self._per_segment is None or rows is None:
            return [(rows, slot)]
        sizes = self._per_segment[expert_id]
        slots = cast(torch.Tensor, slot).split(sizes)  # a tensor wherever rows is (_rows_routed_to)
        return [(r, s) for r, s, n in zip(rows.split(sizes), slots, sizes, strict=True) if n]

    def _without(self, parts: list[_Routing]) -> torch.Tensor:
        """ids with the listed routings (rows, slots) taken out (-1: routed to no expert)."""
        ids = self.ids.clone()
        for rows, slot in parts:
            if rows is None:
                ids[0, slot] = -1
            else:
                ids[rows, slot] = -1
        return ids

    def _sum_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._sums:
            x = self._inputs[device][0]
            self._sums[device] = torch.zeros(x.shape, dtype=torch.float64, device=device)
        return self._sums[device]

    def add(self, expert: Expert, rows: torch.Tensor | None, slot: torch.Tensor | int) -> None:
        """rows/slot: rows of x routed to ``expert`` and their top-k places; (None, int) when x is one row."""
        device = expert.device
        # non_blocking: a blocking host-to-device copy waits for the GPU's queued work (every earlier expert)
        if device not in self._inputs:
            x, weights = self._inputs[self.home]
            self._inputs[device] = (x.to(device, non_blocking=True), weights.to(device, non_blocking=True))
        x, weights = self._inputs[device]
        total = self._sum_on(device)
        if rows is None:  # one row: the same products and the same additions, in place
            total.add_((self._apply(expert, x).float() * weights[:, slot, None]).double())
            return
        # slot is a tensor whenever rows is (_rows_routed_to)
        rows, slot = rows.to(device, non_blocking=True), slot.to(device, non_blocking=True)  # type: ignore[union-attr]
        term = self._apply(expert, x[rows]).float() * weights[rows, slot, None]
        total.index_add_(0, rows, term.double())

    def _apply(self, expert: Expert, x: torch.Tensor) -> torch.Tensor:
        return expert(x) if self.limit is None else expert(x, limit=self.limit)

    def total(self) -> torch.Tensor:
        """[N, dim] float64 on the activations' device."""
        x = self._inputs[self.home][0]
        total = self._sums.pop(self.home, None)
        if total is None:
            total = torch.zeros(x.shape, dtype=torch.float64, device=self.home)
        for partial in self._sums.values():
            total += partial.to(self.home)
        return total
