"""Products over a long context run on the kernel threads (engine/kernels/rows.py products_on_threads: the DSA
indexer's scores, prefill attention's scores and weighted values) inside a forward pass whose other torch ops
keep one thread, with the bits of one thread: no selection, logit or cached value depends on how many
threads computed it."""

from __future__ import annotations

import json
import time

import pytest
import torch

import engine.kernels.rows as rows_module
from colibri_stream.checkpoint.demo_model import demo_model_dir
from engine.config.args import ModelArgs
from engine.core.cache import LayerCache
from engine.core.rope import rope_tables
from engine.kernels import decode_ops
from engine.kernels.rows import torch_on_one_thread
from engine.mla.expansions import block_expansion
from engine.mla.indexer import Indexer
from engine.mla.prefill import absorbed_blocks, expanded_blocks, key_block

pytestmark = pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 torch threads")


@pytest.fixture(autouse=True)
def cores_free(monkeypatch):
    """The kernels' helper thread's verdict taken as "not shared": a loaded test machine must not turn the
    path these tests compare off (its own test is below)."""
    monkeypatch.setattr(rows_module, "cores_shared", lambda: False)


def select(indexer: Indexer, args: ModelArgs, x: torch.Tensor, q_latent: torch.Tensor, cache: LayerCache, start: int):
    """``forward`` of the S new positions x [1, S, dim] at start.. in a forward pass (torch on one thread),
    and the torch thread counts the scores ran on."""
    seen = []
    einsum, mm = torch.einsum, torch.mm

    def counting(*operands):  # a decode row's and a short context's scores (Indexer.forward)
        seen.append(torch.get_num_threads())
        return einsum(*operands)

    def counting_mm(*operands):  # a prompt block past BLOCKED_FROM_KEYS keys (engine/mla/index_blocks.py)
        seen.append(torch.get_num_threads())
        return mm(*operands)

    cache.append(
        torch.zeros(1, x.shape[1], args.kv_lora_rank), torch.zeros(1, x.shape[1], args.qk_rope_head_dim)
    )  # the latents of these positions (the indexer reads only its keys)
    rope = rope_tables(args, start, x.shape[1], x.device)
    # torch_ops: a decode row's choice is otherwise one C call (engine/kernels/decode_ops.py index_select)
    with torch.inference_mode(), torch_on_one_thread(), decode_ops.torch_ops(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "einsum", counting)
        patch.setattr(torch, "mm", counting_mm)
        chosen = indexer(x, q_latent, start, rope, cache)
    return chosen, seen


# a decode row; a prompt's block, which past BLOCKED_FROM_KEYS keys takes the blocked indexer, whose score
# blocks of query_block() queries (128 here) cross PARALLEL_PRODUCT_MACS (a chunk of a few queries stays on one
# thread by that rule)
@pytest.mark.parametrize("new_positions", [1, 128])
def test_long_context_scores_run_on_the_kernel_threads_with_one_threads_bits(new_positions, monkeypatch):
    args = ModelArgs.from_hf_config(json.loads((demo_model_dir() / "config.json").read_text()))
    torch.manual_seed(0)
    indexer = Indexer(args)
    for parameter in indexer.parameters():
        parameter.data.normal_(0, 0.5)
    context = 16_400  # 16 heads x 32 dims x 16.4k keys: 8.4M multiply-adds a query, the threshold
    assert args.index_n_heads * args.index_head_dim * context >= rows_module.PARALLEL_PRODUCT_MACS
    prompt = torch.randn(1, context, args.dim)
    x, q_latent = torch.randn(1, new_positions, args.dim), torch.randn(1, new_positions, args.q_lora_rank)
    results = {}
    for threshold in (rows_module.PARALLEL_PRODUCT_MACS, 1 << 62):  # then: never parallel
        monkeypatch.setattr(rows_module, "PARALLEL_PRODUCT_MACS", threshold)
        cache = LayerCache.empty(args, 0, 1, torch.float32, torch.device("cpu"))
        with torch.inference_mode():  # the context's keys: the indexer's own, appended as a prompt would
            cache.append(torch.zeros(1, context, args.kv_lora_rank), torch.zeros(1, context, args.qk_rope_head_dim))
            cache.append_index_key(indexer.keys(prompt, *rope_tables(args, 0, context, prompt.device)))
        results[threshold] = select(indexer, args, x, q_latent, cache, context)
    (parallel, parallel_threads), (alone, alone_threads) = results.values()
    assert parallel_threads and set(parallel_threads) == {torch.get_num_threads()}
    assert set(alone_threads) == {1}
    assert parallel.shape == (1, new_positions, args.index_topk) and torch.equal(parallel, alone)


