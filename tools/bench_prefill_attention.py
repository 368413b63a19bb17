"""One MLA layer's prefill attention, whole-cache against key-blocked (engine/mla/prefill.py): time
and peak memory of S new positions against T cached, with the planner's estimate beside the peak.

    python tools/bench_prefill_attention.py                       # demo, stress and DeepSeek-V3 geometries
    python tools/bench_prefill_attention.py --models stress --shapes 256x4096,64x4096 --reps 9

Each measurement runs in a fresh process (spawn): random weights and cache, one warm-up forward, then
the best of --reps forwards; the peak is the rise of the process's maximum RSS over one forward made
before any other (torch's large temporaries come from mmaps that go back when freed). "whole" forces the
whole-cache path (a key block longer than any cache), "blocked" is what MLA picks. The peak also holds
the cache's growth (engine/core/cache.py doubles its buffers: the new latents and rope keys while the old are
copied), which the planner counts as KV, not here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import time
from pathlib import Path
from typing import Any

import torch

from colibri_stream.bench.stress_model import StressShape, config_for
from colibri_stream.planning.family_memory import family_memory
from colibri_stream.runtime.memory import return_large_frees_to_the_os
from engine.config.args import ModelArgs

DEMO = Path(__file__).resolve().parents[1] / "colibri_stream" / "demo_model" / "config.json"
V3_ATTENTION = {
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


def model_config(name: str) -> dict[str, Any]:
    if name == "demo":
        return dict(json.loads(DEMO.read_text()))
    stress = config_for(StressShape())
    return stress if name == "stress" else {**stress, **V3_ATTENTION, "max_position_embeddings": 163840}


def measure(name: str, seqlen: int, total: int, path: str, reps: int, dtype: str) -> tuple[float, float, int]:
    """(best seconds, best CPU seconds of the process, peak bytes) of one layer's attention, in this process.
    CPU time is the steadier figure on a shared machine (other processes stretch wall time, not it)."""
    import engine.mla.prefill as prefill_attention
    from engine.core.cache import KVCache
    from engine.core.rope import rope_tables
    from engine.mla.attention import MLA

    return_large_frees_to_the_os()
    if path == "whole":
        prefill_attention.MIN_KEY_BLOCK = 1 << 40
    torch.set_grad_enabled(False)
    args = ModelArgs.from_hf_config(model_config(name))
    compute = getattr(torch, dtype)
    torch.manual_seed(0)
    attn = MLA(args, 0)
    for p in attn.parameters():
        p.data.normal_(0, 0.05)
    attn = attn.to(compute)
    start = total - seqlen
    x = torch.randn(1, seqlen, args.dim).to(compute)
    rope = rope_tables(args, start, seqlen, x.device)

    def cache() -> Any:
        layer = KVCache.empty(args, 1, compute).layers[0]
        layer.append(
            torch.randn(1, start, args.kv_lora_rank).to(compute),
            torch.randn(1, start, args.qk_rope_head_dim).to(compute),
        )
        return layer

    caches = [cache() for _ in range(reps + 1)]  # made before the peak is taken: each forward appends
    small = KVCache.empty(args, 1, compute).layers[0]  # a warm-up on a short cache: the libraries' own set-up
    attn(x[:, :2], 0, rope_tables(args, 0, 2, x.device), small)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    attn(x, start, rope, caches[0])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    best, best_cpu = float("inf"), float("inf")
    for layer in caches[1:]:
        began, began_cpu = time.perf_counter(), time.process_time()
        attn(x, start, rope, layer)
        best, best_cpu = min(best, time.perf_counter() - began), min(best_cpu, time.process_time() - began_cpu)
    return best, best_cpu, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="demo,stress,v3", help="comma-separated: demo, stress, v3")
    parser.add_argument("--shapes", default="256x1024,256x4096,32x4096", help="SxT pairs: new x cached positions")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    spawn = multiprocessing.get_context("spawn")
    d = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    print(f"torch threads: {torch.get_num_threads()}")
    print("| model | S | T | path | ms | CPU ms | peak MiB | planned MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        family = family_memory(ModelArgs.from_hf_config(model_config(name)))
        for shape in args.shapes.split(","):
            seqlen, total = (int(v) for v in shape.split("x"))
            for path in ("whole", "blocked"):
                with spawn.Pool(1) as pool:
                    seconds, cpu, peak = pool.apply(measure, (name, seqlen, total, path, args.reps, args.dtype))
                # the planner's layer phase: attention, or the DSA indexer where that is larger
                layer = max(family.attention_bytes(d, seqlen, total), family.indexer_bytes(d, seqlen, total))
                planned = layer if path == "blocked" else None
                shown = f"{planned / 2**20:.0f}" if planned is not None else ""
                print(
                    f"| {name} | {seqlen} | {total} | {path} | {seconds * 1e3:.1f} | {cpu * 1e3:.1f} "
                    f"| {peak / 2**20:.0f} | {shown} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
