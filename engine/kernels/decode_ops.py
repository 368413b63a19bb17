"""The small float ops of a decode step in C (engine/csrc/decode_ops.c): RMSNorm, the MoE router, and
absorbed MLA attention for one query; and the DSA indexer's choice (engine/csrc/index_select.c).

A decode step's ~100 small torch ops per layer cost as much as its expert matmuls (docs/benchmarks-log.md,
"Figures behind the code"); here each is one call. C sums in another order than torch, so results differ by
float rounding: the float32 path takes them for decode rows only, so a prompt's rows keep torch's bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from engine.kernels.modes import activations_are_int8
from engine.kernels.native import BUILT, _kernels
from engine.kernels.rows import computing_alone, kernel_threads

SCORE_KINDS = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}  # decode_ops.h SCORE_*
MAX_GROUPS = 256  # decode_ops.c keeps a row's group scores on the stack

_off: ContextVar[bool] = ContextVar("decode_ops_off", default=False)


@contextmanager
def torch_ops() -> Iterator[None]:
    """Inside, the int8 path keeps torch's ops (for tests and benchmarks to compare)."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


def available() -> bool:
    return BUILT


def active(x: torch.Tensor) -> bool:
    """Whether x goes through these ops: int8 activations on, x float32 on the CPU."""
    return activations_are_int8() and not _off.get() and x.dtype == torch.float32 and x.device.type == "cpu" and BUILT


def small_ops_take(x: torch.Tensor, one_row: bool = False) -> bool:
    """Whether the small ops take x here: the int8 path (``active``), or float32 decode rows (one row, or
    rows inside rows_alone(), so a row decoded in a batch keeps its bits). A prompt's rows keep torch's."""
    if active(x):
        return True
    decode_row = one_row or computing_alone() or x.numel() == x.shape[-1]
    return decode_row and not _off.get() and x.dtype == torch.float32 and x.device.type == "cpu" and BUILT


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] float32 -> weight * x / sqrt(mean(x^2) + eps), float32; weight float32 [dim]."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _kernels.rms_norm(x.data_ptr(), x.numel() // dim, dim, weight.data_ptr(), eps, out.data_ptr())
    return out


