"""The decode fast paths give the bits of the general code they bypass: RMSNorm through torch's
rms_norm, one-query absorbed attention without einsum or mask, the one-row MoE sum, the prefetch
router (ids only, skipped for providers that ignore prefetch)."""

from __future__ import annotations

import pytest
import torch

import engine.mla.model
from engine.config.args import ModelArgs
from engine.core.layers import RMSNorm
from engine.core.moe import MoE
from engine.core.sources import ExpertWeights, ResidentExperts
from engine.kernels import decode_ops
from engine.kernels.rows import rows_alone
from engine.mla.attention import MLA
from engine.mla.model import Transformer

CONFIG = dict(
    model_type="deepseek_v3",
    vocab_size=32,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
)


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return ModelArgs.from_hf_config(CONFIG)


def randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return module.eval()


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 1, 7168), (1, 13, 48)])
def test_float32_rms_norm_is_the_reference_bit_for_bit(shape):
    norm = randomised(RMSNorm(shape[-1], 1e-6), 1)
    wide = torch.randn(shape[:-1] + (shape[-1] + 5,), generator=torch.Generator().manual_seed(2)) * 30
    x = wide[..., 2 : 2 + shape[-1]]  # strided rows: the latent norm sees a split's view
    assert torch.equal(norm(x), reference_rms_norm(x, norm.weight, 1e-6))


def test_bf16_rms_norm_keeps_the_reference_promotion():
    norm = randomised(RMSNorm(32), 1)  # float32 weight, bf16 activations -> float32, as the reference
    x = torch.randn(2, 1, 32).bfloat16()
    out = norm(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, reference_rms_norm(x, norm.weight, 1e-6))


def masked_einsum_attention(mla: MLA, q_nope, q_rope, latents, rope_keys, start_pos, selection):
    """The general absorbed formula (einsum, causal mask) for one query: what _absorbed_one replaces."""
    w_k, w_v = mla._kv_b()
    q_latent = torch.einsum("bshn,hnc->bshc", q_nope, w_k)
    positions = torch.arange(latents.shape[1])[None, None]
    if selection is not None:
        positions = selection
        latents = latents[0, selection[0, 0]][None, None]
        rope_keys = rope_keys[0, selection[0, 0]][None, None]
    else:
        latents, rope_keys = latents[:, None], rope_keys[:, None]
    scores = torch.einsum("bshc,bstc->bsht", q_latent, latents) + torch.einsum("bshr,bstr->bsht", q_rope, rope_keys)
    visible = positions <= torch.tensor(start_pos)
    scores = scores.mul(mla.softmax_scale).masked_fill(~visible[:, :, None, :], float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32)
    return torch.einsum("bshc,hvc->bshv", torch.einsum("bsht,bstc->bshc", probs, latents), w_v)


