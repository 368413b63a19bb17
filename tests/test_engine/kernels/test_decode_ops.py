"""The int8 path's small ops in C (engine/kernels/decode_ops.py): each computes its torch reference's function to
float rounding, on odd widths, ties, groups, DSA positions and int8 wkv_b records; the modules take them
only with int8 activations, and an int8 model's tokens stay those of the same model on torch's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from colibri_stream.runtime.loader import load_container
from engine.core.layers import stable_topk_indices
from engine.kernels import decode_ops
from engine.kernels.modes import int8_activations
from engine.kernels.rows import rows_alone

pytestmark = pytest.mark.skipif(not decode_ops.available(), reason="the C kernels are not built")


def test_rms_norm_matches_torch_on_odd_widths_and_several_rows():
    torch.manual_seed(0)
    for rows, dim in ((1, 2048), (3, 2047), (5, 7), (2, 1)):
        x, w = torch.randn(rows, dim) * 3, torch.randn(dim)
        expected = F.rms_norm(x, (dim,), w, 1e-6)
        got = decode_ops.rms_norm(x, w, 1e-6)
        assert got.shape == x.shape
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (rows, dim)


def reference_route(x, weight, bias, score, groups, topk_groups, topk, normalise, scale):
    """engine/core/moe.py's Gate, op by op."""
    logits = x @ weight.T
    scores = {
        "sigmoid": torch.sigmoid,
        "softmax": lambda v: v.softmax(-1),
        "sqrtsoftplus": lambda v: F.softplus(v).sqrt(),
    }[score](logits)
    biased = scores + (0 if bias is None else bias)
    if groups > 1:
        grouped = biased.view(x.shape[0], groups, -1)
        chosen = stable_topk_indices(grouped.topk(2, dim=-1).values.sum(-1), topk_groups)
        dropped = torch.ones(x.shape[0], groups, dtype=torch.bool).scatter_(1, chosen, False)
        biased = grouped.masked_fill(dropped[..., None], float("-inf")).flatten(1)
    ids = stable_topk_indices(biased, topk)
    weights = scores.gather(1, ids)
    if normalise:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, ids


@pytest.mark.parametrize(
    "experts,dim,groups,topk_groups,topk,score,normalise",
    [
        (64, 515, 8, 4, 6, "sigmoid", True),  # DeepSeek-V3's scheme at an odd width
        (16, 64, 1, 1, 4, "softmax", False),  # no groups, softmax, unnormalised
        (12, 33, 4, 2, 3, "sqrtsoftplus", True),  # V4's score, three experts a group
        (6, 8, 3, 3, 6, "sigmoid", True),  # every expert chosen
    ],
)
def test_route_chooses_the_references_experts_with_its_weights(
    experts, dim, groups, topk_groups, topk, score, normalise
):
    torch.manual_seed(experts + dim)
    weight, bias = torch.randn(experts, dim) * 0.1, torch.randn(experts) * 0.1
    x = torch.randn(7, dim)
    want_w, want_ids = reference_route(x, weight, bias, score, groups, topk_groups, topk, normalise, 2.5)
    got_w, got_ids = decode_ops.route(x, weight, bias, score, groups, topk_groups, topk, normalise, 2.5)
    assert torch.equal(got_ids, want_ids)
    assert torch.allclose(got_w, want_w, rtol=1e-5, atol=1e-7)


def test_route_breaks_ties_to_the_lower_id_and_takes_no_bias():
    weight = torch.zeros(8, 4)  # every score equal: the lowest ids win, in order
    weights, ids = decode_ops.route(torch.ones(2, 4), weight, None, "sigmoid", 1, 1, 3, True, 1.0)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert torch.allclose(weights, torch.full((2, 3), 1 / 3))


def test_route_refuses_groups_that_do_not_split_the_experts():
    assert not decode_ops.routes("sigmoid", torch.zeros(10, 4), 4, 2)
    assert not decode_ops.routes("sigmoid", torch.zeros(8, 4), 8, 2)  # one expert a group: no two best
    assert not decode_ops.routes("hash", torch.zeros(8, 4), 1, 1)
    assert decode_ops.routes("sigmoid", torch.zeros(8, 4), 4, 2)


def reference_attend(q_nope, q_rope, latents, rope_keys, kv_b, scale):
    heads, nope = q_nope.shape
    per_head = kv_b.view(heads, -1, latents.shape[1])
    w_k, w_v = per_head[:, :nope], per_head[:, nope:]
    q_latent = torch.einsum("hn,hnc->hc", q_nope.double(), w_k.double())
    scores = (q_latent @ latents.double().T + q_rope.double() @ rope_keys.double().T) * scale
    return torch.einsum("hc,hvc->hv", scores.softmax(-1) @ latents.double(), w_v.double()).float()