def routes(score: str, weight: torch.Tensor, groups: int, topk_groups: int) -> bool:
    """Whether ``route`` takes this router: float32 CPU weight [experts, dim] with contiguous rows (padded stride
    fine), groups that split the experts evenly, at least two each."""
    experts = weight.shape[0]
    return (
        score in SCORE_KINDS
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.stride(-1) == 1
        and weight.stride(0) >= weight.shape[1]
        and 1 <= groups <= MAX_GROUPS
        and experts % groups == 0
        and (groups == 1 or (experts // groups >= 2 and 1 <= topk_groups <= groups))
    )


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    score: str,
    groups: int,
    topk_groups: int,
    topk: int,
    normalise: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, dim] -> (weights [N, topk] float32, expert ids [N, topk] int64), as engine/core/moe.py's Gate: the
    top-k of score + bias within the best ``topk_groups`` groups, ids from the best, ties to the lower id;
    weights the unbiased scores of the chosen, normalised over them if asked, times ``scale``."""
    x = x.contiguous()
    rows = x.shape[0]
    ids = torch.empty((rows, topk), dtype=torch.int64)
    weights = torch.empty((rows, topk), dtype=torch.float32)
    bias_ptr = 0 if bias is None else bias.data_ptr()
    _kernels.route(
        x.data_ptr(), rows, weight.data_ptr(), bias_ptr, weight.shape[0], weight.shape[1],
        SCORE_KINDS[score], groups, topk_groups, topk, normalise, scale,
        ids.data_ptr(), weights.data_ptr(), weight.stride(0),
    )  # fmt: skip
    return weights, ids


def attend_one(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latents: torch.Tensor,
    rope_keys: torch.Tensor,
    positions: torch.Tensor | None,
    kv_b: torch.Tensor,
    kv_b_scales: torch.Tensor | None,
    group_size: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Absorbed MLA attention of one query -> [H, v] float32.

    q_nope [H, n], q_rope [H, r] (roped), latents [T, c], rope_keys [T, r] (the cache, valid positions);
    positions int64 [K] the positions attended to (DSA) or None for all T. kv_b [H * (n + v), c]: float32,
    or int8 codes with kv_b_scales float32 [H * (n + v), ceil(c / group_size)]."""
    heads, nope = q_nope.shape
    rank, rope = latents.shape[1], rope_keys.shape[1]
    value = kv_b.shape[0] // heads - nope
    q_nope, q_rope = q_nope.contiguous(), q_rope.contiguous()
    latents, rope_keys = latents.contiguous(), rope_keys.contiguous()
    total = latents.shape[0] if positions is None else positions.numel()
    if positions is not None:
        positions = positions.to(torch.int64).contiguous()
    out = torch.empty((heads, value), dtype=torch.float32)
    _kernels.attend_one(
        q_nope.data_ptr(), q_rope.data_ptr(), latents.data_ptr(), rope_keys.data_ptr(),
        0 if positions is None else positions.data_ptr(), total, heads, nope, rope, value, rank, softmax_scale,
        kv_b.data_ptr(), 0 if kv_b_scales is None else kv_b_scales.data_ptr(), group_size, out.data_ptr(),
        kernel_threads(),
    )  # fmt: skip
    return out


def index_finish_takes(x: torch.Tensor, one_row: bool = False) -> bool:
    """Whether ``index_finish`` takes the indexer's projected rows x: decode rows, as ``small_ops_take``."""
    return BUILT and small_ops_take(x, one_row)


def index_finish(
    x: torch.Tensor, heads: int, norm: nn.LayerNorm | None, rope: int, interleaved: bool,
    cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The DSA indexer's projected rows x [B, S, heads * D] (S positions at angles cos/sin [S, rope / 2]) ->
    [B, S, heads, D] float32: with ``norm`` (the key's LayerNorm, float32) each row normed first; then each
    head's first ``rope`` values rotated as engine/core/rope.py apply_rope, the rest as they are."""
    batch, seqlen = x.shape[0], x.shape[1]
    x = x.contiguous()
    out = torch.empty((batch, seqlen, heads, x.shape[-1] // heads), dtype=torch.float32)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    weight, bias = (0, 0) if norm is None else (norm.weight.data_ptr(), norm.bias.data_ptr())
    eps = 0.0 if norm is None else norm.eps
    _kernels.index_finish(
        x.data_ptr(), batch * seqlen, heads, out.shape[-1], weight, bias, eps, rope, interleaved, cos.data_ptr(),
        sin.data_ptr(), seqlen, out.data_ptr(),
    )  # fmt: skip
    return out


def index_select_takes(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether ``index_select`` takes q [B, S, H, D] over keys [B, T, D]: float32 on the CPU, every row
    (prompt or decode, any batch), so a position's choice is the same everywhere."""
    return (
        BUILT
        and not _off.get()
        and q.dtype == keys.dtype == torch.float32
        and q.device.type == keys.device.type == "cpu"
    )


def index_select(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, start: int, scale: float, topk: int
) -> torch.Tensor:
    """The DSA indexer's choice for query rows at positions start..: q [B, S, H, D] (roped), keys [B, T, D],
    weights [B, S, H] -> int64 [B, S, topk]: per row the topk positions <= its own by
    sum_h weights[h] * relu(scale * q[h] . k[t]), highest first, ties to the lower position; a row that sees
    fewer takes all, then the positions after its own (as a causal mask's -inf gives). topk <= T."""
    batch, rows, heads, dim = q.shape
    q, keys, weights = q.contiguous(), keys.contiguous(), weights.float().contiguous()
    chosen = torch.empty((batch, rows, topk), dtype=torch.int64)
    for b in range(batch):
        _kernels.index_select(
            q[b].data_ptr(), weights[b].data_ptr(), keys[b].data_ptr(), rows, heads, dim, start + 1, topk, scale,
            chosen[b].data_ptr(), kernel_threads(),
        )  # fmt: skip
    return chosen


def index_tile_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_t: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    simd: bool = True,
) -> torch.Tensor:
    """A long prompt's indexer scores without a mask or top-k: q [S, H, D] (roped), weights [S, H], keys_t
    [D, W] (keys as columns; a column slice of a contiguous [D, T] is fine), out [S, >= W] float32, rows
    contiguous -> out[s, t] = sum_h weights[s, h] * relu(scale * q[s, h] . keys_t[:, t]). The same bits from
    every instruction set and from the plain C loop (``simd`` False: tests); ``index_select_takes`` says
    where it runs."""
    rows, heads, dim = q.shape
    q, weights = q.contiguous(), weights.float().contiguous()
    if keys_t.stride(1) != 1 or out.stride(1) != 1 or keys_t.shape[0] != dim:
        raise ValueError(f"index_tile_scores: keys_t {tuple(keys_t.shape)} / out {tuple(out.shape)} not row-major")
    _kernels.index_tile_scores(
        q.data_ptr(), weights.data_ptr(), keys_t.data_ptr(), rows, heads, dim, keys_t.shape[1], keys_t.stride(0),
        scale, out.data_ptr(), out.stride(0), int(simd), kernel_threads(),
    )  # fmt: skip
    return out


def index_tile_choose(slab: torch.Tensor, first: int, position: int, ranks: torch.Tensor, merged: bool) -> torch.Tensor:
    """A long prompt's running top-k, one slab merged: slab [S, W] float32 (rows contiguous) the scores of keys
    first.. for rows at positions position..; ranks int64 [S, topk] (the C side's uint64 rank keys; read where
    ``merged``, else W >= topk) -> ranks, each row's topk best so far, best first: the higher score, a NaN above
    every number, ties to the lower position, keys after a row's position as -inf. ``index_positions`` turns
    them into positions."""
    rows, topk = ranks.shape
    if slab.stride(1) != 1 or not ranks.is_contiguous() or slab.shape[0] != rows or ranks.dtype != torch.int64:
        raise ValueError(f"index_tile_choose: slab {tuple(slab.shape)} / ranks {tuple(ranks.shape)} {ranks.dtype}")
    _kernels.index_tile_choose(
        slab.data_ptr(), rows, slab.shape[1], slab.stride(0), first, position, topk, merged, ranks.data_ptr(),
        kernel_threads(),
    )  # fmt: skip
    return ranks


def index_positions(ranks: torch.Tensor) -> torch.Tensor:
    """The positions ``index_tile_choose``'s rank keys hold: the complement of their low 32 bits."""
    return ~ranks & 0xFFFFFFFF
