"""The memory a model family needs beyond its weights, estimated before anything loads: the KV cache per
position, the rows it holds whatever the context, what compressed attention works from, a naive K/V cache
(the comparison `kv info` prints), and the activation terms of attention, indexer and residual stream
(activations.py adds them up; placement.py and kv_bytes.py ask here). Each family's formulas read the
geometry its engine family declares (engine/families.py ``Family.geometry``: MLAGeometry, V4Geometry);
``family_memory`` chooses them, the one place planning asks which.

Activation shapes drop the batch dim (B = 1): C new positions attend to T cached ones; d is the compute
dtype's bytes, f32 scores are 4. Score tensors are cut into query blocks of at most SCORE_BLOCK_BYTES
(engine.core.layers.query_blocks), so a block holds q_blk = min(C, SCORE_BLOCK_BYTES // (heads * T * 4))
queries (at least one); MLA prefill over a longer cache cuts the cached positions into key blocks
instead (engine/mla/prefill.py key_block).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Protocol, assert_never

from engine.config.args import ModelArgs
from engine.core.layers import SCORE_BLOCK_BYTES
from engine.families import MLAGeometry, V4Geometry, family_of
from engine.mla.expansions import KEPT_EXPANSION_BYTES
from engine.mla.prefill import absorbed_is_cheaper, key_block

F32 = 4
INT64 = 8
INDEX_KEY_BYTES = 4  # the in-memory DSA indexer keys stay float32 whatever the compute dtype


class FamilyMemory(Protocol):
    """A family's memory estimates (``item``: bytes per value in the compute dtype; ``d``: the compute
    dtype's bytes)."""

    @property
    def naive_kv_kind(self) -> str:
        """What ``naive_kv_bytes_per_token`` counts, in words."""
        ...

    def cache_bytes_per_token(self, item: int) -> int:
        """The in-memory cache per position."""
        ...

    def held_rows_bytes(self, item: int) -> int:
        """Bytes the cache holds whatever the context (fixed windows)."""
        ...

    def compressed_kv_bytes_per_token(self, item: int) -> float | None:
        """What compressed attention works from per context position; None: the family has none."""
        ...

    def naive_kv_bytes_per_token(self, item: int) -> int:
        """An uncompressed cache of the model's own attention."""
        ...

    def residual_bytes(self, d: int, chunk: int) -> int:
        """The residual stream of a forward of ``chunk`` positions, held across every layer."""
        ...

    def prompt_window_bytes(self, d: int, window: int) -> int:
        """What a prompt read ``window`` positions at a time, layer by layer (Model.forward_prompt), holds
        across a layer beyond one chunk's forward (0: the family reads prompts chunk by chunk)."""
        ...

    def attention_bytes(self, d: int, chunk: int, context: int) -> int:
        """Peak temporaries of one attention layer: ``chunk`` new positions against ``context`` cached."""
        ...

    def indexer_bytes(self, d: int, chunk: int, context: int) -> int:
        """Peak temporaries of one sparse-attention indexer (0 without one)."""
        ...


def family_memory(args: ModelArgs) -> FamilyMemory:
    """The memory estimates of a model config's family."""
    geometry = family_of(args).geometry
    match geometry:
        case MLAGeometry():
            return MLAMemory(geometry)
        case V4Geometry():
            return V4Memory(geometry)
        case _:
            assert_never(geometry)


