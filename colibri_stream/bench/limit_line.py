"""The limit line of the bench: the fastest decode the machine's memory allows at 100% (everything in RAM).

A decode step must read every weight it uses once: the dense part as stored (the token embedding: one
row), the top-k routed experts of every MoE layer, and the KV cache of the context so far. With all of
that in RAM, memory bandwidth / those bytes is the most tokens per second any runtime can reach here;
each contender's measured tok/s over it is the fraction of the machine it uses. Bytes come from our
container geometry for ours and from the GGUF tensor sizes for llama.cpp, so each side is charged for
its own formats (llama.cpp's dense part in Q8_0 or Q4_0, ours bf16 + int4 records).
"""

from __future__ import annotations

import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

GiB = 1 << 30
EXPERTS = re.compile(r"_exps\.weight$")  # llama.cpp's routed-expert tensors: [n_expert, rows, cols]
TOKEN_EMBEDDING = "token_embd.weight"


@dataclass(frozen=True)
class TouchedBytes:
    """Bytes one decode step reads, by kind."""

    dense: int
    experts: int
    kv: int

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.kv

    def as_dict(self) -> dict:
        return asdict(self) | {"total": self.total}


def memory_bandwidth(threads: int, total_bytes: int = GiB, repeats: int = 5) -> float:
    """Bytes/s of reading a ``total_bytes`` array split over ``threads`` threads, the median of ``repeats``:
    the read bandwidth the contenders' threads can draw. Not the best one: on a shared host some tries read
    far more than a decode step can draw for its length (docs/benchmarks-log.md, "One full run of #45's rows");
    a median drops a lone one, though a quiet stretch of seconds still moves it. A bitwise-or reduction
    over uint64 (numpy releases the GIL) does one cheap integer op per 8 bytes, so the reads, not the
    arithmetic, set the pace (a float sum measured ~30% less here)."""
    data = np.ones(total_bytes // 8, dtype=np.uint64)
    parts = np.array_split(data, threads)
    seconds = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.bitwise_or.reduce, parts))
            seconds.append(time.perf_counter() - start)
    return data.nbytes / statistics.median(seconds)


def ours_touched(
    dense_bytes_per_token: int, record_bytes: int, top_k: int, moe_layers: int, kv_bytes_per_token: int, context: int
) -> TouchedBytes:
    """Ours: the resident dense part as held (bf16 Linears, float32 norms, one embedding row), top-k int4
    expert records per MoE layer, the engine's KV cache (latent + roped key per layer) at ``context``."""
    return TouchedBytes(dense_bytes_per_token, top_k * moe_layers * record_bytes, kv_bytes_per_token * context)


def gguf_touched(
    tensors: list[tuple[str, int]], n_expert: int, top_k: int, n_vocab: int, kv_bytes: int
) -> TouchedBytes:
    """llama.cpp: every tensor as stored in the GGUF (name, bytes); expert tensors hold ``n_expert``
    experts of which ``top_k`` are read; the token embedding is read one row at a time."""
    dense = experts = 0
    for name, size in tensors:
        if EXPERTS.search(name):
            experts += size * top_k // n_expert
        elif name == TOKEN_EMBEDDING:
            dense += size // n_vocab
        else:
            dense += size
    return TouchedBytes(dense, experts, kv_bytes)


def llama_cpp_kv_bytes(n_layers: int, kv_lora_rank: int, rope_dims: int, context: int) -> int:
    """llama.cpp's MLA cache for DeepSeek (f16): the compressed latent and the roped key per layer and
    position; V is a view of it."""
    return n_layers * (kv_lora_rank + rope_dims) * 2 * context


def limit_line(bandwidth: float, touched: dict[str, TouchedBytes], measured_tok_per_s: dict[str, float]) -> dict:
    """Per contender: bytes per token, the fastest tok/s the bandwidth allows, and the measured fraction."""
    rows = {}
    for name, bytes_ in touched.items():
        fastest = bandwidth / bytes_.total
        measured = measured_tok_per_s.get(name)
        rows[name] = {
            "bytes_per_token": bytes_.as_dict(),
            "fastest_tok_per_s": round(fastest, 2),
            "measured_tok_per_s": measured,
            "fraction_of_limit": None if measured is None else round(measured / fastest, 3),
        }
    return {"memory_bandwidth_GBps": round(bandwidth / 1e9, 2), "contenders": rows}