@pytest.mark.parametrize("selected", [False, True], ids=["all-positions", "dsa-selection"])
@pytest.mark.parametrize("total", [1, 9, 40])
def test_one_query_absorbed_attention_is_the_masked_einsum_bit_for_bit(args, total, selected):
    mla = randomised(MLA(args, 1), 3)
    generator = torch.Generator().manual_seed(total)
    heads = args.n_heads
    q = torch.randn(1, 1, heads, args.qk_nope_head_dim + args.qk_rope_head_dim, generator=generator)
    q_nope, q_rope = q.split([args.qk_nope_head_dim, args.qk_rope_head_dim], dim=-1)
    latents = torch.randn(1, total + 3, args.kv_lora_rank, generator=generator)[:, :total]
    rope_keys = torch.randn(1, total, args.qk_rope_head_dim, generator=generator)
    selection = torch.randperm(total, generator=generator)[: max(1, total // 2)][None, None] if selected else None
    with decode_ops.torch_ops():  # torch's one-query shortcut
        got = mla._absorbed(q_nope, q_rope, latents, rope_keys, total - 1, selection)
    expected = masked_einsum_attention(mla, q_nope, q_rope, latents, rope_keys, total - 1, selection)
    assert got.shape == (1, 1, heads, args.v_head_dim)
    assert torch.equal(got, expected)
    if decode_ops.available():  # a decode step's one C call: C's summation order, float rounding apart
        in_c = mla._absorbed(q_nope, q_rope, latents, rope_keys, total - 1, selection)
        torch.testing.assert_close(in_c, expected, rtol=1e-5, atol=1e-6)


def resident_experts(args: ModelArgs, seed: int) -> ResidentExperts:
    generator = torch.Generator().manual_seed(seed)

    def weights(*shape):
        return torch.randn(shape, generator=generator) * 0.2

    inter, dim = args.moe_inter_dim, args.dim
    return ResidentExperts(
        {
            layer: {e: ExpertWeights(weights(inter, dim), weights(dim, inter), weights(inter, dim)) for e in range(16)}
            for layer in args.moe_layers
        }
    )


def test_one_row_moe_is_that_row_of_a_batch_bit_for_bit(args):
    """One row takes the in-place sum, several rows index_add_: the same products added in the same
    (expert id) order, so a row's output is the same either way."""
    from engine.kernels.rows import rows_alone

    moe, experts = randomised(MoE(args, 1), 4), resident_experts(args, 5)
    x = torch.randn(5, 1, args.dim, generator=torch.Generator().manual_seed(6))
    with rows_alone():  # the batch's matmuls row by row, as forward_rows runs them
        batched = moe(x, experts)
        for row in range(5):
            assert torch.equal(moe(x[row : row + 1], experts), batched[row : row + 1])


class RecordingPrefetch(ResidentExperts):
    """Resident experts that record the prefetch hints they get."""

    def __init__(self, experts):
        super().__init__(experts._experts)
        self.hints: list[tuple[int, list[int]]] = []
        self.depth = 1  # layers looked ahead

    def prefetch(self, layer, expert_ids):
        self.hints.append((layer, list(expert_ids)))

    def lookahead(self, layers):
        return layers[: self.depth]


def test_prefetch_hints_are_the_next_routers_sorted_ids_and_skip_no_op_providers(args, monkeypatch):
    model = randomised(Transformer(args), 7)
    experts = resident_experts(args, 8)
    recording = RecordingPrefetch(experts)
    predicted: list[int] = []
    predict = MoE.predict
    monkeypatch.setattr(MoE, "predict", lambda self, x: predicted.append(self.layer_id) or predict(self, x))
    # the read-ahead into the CPU caches wants the guess for any provider (tests/test_engine/kernels/test_read_ahead.py)
    monkeypatch.setattr(engine.mla.model, "read_ahead_available", lambda: False)
    cache = model.new_cache()
    plain = model.forward_rows([3], [cache], experts)
    assert predicted == []  # ResidentExperts ignores prefetch: no router run for it
    cache = model.new_cache()
    hinted = model.forward_rows([3], [cache], recording)
    assert torch.equal(plain, hinted)  # a hint never changes the logits
    assert [layer for layer, _ in recording.hints] == list(args.moe_layers) == predicted  # each MoE layer, once
    for _, ids in recording.hints:  # one row: its top-k, distinct and sorted
        assert ids == sorted(set(ids)) and len(ids) == args.n_activated_experts
        assert all(0 <= e < args.n_routed_experts for e in ids)


def test_a_deeper_prefetch_also_guesses_the_layers_after_the_next_nearest_first(args, monkeypatch):
    model = randomised(Transformer(args), 7)
    monkeypatch.setattr(engine.mla.model, "read_ahead_available", lambda: False)
    near, deep = RecordingPrefetch(resident_experts(args, 8)), RecordingPrefetch(resident_experts(args, 8))
    deep.depth = 3  # past the last MoE layer: only the layers there are
    near_logits = model.forward_rows([3], [model.new_cache()], near)
    deep_logits = model.forward_rows([3], [model.new_cache()], deep)
    assert torch.equal(near_logits, deep_logits)
    first, second = args.moe_layers  # this model's two MoE layers
    assert [layer for layer, _ in deep.hints] == [first, second, second]  # layer 0 guesses both, layer 1 again
    assert deep.hints[0] == near.hints[0] and deep.hints[2] == near.hints[1]  # the nearer guess is the same


@pytest.mark.skipif(not decode_ops.available(), reason="engine.kernels._kernels was not built")
def test_float_decode_rows_take_the_c_ops_and_a_prompts_rows_keep_torchs(monkeypatch):
    """RMSNorm (as the router and one query's attention): one C call for a decode row, one or batched
    (rows_alone), with the same bits either way; a prompt's rows, and torch_ops(), keep torch's op."""
    norm = randomised(RMSNorm(37), 1)
    calls = []
    c_norm = decode_ops.rms_norm
    monkeypatch.setattr(decode_ops, "rms_norm", lambda *a: calls.append(a[0].shape) or c_norm(*a))
    x = torch.randn(3, 1, 37, generator=torch.Generator().manual_seed(0))
    one = norm(x[:1])
    with rows_alone():
        batched = norm(x)
    prompt = norm(x.view(1, 3, 37))
    with decode_ops.torch_ops():
        torch_one = norm(x[:1])
    assert calls == [(1, 1, 37), (3, 1, 37)]
    assert torch.equal(batched[:1], one)
    torch.testing.assert_close(one, torch_one, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(prompt.view(3, 1, 37), batched, rtol=1e-6, atol=1e-6)