def block_queries(chunk: int, heads: int, context: int) -> int:
    """Queries per score block: engine.core.layers.query_blocks with one query's float32 scores [heads, T]."""
    return min(chunk, max(1, SCORE_BLOCK_BYTES // (heads * context * F32)))


def stream_bytes(args: ModelArgs, d: int, chunk: int) -> int:
    """x, the normed input, the branch output, x + branch [C, dim]."""
    return 4 * chunk * args.dim * d


class MLAMemory:
    """MLA attention (engine/mla/model.py); the DSA indexer on the layers that run one."""

    naive_kv_kind = "uncompressed per-head K and V per layer (MHA)"

    def __init__(self, geometry: MLAGeometry):
        self.args, self.index_layers = geometry.args, geometry.index_layers

    def cache_bytes_per_token(self, item: int) -> int:
        """Latent + roped key in the compute dtype, indexer keys float32."""
        args = self.args
        latent = args.n_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * item
        return latent + len(self.index_layers) * args.index_head_dim * INDEX_KEY_BYTES

    def held_rows_bytes(self, item: int) -> int:
        return 0

    def compressed_kv_bytes_per_token(self, item: int) -> float | None:
        return None

    def naive_kv_bytes_per_token(self, item: int) -> int:
        """K [H, qk_head_dim] and V [H, v_head_dim] per layer (per-head MHA)."""
        args = self.args
        return args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * item

    def residual_bytes(self, d: int, chunk: int) -> int:
        return stream_bytes(self.args, d, chunk)

    def prompt_window_bytes(self, d: int, window: int) -> int:
        """engine/mla/model.py forward_prompt: every chunk's residual [W, dim], at an FFN also its normed input,
        its output and its float64 routed sum."""
        return window * self.args.dim * (3 * d + 8)

    def attention_bytes(self, d: int, chunk: int, context: int) -> int:
        """engine/mla/attention.py MLA.forward's peak for ``chunk`` new positions (and a decode step) against
        ``context`` cached ones: the whole-cache expanded path while the cache fits one key block
        (engine/mla/prefill.py key_block), else the key-blocked form MLA picks (absorbed_is_cheaper). Under a
        DSA selection of fewer positions MLA attends only those (prefill.selected_blocks: the output and one
        query block's temporaries within SELECTED_BLOCK_BYTES), less than the key-blocked form counted here."""
        args, h = self.args, self.args.n_heads
        per_position = (
            args.q_lora_rank  # q latent [C, q_lora]
            + 2 * h * args.qk_head_dim  # q [C, H, n + r] and the roped q_rope copy
            + args.kv_lora_rank
            + args.qk_rope_head_dim  # wkv_a out [C, c + r]
        )
        projections = d * chunk * per_position
        # one query's scores [H, T] (a decode step): float32 3 at once; bfloat16 as _whole_cache's scores
        decode = h * context * (3 * d if d == F32 else 2 * d + 2 * F32)
        if chunk == 1 or context <= key_block(chunk, h):
            return projections + max(decode, self._whole_cache_bytes(d, chunk, context))
        dims = (args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim)
        blocked = self._absorbed_blocks_bytes if absorbed_is_cheaper(chunk, h, *dims) else self._expanded_blocks_bytes
        return projections + max(decode, blocked(d, chunk, context))

    def _whole_cache_bytes(self, d: int, chunk: int, context: int) -> int:
        """MLA._expanded, _expanded_block. H heads, n nope, r rope, v value head dims."""
        args, c, t, h = self.args, chunk, context, self.args.n_heads
        outputs = d * c * 2 * h * args.v_head_dim  # block outputs [C, H, v], their cat, wo's input
        # wkv_b over every cached latent: kv [T, H, n + v] (the einsums read its k_nope / v views in place,
        # as a measured peak confirms: docs/benchmarks-log.md, "Figures behind the code"). It grows with T, not
        # C, which is why a cache longer than one key block takes the key-blocked forms below.
        expanded = d * t * h * (args.qk_nope_head_dim + args.v_head_dim)
        # one query block's scores [q_blk, H, T]: float32 holds 3 at once (the two einsums and their sum,
        # then scaled, masked, softmax); bfloat16 the masked scores, the softmax's float32 copy of its input
        # and its float32 output, then the cast back (both checked against measured peaks, same section).
        # Masks [q_blk, T] bool: causal, chosen (DSA), their negation.
        per_score = 3 * d if d == F32 else 2 * d + 2 * F32
        q_blk = block_queries(c, h, t)
        scores = q_blk * h * t * per_score + 3 * q_blk * t
        return outputs + expanded + scores

    def _block_common_bytes(self, d: int, chunk: int, context: int, value_dim: int) -> int:
        """What both key-blocked forms hold besides their keys: the online softmax's float32 state (output
        [H, C, value_dim]; max, sum, rescale and the next max and shift [H, C]); one block's scores
        [H, C, Tk] (a float32 copy, the weights cast back, in bfloat16); its mask [C, Tk] (float32, its
        compute-dtype copy, two bool); the DSA choice [C, T] bool; the output [C, H, v] cast back and stacked."""
        args, c, h = self.args, chunk, self.args.n_heads
        block = min(context, key_block(c, h))
        state = F32 * h * c * (value_dim + 5)
        per_score = d if d == F32 else d + F32 + d
        scores = h * c * block * per_score + c * block * (F32 + d + 2)
        chosen = c * context if args.has_dsa else 0
        out = 2 * d * c * h * args.v_head_dim
        return state + scores + chosen + out

    def _expanded_blocks_bytes(self, d: int, chunk: int, context: int) -> int:
        """prefill_attention.expanded_blocks: queries [H, C, n + r]; per block wkv_b's output [Tk, H, n + v]
        and the keys [Tk, H, n + r]; in a prompt window the full blocks' outputs kept across the layer's
        chunks (engine/mla/expansions.py), at most KEPT_EXPANSION_BYTES."""
        args, c, h = self.args, chunk, self.args.n_heads
        block = min(context, key_block(c, h))
        query = d * h * c * args.qk_head_dim
        expansion = d * h * (args.qk_nope_head_dim + args.v_head_dim)  # one position's
        keys = block * (expansion + d * h * args.qk_head_dim)
        kept = min(KEPT_EXPANSION_BYTES, context * expansion)
        return query + keys + kept + self._block_common_bytes(d, c, context, args.v_head_dim)

    def _absorbed_blocks_bytes(self, d: int, chunk: int, context: int) -> int:
        """prefill_attention.absorbed_blocks: q_nope folded [H, C, c] and the queries [H, C, c + r]; per
        block the keys [Tk, c + r] and the weighted latents [H, C, c] (and their float32 copy)."""
        args, c, h = self.args, chunk, self.args.n_heads
        block = min(context, key_block(c, h))
        rank, rope = args.kv_lora_rank, args.qk_rope_head_dim
        query = d * h * c * (2 * rank + rope)
        keys = d * block * (rank + rope) + (d + F32) * h * c * rank
        return query + keys + self._block_common_bytes(d, c, context, rank)

    def indexer_bytes(self, d: int, chunk: int, context: int) -> int:
        """The DSA lightning indexer (engine/mla/indexer.py), Hi heads of D, on layers with their own indexer.
        Counted in its per-query form; past BLOCKED_FROM_KEYS a chunk is scored in blocks (engine/mla/
        index_blocks.py: a score block, a slab of keys and the running top-k), which holds less."""
        args = self.args
        if not args.has_dsa:
            return 0
        c, t, hi, dim = chunk, context, args.index_n_heads, args.index_head_dim
        queries = c * hi * dim * (2 * d + F32) + c * dim * (d + F32) + c * hi * F32  # q, roped, float; k; weights
        q_blk = block_queries(c, hi, t)
        # head scores [q_blk, Hi, T] float32 (ReLU in place); index scores [q_blk, T] float32, masked copy,
        # the stable sort's values (f32) and indices (int64); the future mask [q_blk, T] bool
        scores = q_blk * hi * t * F32 + q_blk * t * (3 * F32 + INT64 + 1)
        return queries + scores


class V4Memory:
    """DeepSeek-V4 (engine/v4/model.py): in memory it keeps the compressed entries (its rows are released once
    logged, or when nothing logs them: engine/v4/position_rows.py) and fixed windows of rows."""

    naive_kv_kind = "one uncompressed K=V head per layer (MQA)"

    def __init__(self, geometry: V4Geometry):
        self.args, self.v4, self.layer_rows = geometry.args, geometry.v4, geometry.layer_rows

    def cache_bytes_per_token(self, item: int) -> int:
        """The compressed entries (one per m positions per compressed layer), rounded up to a whole byte:
        the rows are released but for the fixed windows of ``held_rows_bytes``."""
        return math.ceil(self._entry_values() * item)

    def held_rows_bytes(self, item: int) -> int:
        """Per layer the sliding window's K=V rows (window - 1 of D), and per compressor its open
        window's projections (kv and gate; an overlapping one also the window before it). A session
        logging rows in another dtype than it computes keeps them all."""
        v4, values = self.v4, 0
        for layer, widths in enumerate(self.layer_rows):
            values += (v4.sliding_window - 1) * widths["kv"]
            if v4.rate(layer):
                overlap = v4.is_csa(layer)
                values += (v4.rate(layer) - 1 + overlap * v4.rate(layer)) * 2 * widths["compressor.kv"]
            if v4.is_csa(layer):
                values += (2 * v4.csa_rate - 1) * 2 * widths["indexer.kv"]
        return values * item

    def compressed_kv_bytes_per_token(self, item: int) -> float | None:
        """What its attention works from per context position once the sliding window has passed (the
        window's rows are a constant, window x D per layer, not a cost per token): per compressed layer
        its entries (D / m), on CSA layers also the indexer's entries (index_head_dim / m). HCA attends
        to all of its entries; CSA to the index_topk its indexer picks after scoring all of its."""
        return float(self._entry_values() * item)

    def _entry_values(self) -> Fraction:
        """Values of compressed entries per position: D / m per compressed layer, index_head_dim / m per CSA layer."""
        v4, values = self.v4, Fraction(0)
        for layer in range(self.args.n_layers):
            if v4.rate(layer):
                values += Fraction(v4.head_dim, v4.rate(layer))
            if v4.is_csa(layer):
                values += Fraction(v4.index_head_dim, v4.csa_rate)
        return values

    def naive_kv_bytes_per_token(self, item: int) -> int:
        """Its one shared K=V head [D] per layer (MQA)."""
        return self.args.n_layers * self.v4.head_dim * item

    def residual_bytes(self, d: int, chunk: int) -> int:
        """Besides the stream's temporaries, n residual streams [C, n, dim], twice while a block spreads
        its output."""
        return stream_bytes(self.args, d, chunk) + 2 * self.v4.hc_mult * chunk * self.args.dim * d

    def prompt_window_bytes(self, d: int, window: int) -> int:
        return 0  # chunk by chunk: the cache frees rows between chunks (engine/core/interfaces.py prompt_in_windows)

    def attention_bytes(self, d: int, chunk: int, context: int) -> int:
        """engine/v4/attention.py on its widest layer: the sliding window's rows plus every closed entry
        (an HCA layer attends to all T / m' of them; a CSA layer masks all T / m). D head_dim, g o_groups,
        K = C + n - 1 + E keys per query."""
        args, v4, c, h = self.args, self.v4, chunk, self.args.n_heads
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
        q_blk = block_queries(c, h, keys)
        # one block's scores [q_blk, H, K]: scores, masked, with the sink column, probs; masks [q_blk, K]
        scores = q_blk * h * keys * 4 * F32 + 2 * q_blk * keys + c * entries  # + the visible-entry mask [C, E]
        return d * c * per_position + scores

    def indexer_bytes(self, d: int, chunk: int, context: int) -> int:
        """The CSA lightning indexer (engine/v4/attention.py Indexer), query-blocked like DSA's."""
        v4, c = self.v4, chunk
        if not any(v4.is_csa(i) for i in range(self.args.n_layers)):
            return 0
        hi, dim, entries = v4.index_n_heads, v4.index_head_dim, max(1, context // v4.csa_rate)
        queries = c * hi * dim * (2 * d + F32) + c * hi * F32  # q, roped, float; weights
        q_blk = block_queries(c, hi, entries)
        # head scores [q_blk, Hi, E] float32 and their ReLU and weighted copies; index [q_blk, E] float32,
        # masked; top-k indices (int64) and the chosen mask
        scores = 3 * q_blk * hi * entries * F32 + q_blk * entries * (2 * F32 + INT64 + 2)
        return queries + scores