def threads_entered(monkeypatch) -> list[int]:
    """The torch thread counts that torch_on_kernel_threads set, as it is entered (a spy)."""
    entered: list[int] = []
    original = rows_module.torch_on_kernel_threads

    def spy():
        entered.append(rows_module.kernel_threads())
        return original()

    monkeypatch.setattr(rows_module, "torch_on_kernel_threads", spy)
    return entered


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_prefill_attention_over_key_blocks_keeps_one_threads_bits(form, monkeypatch):
    """S = 37 queries against T = 1300 cached positions in key blocks of 1132 (a ragged last block of 168:
    the exp of the online softmax meets a tail), 16 heads, a causal mask with DSA's chosen positions."""
    torch.manual_seed(1)
    seqlen, heads, nope, rope, v, rank, total = 37, 16, 64, 32, 64, 256, 1300
    assert key_block(seqlen, heads) == 3542 and total % 32  # one 8 MiB block: force several below
    monkeypatch.setattr("engine.mla.prefill.KEY_BLOCK_BYTES", seqlen * heads * 4 * 1132)
    q_nope, q_rope = torch.randn(seqlen, heads, nope), torch.randn(seqlen, heads, rope)
    latents, rope_keys = torch.randn(total, rank), torch.randn(total, rope)
    selection = torch.stack([torch.randperm(total - seqlen + s + 1)[:300] for s in range(seqlen)])
    wkv_b = torch.nn.Linear(rank, heads * (nope + v), bias=False)
    kv_b = wkv_b.weight.view(heads, nope + v, rank)
    results = []
    for threshold in (rows_module.PARALLEL_PRODUCT_MACS, 1 << 62):
        monkeypatch.setattr(rows_module, "PARALLEL_PRODUCT_MACS", threshold)
        # then no exp split either (the ragged last block, 37 x 16 x 168, is split on aligned parts before)
        monkeypatch.setattr(rows_module, "ELEMENTWISE_ALIGN", 64 if threshold < 1 << 62 else 1 << 62)
        entered = threads_entered(monkeypatch)
        with torch.inference_mode(), torch_on_one_thread():
            args = (q_nope, q_rope, latents, rope_keys, total - seqlen, selection)
            if form == "expanded":
                out = expanded_blocks(*args, block_expansion(wkv_b, 0), 0.1)
            else:
                out = absorbed_blocks(*args, (kv_b[:, :nope], kv_b[:, nope:]), 0.1)
        results.append((out, entered))
    (parallel, parallel_threads), (alone, alone_threads) = results
    assert parallel_threads and set(parallel_threads) == {torch.get_num_threads()} and not alone_threads
    assert torch.equal(parallel, alone)