@pytest.mark.parametrize(
    "heads,nope,rope,value,rank,total",
    [(16, 64, 32, 64, 256, 40), (3, 24, 8, 40, 72, 1), (5, 16, 0, 8, 33, 9), (7, 16, 13, 24, 61, 150)],
)
def test_attend_one_matches_the_absorbed_reference(heads, nope, rope, value, rank, total):
    torch.manual_seed(total)
    q_nope, q_rope = torch.randn(heads, nope), torch.randn(heads, rope)
    latents, rope_keys = torch.randn(total, rank), torch.randn(total, rope)
    kv_b = torch.randn(heads * (nope + value), rank) * 0.05
    got = decode_ops.attend_one(q_nope, q_rope, latents, rope_keys, None, kv_b, None, 0, 0.125)
    want = reference_attend(q_nope, q_rope, latents, rope_keys, kv_b, 0.125)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_attend_one_gathers_the_dsa_positions_and_reads_int8_records():
    torch.manual_seed(1)
    heads, nope, rope, value, rank, total, group = 4, 32, 16, 32, 96, 30, 32
    q_nope, q_rope = torch.randn(heads, nope), torch.randn(heads, rope)
    latents, rope_keys = torch.randn(total, rank), torch.randn(total, rope)
    codes = torch.randint(-127, 128, (heads * (nope + value), rank), dtype=torch.int8)
    scales = torch.rand(heads * (nope + value), rank // group) * 1e-3
    kv_b = (codes.float().view(-1, rank // group, group) * scales[..., None]).view(-1, rank)
    positions = torch.tensor([29, 3, 0, 17, 3])  # any order, repeats allowed
    got = decode_ops.attend_one(q_nope, q_rope, latents, rope_keys, positions, codes, scales, group, 0.2)
    want = reference_attend(q_nope, q_rope, latents[positions], rope_keys[positions], kv_b, 0.2)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 9, 16])
@pytest.mark.parametrize("int8", [False, True])
def test_attend_one_gives_each_head_its_numbers_alone_whatever_the_blocking(heads, int8):
    """Heads are computed up to 4 together (each latent row read once for them), in blocks sized by the
    thread count: every head's output must be bit for bit that head attending alone, at any count. Odd
    widths (a latent of 61, rope 13: vector tails), 150 positions (the mix's row blocks of 64), DSA."""
    nope, rope, value, rank, total, group = 16, 13, 24, 61, 150, 61
    g = torch.Generator().manual_seed(heads)
    q_nope, q_rope = torch.randn(heads, nope, generator=g), torch.randn(heads, rope, generator=g)
    latents, rope_keys = torch.randn(total, rank, generator=g), torch.randn(total, rope, generator=g)
    positions = torch.randint(0, total, (97,), generator=g) if int8 else None
    rows = heads * (nope + value)
    if int8:
        kv_b = torch.randint(-127, 128, (rows, rank), dtype=torch.int8, generator=g)
        scales = torch.rand(rows, 1, generator=g) * 1e-3
    else:
        kv_b, scales = torch.randn(rows, rank, generator=g) * 0.05, None

    def attend(h=None):
        if h is None:
            return decode_ops.attend_one(q_nope, q_rope, latents, rope_keys, positions, kv_b, scales, group, 0.3)
        part = slice(h * (nope + value), (h + 1) * (nope + value))
        one_scales = None if scales is None else scales[part]
        return decode_ops.attend_one(
            q_nope[h : h + 1], q_rope[h : h + 1], latents, rope_keys, positions, kv_b[part], one_scales, group, 0.3
        )

    alone = torch.cat([attend(h) for h in range(heads)])
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(attend(), alone), threads
    finally:
        torch.set_num_threads(previous)


def test_ops_apply_only_with_int8_activations_on_float32_cpu_tensors():
    x = torch.zeros(2, 8)
    assert not decode_ops.active(x)
    with int8_activations():
        assert decode_ops.active(x)
        assert not decode_ops.active(x.double())
        with decode_ops.torch_ops():
            assert not decode_ops.active(x)


# deepseek_v32's DSA selects 8 positions past its index_topk: a near-tie in the indexer's scores may
# pick another position on float rounding (as int8 rounding may), which moves the logits more
@pytest.mark.parametrize("family,tolerance", [("deepseek_v3", 1e-4), ("deepseek_v32", 0.05)])
def test_an_int8_model_decodes_the_same_tokens_on_the_c_ops(make_container, family, tolerance):
    """The same int8 container on the C ops and on torch's: logits within float rounding, greedy tokens
    equal, and the C path really ran (the logits differ in their last bits)."""
    path = make_container(family, "int4", "int8")
    loaded = load_container(path, int8_activations=True)
    model, experts = loaded.model, loaded.experts
    attention = model.layers[0].attn
    assert attention.kv_b_group > 0  # wkv_b's int8 records held, so read-ahead skips its float weight
    assert [w.data_ptr() for w in attention.decode_unread()] == [attention.wkv_b.weight.data_ptr()]

    def greedy(steps: int) -> tuple[list[int], torch.Tensor]:
        cache, tokens, logits = model.new_cache(), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], []
        out = model(torch.tensor([tokens]), 0, cache, experts)[0, -1]
        for _ in range(steps):
            logits.append(out)
            tokens.append(int(out.argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache.length, cache, experts)[0, -1]
        return tokens, torch.stack(logits)

    fast_tokens, fast = greedy(6)
    with decode_ops.torch_ops():
        slow_tokens, slow = greedy(6)
    assert fast_tokens == slow_tokens
    assert not torch.equal(fast, slow)
    assert (fast - slow).abs().max() <= tolerance * slow.abs().max()


def test_rows_decoded_together_get_the_bits_they_get_alone(make_container):
    path = make_container("deepseek_v3", "int4", "int8")
    loaded = load_container(path, int8_activations=True)
    model, experts = loaded.model, loaded.experts
    prompts = [[3, 1, 4], [2, 7, 1, 8, 2]]
    caches = [model.new_cache() for _ in prompts]
    for prompt, cache in zip(prompts, caches, strict=True):
        model(torch.tensor([prompt]), 0, cache, experts)
    alone = []
    for cache in caches:
        copy = model.new_cache()
        for layer, source in zip(copy.layers, cache.layers, strict=True):
            layer.append(source.latent[:, : source.length].clone(), source.rope_key[:, : source.length].clone())
        alone.append(model(torch.tensor([[5]]), copy.length, copy, experts)[0, -1])
    with rows_alone():
        together = model.forward_rows([5, 5], caches, experts)
    for b in range(2):
        assert torch.equal(together[b], alone[b])
