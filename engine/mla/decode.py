"""One query's MLA attention in two C calls (engine/csrc/mla_decode.c), on the int8 path and for the float32
path's decode rows.

The ~25 torch ops per layer cost more than the weights they drove (docs/benchmarks-log.md, "Figures behind
the code"). ``mla_project`` runs everything up to the cache's new row, ``mla_output`` attention, wo and the
residual; a DSA layer's indexer runs between them. Same kernels and ops as the module path where decode_ops'
C ops apply, so the bits are the same; projections must be int8 records or bf16, wkv_b int8 or float32.
"""

from __future__ import annotations

import torch

from engine.core.cache import LayerCache
from engine.core.layers import RMSNorm
from engine.kernels import decode_ops
from engine.kernels.native import _kernels
from engine.kernels.q8 import ISA_BEST, CMatrix, c_computes_as_modules, c_matrix_of
from engine.kernels.rows import kernel_threads
from engine.mla.attention import MLA


def _norm(norm: RMSNorm | None) -> bool:
    return norm is None or (norm.weight.dtype == torch.float32 and norm.weight.is_contiguous())


class FusedMLA:
    """A layer's attention (its attn_norm included) described to C once, with the step's scratch rows."""

    def __init__(self, attn_norm: RMSNorm, mla: MLA, weights: _kernels.MlaWeights, matrices: list[CMatrix]):
        self.mla, self.attn_norm = mla, attn_norm
        self.weights = weights  # a capsule: attn_norm and mla keep the arrays it points to alive
        self.matrices = matrices
        heads = mla.n_heads
        self.normed = torch.empty(attn_norm.weight.shape[0])
        self.q_latent = torch.empty(max(mla.q_lora_rank, 1))
        self.q_nope = torch.empty(heads, mla.nope_dim)
        self.q_rope = torch.empty(heads, mla.rope_dim)
        self._scratch = [t.data_ptr() for t in (self.normed, self.q_latent, self.q_nope, self.q_rope)]

    @classmethod
    def build(cls, attn_norm: RMSNorm, mla: MLA) -> FusedMLA | None:
        """None when the layer's weights are not all in the forms the C steps read."""
        kv_b = _kv_b(mla)
        if _kernels is None or kv_b is None:
            return None
        lora = mla.q_lora_rank > 0
        names = ("wq_a", "wkv_a", "wq_b", "wo") if lora else ("wq", "wkv_a", "wo")
        found = {name: c_matrix_of(mla.get_submodule(name)) for name in names}
        matrices = {name: m for name, m in found.items() if m is not None}
        norms = (attn_norm, mla.kv_norm, mla.q_norm if lora else None)
        if len(matrices) < len(found) or not all(_norm(n) for n in norms):
            return None
        dims = (attn_norm.weight.shape[0], mla.n_heads, mla.nope_dim, mla.rope_dim, mla.v_dim, mla.kv_lora_rank,
                mla.q_lora_rank, mla.rope_interleave)  # fmt: skip
        floats = (attn_norm.eps, mla.kv_norm.eps, mla.softmax_scale)
        pointers = (
            attn_norm.weight.data_ptr(),
            mla.q_norm.weight.data_ptr() if lora else 0,
            mla.kv_norm.weight.data_ptr(),
        )
        weights = _kernels.mla_weights(
            dims, floats, pointers, matrices["wq_a" if lora else "wq"], matrices["wkv_a"],
            matrices["wq_b"] if lora else None, matrices["wo"], kv_b,
        )  # fmt: skip
        return cls(attn_norm, mla, weights, list(matrices.values()))

    def computes_as_modules(self) -> bool:
        """Whether the C steps give the module path's bits now (int8 records need int8 activations on)."""
        return c_computes_as_modules(self.matrices)

    def __call__(
        self,
        x: torch.Tensor,
        start_pos: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        selection: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [1, 1, dim] at start_pos -> (x + attn(attn_norm(x)) [1, 1, dim], DSA selection); appends to ``cache``."""
        if cache.length != start_pos:
            raise ValueError(f"cache holds {cache.length} positions but start_pos is {start_pos}")
        x = x.contiguous()
        cos, sin = (t.contiguous() for t in rope)
        normed, q_latent, q_nope, q_rope = self._scratch
        threads = kernel_threads()
        latent, rope_key = cache.next_row()
        try:
            _kernels.mla_project(
                self.weights, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), normed, q_latent, q_nope, q_rope,
                latent.data_ptr(), rope_key.data_ptr(), ISA_BEST, threads,
            )  # fmt: skip
        except BaseException:
            cache.trim(start_pos)
            raise
        if self.mla.indexer is not None:
            latent_q = self.q_latent.view(1, 1, -1) if self.mla.q_lora_rank else None
            selection = self.mla.indexer(self.normed.view(1, 1, -1), latent_q, start_pos, rope, cache)
        positions = None if selection is None else selection.reshape(-1).to(torch.int64).contiguous()
        total = cache.length if positions is None else positions.numel()
        out = torch.empty_like(x)
        _kernels.mla_output(
            self.weights, q_nope, q_rope, cache.latent.data_ptr(), cache.rope_key.data_ptr(),
            0 if positions is None else positions.data_ptr(), total, x.data_ptr(), out.data_ptr(), ISA_BEST, threads,
        )  # fmt: skip
        return out, selection


def _kv_b(mla: MLA) -> tuple[int, int, int] | None:
    """wkv_b as attention reads it (int8 records if held, else the float32 weight), or None."""
    if mla.kv_b_group > 0:
        return (mla.kv_b_codes.data_ptr(), mla.kv_b_scales.data_ptr(), mla.kv_b_group)
    weight = mla.wkv_b.weight
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        return None
    return (weight.data_ptr(), 0, 0)


def fused_attention_applies(x: torch.Tensor, cache: LayerCache, absorb: bool | None) -> bool:
    """Whether a Block's attention may take the fused C path for x (FusedMLA.build then decides per layer)."""
    return (
        absorb is not False
        and x.shape[0] == 1
        and x.shape[1] == 1
        and decode_ops.small_ops_take(x, one_row=True)
        and cache.latent.dtype == torch.float32
        and cache.latent.shape[0] == 1
    )