def _exp_values(shape: tuple[int, ...]) -> torch.Tensor:
    """Scores after the online softmax's shift: mostly in [-90, 0], some -inf (masked), zeros (the row's
    best) and values whose exp is subnormal or 0."""
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(shape, generator=gen).mul_(-90.0)
    flat = x.view(-1)
    picks = torch.randint(0, flat.numel(), (flat.numel() // 50,), generator=gen)
    flat[picks[0::3]] = float("-inf")
    flat[picks[1::3]] = 0.0
    flat[picks[2::3]] = -104.0
    return x


@pytest.mark.parametrize(
    "shape, on_threads",
    [((16, 256, 512), True), ((16, 64, 1024), True), ((16, 37, 1132), False), ((3, 5, 7), False)],
)
def test_exp_goes_on_the_threads_only_where_the_split_keeps_one_threads_bits(shape, on_threads, monkeypatch):
    """elementwise_on_threads: a block of scores whose split falls on ELEMENTWISE_ALIGN boundaries runs its exp
    on the kernel threads with the bits one thread gives; a ragged or small one stays on one thread."""
    x = _exp_values(shape)
    entered = threads_entered(monkeypatch)
    with torch_on_one_thread():
        alone = x.clone().exp_()
        with rows_module.elementwise_on_threads(x):
            split = x.clone().exp_()
    assert entered == ([torch.get_num_threads()] if on_threads else [])
    assert torch.equal(split, alone) and not split.isnan().any()


def test_a_prompt_in_chunks_keeps_one_threads_bits_in_every_family(loaded, family, monkeypatch):
    """Every product of a chunked prompt on the kernel threads (threshold 0) against none: the same logits
    and the same cache, bit for bit (MLA's whole-cache and key-block paths, absorbed and expanded, DSA; the
    MLA caches' rows compared, DeepSeek-V4's windowed cache by its logits)."""
    prompt = torch.tensor([[(7 * i + 3) % loaded.args.vocab_size for i in range(45)]])
    results = []
    for threshold in (0, 1 << 62):
        monkeypatch.setattr(rows_module, "PARALLEL_PRODUCT_MACS", threshold)
        monkeypatch.setattr("engine.mla.prefill.KEY_BLOCK_BYTES", 4096)  # several key blocks
        cache = loaded.model.new_cache()
        logits = loaded.model.forward_prompt(prompt, 0, cache, loaded.experts, 16)
        results.append((logits, [] if family == "deepseek_v4" else cache.log_view().rows(0, cache.length)))
    (parallel, parallel_rows), (alone, alone_rows) = results
    assert torch.equal(parallel, alone)
    assert all(torch.equal(a, b) for a, b in zip(parallel_rows, alone_rows, strict=True))


def test_a_shared_core_keeps_products_on_one_thread(monkeypatch):
    """Beside another busy process a torch product waits for its slowest thread (the demo's prompts took
    1.7-1.8x as long on 2 threads): where the kernels' helper thread finds its core shared, none goes."""
    entered = threads_entered(monkeypatch)
    monkeypatch.setattr(rows_module, "cores_shared", lambda: True)
    with rows_module.products_on_threads(1 << 40):
        pass
    monkeypatch.setattr(rows_module, "cores_shared", lambda: False)
    with rows_module.products_on_threads(1 << 40):
        pass
    with rows_module.products_on_threads(rows_module.PARALLEL_PRODUCT_MACS - 1):
        pass
    assert entered == [torch.get_num_threads()]


def test_the_helper_thread_gives_a_verdict_on_its_core_after_a_kernel_call(monkeypatch):
    """engine/csrc/split.c: the helper measures its share of the core while it polls after a job; the verdict
    is a bool while recent, None once older than asked (or before any)."""
    from engine.kernels import _kernels

    monkeypatch.undo()  # the real verdict
    for share, verdict in [(1.0, False), (0.5, True)]:
        # the helper's share given (split.c split_give_load): the verdict does not depend on the machine's load
        _kernels.split_give_load(share, 0, 0)
        try:
            # none measured yet, or (a helper still polling after an earlier job) measured with the share given
            assert _kernels.cores_shared(10**12) in (None, verdict)
            # a job whose block the helper surely runs (a kernel call's blocks may all go to the caller
            # while the scheduler has the helper off); after it, the helper measures while it polls
            deadline = time.monotonic() + 60.0
            while _kernels.split_probe(0, False, True) == 0 and time.monotonic() < deadline:
                pass
            while _kernels.cores_shared(10**12) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _kernels.cores_shared(10**12) is verdict
            _kernels.split_end_solo(1)  # a solo period the probe's join may have started (a shared core) is over
            assert _kernels.cores_shared(0) is None  # older than asked
        finally:
            _kernels.split_give_load(-1, -1, 0)
