"""Activation memory: the bytes a forward holds beyond the weights and the KV cache, the term that
`plan` adds for the worst step a run can take.

That step is the last prefill chunk of a prompt that fills the context: C = PREFILL_CHUNK_TOKENS new
positions attending to T = max_position_embeddings cached ones. (A decode step is a chunk of one.)
Shapes below drop the batch dim (B = 1); d is the compute dtype's bytes (4 float32, 2 bfloat16),
f = 4 (float32: softmax, router, indexer scores). Names as in engine/attention.py: H heads, n nope,
r rope, v value head dims; Hi, D the indexer's heads and head dim. Score tensors are cut into query
blocks of at most SCORE_BLOCK_BYTES (engine.layers.query_blocks), so a block holds
q_blk = min(C, SCORE_BLOCK_BYTES // (heads * T * 4)) queries (at least one).

Layers run one after another and free their temporaries, so the peak is the residual stream plus the
largest of three phases (attention, indexer, FFN), plus the float32 upcast block of a bf16 weight
when the model holds some (engine/bf16.py). Measured on the demo container (float32, chunk 256): a
2048-token prompt peaked 52 MiB above a 16-token one, 3 MiB of it KV; this formula gives 47 MiB. The
rest, small allocations the heap keeps, is within RUNTIME_BASELINE_BYTES's slack at short prompts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.args import ModelArgs
from engine.bf16 import UPCAST_BLOCK_BYTES
from engine.layers import SCORE_BLOCK_BYTES

# Prefill runs the prompt this many positions at a time, appending each chunk to the cache: activation
# memory then depends on the chunk and the context, never on the prompt's length, and placement counts
# it (prefill_activation_bytes below). A fixed number, never derived from a budget or from what else is
# running, so the positions each forward sees (and the tokens) are the same under any budget or batch.
PREFILL_CHUNK_TOKENS = 256

F32 = 4
INT64 = 8
F64 = 8


def _block_queries(chunk: int, heads: int, context: int) -> int:
    """Queries per score block: engine.layers.query_blocks with one query's float32 scores [heads, T]."""
    return min(chunk, max(1, SCORE_BLOCK_BYTES // (heads * context * F32)))


def attention_bytes(args: ModelArgs, d: int, chunk: int, context: int) -> int:
    """MLA, expanded path (engine/attention.py MLA.forward, _expanded, _expanded_block)."""
    c, t, h = chunk, context, args.n_heads
    per_position = (
        args.q_lora_rank  # q latent [C, q_lora]
        + 2 * h * args.qk_head_dim  # q [C, H, n + r] and the roped q_rope copy
        + args.kv_lora_rank
        + args.qk_rope_head_dim  # wkv_a out [C, c + r]
        + 2 * h * args.v_head_dim  # block outputs [C, H, v], their cat, wo's input
    )
    projections = d * c * per_position
    # wkv_b over every cached latent: kv [T, H, n + v] (the einsums read its k_nope / v views in place:
    # measured, 512 MiB of kv raised the peak by 519 MiB). It grows with T, not C: for DeepSeek-V3 at
    # 163840 positions 20 GiB in float32, the largest term there.
    expanded = d * t * h * (args.qk_nope_head_dim + args.v_head_dim)
    # one query block's scores [q_blk, H, T]: float32 holds 3 at once (the two einsums and their sum,
    # then scaled, masked, softmax); bfloat16 the masked scores, the softmax's float32 copy of its input
    # and its float32 output, then the cast back (measured: 10-11.5 bytes per score, float32 12).
    # Masks [q_blk, T] bool: causal, chosen (DSA), their negation.
    per_score = 3 * d if d == F32 else 2 * d + 2 * F32
    q_blk = _block_queries(c, h, t)
    scores = q_blk * h * t * per_score + 3 * q_blk * t
    return projections + expanded + scores


def v4_attention_bytes(args: ModelArgs, d: int, chunk: int, context: int) -> int:
    """DeepSeek-V4 (engine/v4_attention.py) on its widest layer: the sliding window's rows plus every
    closed entry (an HCA layer attends to all T / m' of them; a CSA layer masks all T / m).
    D head_dim, g o_groups, K = C + n - 1 + E keys per query."""
    v4, c, h = args.v4, chunk, args.n_heads
    per_position = (
        args.q_lora_rank  # q latent
        + 2 * h * v4.head_dim  # q normed, q roped
        + 2 * v4.head_dim  # kv normed, roped
        + 3 * h * v4.head_dim  # attention output, its rope undone, grouped view
        + v4.o_groups * v4.o_lora_rank  # wo_a output
    )
    rates = [v4.rate(i) for i in range(args.n_layers) if v4.rate(i)]
    entries = context // min(rates) if rates else 0
    keys = c + v4.sliding_window - 1 + entries
    q_blk = _block_queries(c, h, keys)
    # one block's scores [q_blk, H, K]: scores, masked, with the sink column, probs; masks [q_blk, K]
    scores = q_blk * h * keys * 4 * F32 + 2 * q_blk * keys + c * entries  # + the visible-entry mask [C, E]
    return d * c * per_position + scores


def v4_indexer_bytes(args: ModelArgs, d: int, chunk: int, context: int) -> int:
    """DeepSeek-V4's CSA lightning indexer (engine/v4_attention.py Indexer), query-blocked like DSA's."""
    v4, c = args.v4, chunk
    if not any(v4.is_csa(i) for i in range(args.n_layers)):
        return 0
    hi, dim, entries = v4.index_n_heads, v4.index_head_dim, max(1, context // v4.csa_rate)
    queries = c * hi * dim * (2 * d + F32) + c * hi * F32  # q, roped, float; weights
    q_blk = _block_queries(c, hi, entries)
    # head scores [q_blk, Hi, E] float32 and their ReLU and weighted copies; index [q_blk, E] float32,
    # masked; top-k indices (int64) and the chosen mask
    scores = 3 * q_blk * hi * entries * F32 + q_blk * entries * (2 * F32 + INT64 + 2)
    return queries + scores


def indexer_bytes(args: ModelArgs, d: int, chunk: int, context: int) -> int:
    """DSA lightning indexer (engine/indexer.py), on layers with their own indexer; 0 without DSA."""
    if not args.has_dsa:
        return 0
    c, t, hi, dim = chunk, context, args.index_n_heads, args.index_head_dim
    queries = c * hi * dim * (2 * d + F32) + c * dim * (d + F32) + c * hi * F32  # q, roped, float; k; weights
    q_blk = _block_queries(c, hi, t)
    # head scores [q_blk, Hi, T] float32 (ReLU in place); index scores [q_blk, T] float32, masked copy,
    # the stable sort's values (f32) and indices (int64); the future mask [q_blk, T] bool
    scores = q_blk * hi * t * F32 + q_blk * t * (3 * F32 + INT64 + 1)
    return queries + scores


def ffn_bytes(args: ModelArgs, d: int, chunk: int) -> int:
    """Dense MLP or MoE (engine/layers.py MLP, engine/moe.py MoE, RoutedSum, engine/quant.py)."""
    c = chunk
    dense = 3 * c * args.inter_dim * d  # silu(w1 x) and w3 x [C, inter], their product
    shared = 3 * c * args.n_shared_experts * args.moe_inter_dim * d
    routed = (
        c * args.n_routed_experts * 3 * F32  # router scores, biased copy [C, E] float32
        + c * args.dim * (F64 + d)  # RoutedSum's float64 sum [C, dim] and its cast back
        + c * args.dim * (F32 + F64)  # one expert's weighted output [rows <= C, dim] float32, as float64
        + 3 * c * args.moe_inter_dim * d  # one expert's hidden [rows, moe_inter] (x3 as in MLP)
        + 3 * args.moe_inter_dim * args.dim * d // 2  # one dequantised matrix (x1.5 its temporaries)
    )
    return max(dense, shared + routed)


def bf16_upcast_bytes(chunk: int, weight_shapes: Iterable[tuple[int, ...]]) -> int:
    """A float32 model holding bf16 weights (engine/bf16.py Bf16Linear, more than MAX_ROWS rows): one
    block of output rows upcast to float32 (at most UPCAST_BLOCK_BYTES) and the per-block outputs
    [C, out] float32 before their cat. 0 when no weight is held in bf16."""
    shapes = list(weight_shapes)
    if not shapes:
        return 0
    block = min(UPCAST_BLOCK_BYTES, max(F32 * out * inp for out, inp in shapes))
    return block + max(F32 * chunk * out for out, _ in shapes)


def prefill_activation_bytes(
    args: ModelArgs,
    dtype: torch.dtype,
    chunk: int,
    context: int,
    bf16_weight_shapes: Iterable[tuple[int, ...]] = (),
) -> int:
    """Peak activation bytes of a forward of ``chunk`` new positions against ``context`` cached ones."""
    d = torch.empty((), dtype=dtype).element_size()
    c = min(chunk, context)
    residual = 4 * c * args.dim * d  # x, the normed input, the branch output, x + branch [C, dim]
    if args.v4 is not None:  # n residual streams [C, n, dim], twice while a block spreads its output
        residual += 2 * args.v4.hc_mult * c * args.dim * d
        attention = v4_attention_bytes(args, d, c, context)
        indexer = v4_indexer_bytes(args, d, c, context)
    else:
        attention, indexer = attention_bytes(args, d, c, context), indexer_bytes(args, d, c, context)
    phases = max(attention, indexer, ffn_bytes(args, d, c))
    return residual + phases + bf16_upcast_bytes(c, bf16_weight_shapes)
