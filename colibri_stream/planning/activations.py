"""Activation memory: the bytes a forward holds beyond the weights and the KV cache, the term that
`plan` adds for the worst step a run can take.

That step is the last prefill chunk of a prompt that fills the context: C = PREFILL_CHUNK_TOKENS new
positions attending to T cached ones, T the context planned for (--context, else the model's
max_position_embeddings; budget.planned_context). A decode step is a chunk of one, and the family's
attention term counts it too. MLA prefill over a cache longer than one key block attends block by block
(engine/mla/prefill.py), so its term stops growing with heads x T.
Shapes below drop the batch dim (B = 1); d is the compute dtype's bytes (4 float32, 2 bfloat16),
f = 4 (float32: softmax, router scores).

Layers run one after another and free their temporaries, so the peak is the residual stream plus the
largest of three phases (attention, indexer, FFN), plus the float32 upcast block of a bf16 weight
when the model holds some (engine/kernels/bf16.py). The residual stream, attention and indexer terms are the
model family's (engine/families.py: MLA and DSA, or DeepSeek-V4's); the FFN's are common. Checked
against a long prompt's measured peak on the demo container (docs/benchmarks-log.md, "Figures behind the
code"): the formula comes within a few MiB, and the rest, small allocations the heap keeps, is within
RUNTIME_BASELINE_BYTES's slack at short prompts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from colibri_stream.planning.family_memory import family_memory
from engine.config.args import ModelArgs
from engine.kernels.bf16 import UPCAST_BLOCK_BYTES

# Prefill runs the prompt this many positions at a time, appending each chunk to the cache: activation
# memory then depends on the chunk and the context, never on the prompt's length, and placement counts
# it (prefill_activation_bytes below). A fixed number, never derived from a budget or from what else is
# running, so the positions each forward sees (and the tokens) are the same under any budget or batch.
PREFILL_CHUNK_TOKENS = 256
# A prompt alone in the batch is read this many chunks at a time, layer by layer (engine/mla/model.py
# forward_prompt: the same bits, each expert read once per layer per window instead of once per chunk);
# the window's residual stream and routed sums are held across a layer (prompt_window_bytes).
PREFILL_WINDOW_CHUNKS = 16

F32 = 4
F64 = 8


def ffn_bytes(args: ModelArgs, d: int, chunk: int) -> int:
    """Dense MLP or MoE (engine/core/layers.py MLP, engine/core/moe.py MoE, RoutedSum, engine/kernels/quant.py)."""
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
    """A float32 model holding bf16 weights (engine/kernels/bf16.py Bf16Linear, more than PROMPT_KERNEL_ROWS rows): one
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
    """Peak activation bytes of a forward of ``chunk`` new positions against ``context`` cached ones, in a
    window of PREFILL_WINDOW_CHUNKS chunks read layer by layer where the family does."""
    d = torch.empty((), dtype=dtype).element_size()
    c = min(chunk, context)
    family = family_memory(args)
    phases = max(family.attention_bytes(d, c, context), family.indexer_bytes(d, c, context), ffn_bytes(args, d, c))
    window = family.prompt_window_bytes(d, min(chunk * PREFILL_WINDOW_CHUNKS, context))
    return family.residual_bytes(d, c) + window + phases + bf16_upcast_bytes(c, bf16_weight_shapes)
