"""One decode query's absorbed MLA attention over a long cache: the int8 path's C kernel vs torch's bmm.

python tools/bench_attend.py [--heads 16 128] [--totals 256 2048 8192] [--rounds 3]

The cache is DeepSeek's shape (latent 512, rope 64, nope 128, value 128; int8 wkv_b in groups of 64);
each row times ``decode_ops.attend_one`` (what a decode step of the int8 path runs per layer) and the
exact path's five batched matmuls and softmax (engine/mla/attention.py ``_absorbed_one``) on the same
inputs, both on torch's thread count, best of ``--rounds``, in one run: the ratio is side by side.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from engine.kernels import decode_ops

NOPE, ROPE, VALUE, RANK, GROUP = 128, 64, 128, 512, 64


def best_seconds(call: Callable[[], object], rounds: int, work: int) -> float:
    for _ in range(2):
        call()
    repeats = max(3, int(2e8 / work))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def torch_attend(q_nope, q_rope, latents, rope_keys, w_k, w_v, scale):
    """engine/mla/attention.py's _absorbed_one without a selection: [H, n] ... -> [H, v]"""
    heads = q_nope.shape[0]
    q_latent = torch.bmm(q_nope.unsqueeze(1), w_k)  # [H, 1, c]
    scores = torch.bmm(q_latent.view(1, heads, RANK), latents.T[None]) + torch.bmm(q_rope[None], rope_keys.T[None])
    probs = scores.mul(scale).softmax(dim=-1)
    mixed = torch.bmm(probs, latents[None])  # [1, H, c]
    return torch.bmm(mixed.view(heads, 1, RANK), w_v.transpose(1, 2)).view(heads, VALUE)


def row(heads: int, total: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(total)
    q_nope, q_rope = torch.randn(heads, NOPE, generator=g), torch.randn(heads, ROPE, generator=g)
    latents, rope_keys = torch.randn(total, RANK, generator=g), torch.randn(total, ROPE, generator=g)
    codes = torch.randint(-127, 128, (heads * (NOPE + VALUE), RANK), dtype=torch.int8, generator=g)
    scales = torch.rand(heads * (NOPE + VALUE), RANK // GROUP, generator=g) * 1e-3
    kv_b = (codes.float().view(-1, RANK // GROUP, GROUP) * scales[..., None]).view(heads, NOPE + VALUE, RANK)
    w_k, w_v = kv_b[:, :NOPE], kv_b[:, NOPE:]
    work = heads * (total * (2 * RANK + ROPE) + (NOPE + VALUE) * RANK)  # multiply-adds of one query
    ours = best_seconds(
        lambda: decode_ops.attend_one(q_nope, q_rope, latents, rope_keys, None, codes, scales, GROUP, 0.1), rounds, work
    )
    reference = best_seconds(lambda: torch_attend(q_nope, q_rope, latents, rope_keys, w_k, w_v, 0.1), rounds, work)
    got = decode_ops.attend_one(q_nope, q_rope, latents, rope_keys, None, codes, scales, GROUP, 0.1)
    want = torch_attend(q_nope, q_rope, latents, rope_keys, w_k, w_v, 0.1)
    return {
        "heads": heads,
        "positions": total,
        "c_ms": round(ours * 1e3, 3),
        "torch_ms": round(reference * 1e3, 3),
        "c_vs_torch": round(reference / ours, 2),
        "c_gmacs": round(work / ours / 1e9, 1),  # multiply-adds a second
        "torch_gmacs": round(work / reference / 1e9, 1),
        "max_abs_diff": float((got - want).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--totals", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not decode_ops.available():
        raise SystemExit("the C kernels are not built: python setup.py build_ext --inplace")
    rows = [row(heads, total, args.rounds) for heads in args.heads for total in args.totals]
    print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
