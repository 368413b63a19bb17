"""The prefill limit line of the bench: the fastest first token the machine's compute allows at 100%, the
compute twin of the decode limit line (limit_line.py: memory bandwidth over the bytes a step reads).

A prompt must do a fixed number of multiply-adds, whatever runtime reads it: every projection, expert and
dense MLP once per token, attention over the earlier positions (causal), the DSA indexer's scores where the
family has one, and the output head for the last token only (``prompt_multiply_adds``, from the model
geometry). With everything in RAM, the machine's multiply-adds per second in the format the prompt runs in
(int8 dot products on the int8 path, llama.cpp's Q8 activations too) over that count is the shortest time to
the first token any runtime can reach; each contender's measured TTFT over it is the fraction of the
machine's compute its prefill uses.

The peak is calibrated with kernels the engine does not use (its own C kernels: engine/kernels): torch's
``_int_mm`` (oneDNN; AMX/VNNI where present), torch's quantized linear (fbgemm/oneDNN u8 x s8, the int8
kernel that is fast on an AVX2-only CPU, where ``_int_mm`` falls back to a reference loop) and ``torch.mm``
in bf16 and fp32, each the best of several GEMM shapes within a time budget, on the threads the engine uses.
On a shared host the peak is noisy (a busy moment understates it, and then a fraction can exceed 1).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

import torch

from engine.config.args import ModelArgs

LIMIT_FORMAT = "int8"  # the format the limit line is drawn in: the int8 path's and llama.cpp's Q8 activations
# (M, K, N) of the calibration GEMMs: prompt windows (M rows) against expert- and projection-sized weights
SHAPES: tuple[tuple[int, int, int], ...] = tuple(
    (m, k, n) for m in (256, 1024) for k in (2048, 4096, 7168) for n in (2048, 4096, 7168)
)
# timed first, smallest first, each while it fits: their best rate says which of SHAPES fit a kernel's budget.
# A ladder, not one small probe: on a busy 2-core host the smallest product's time is its threads waiting to be
# scheduled, not arithmetic, and its rate alone kept every real shape out of the budget (docs/benchmarks-log.md,
# "How the bench measures", the prefill limit line)
PROBES: tuple[tuple[int, int, int], ...] = ((64, 512, 512), (128, 1024, 512), (256, 1024, 1024))
CALIBRATION_BUDGET_S = 8.0  # all kernels together; the probes and a last run past it make it ~10 s on 2 cores


@dataclass(frozen=True)
class PromptWork:
    """Multiply-adds a prompt needs, by kind."""

    experts: int  # routed experts (top-k x gate/up/down per token) and the router's scores
    shared: int  # the always-on shared experts of the MoE layers
    dense: int  # the dense layers' MLPs
    projections: int  # attention projections: q (q_a/q_b or q), kv_a, kv_b, o
    attention: int  # scores and values over the earlier positions (causal; DSA: the top-k selected)
    indexer: int  # the DSA indexer: its projections and its scores over the earlier positions
    head: int  # the output head, for the last position only

    @property
    def total(self) -> int:
        return self.experts + self.shared + self.dense + self.projections + self.attention + self.indexer + self.head

    def as_dict(self) -> dict:
        return asdict(self) | {"total": self.total}


def causal_pairs(tokens: int, window: int | None = None) -> int:
    """(query, key) pairs of a causal prompt of ``tokens`` positions (each sees itself and those before it),
    at most ``window`` keys per query (the DSA top-k) where given."""
    if window is None or window >= tokens:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def prompt_multiply_adds(args: ModelArgs, tokens: int) -> PromptWork:
    """The multiply-adds of a ``tokens``-position prompt through the main model's blocks (MTP modules left
    out: they draft during decode), MLA attention expanded (per head: q.k over qk_head_dim, weights.v over
    v_head_dim; kv_b once per position), the DSA indexer where a layer runs its own. MLA/DSA families only:
    DeepSeek-V4's compressed attention has another count."""
    if args.v4 is not None:
        raise ValueError("prompt_multiply_adds counts MLA/DSA families; DeepSeek-V4's attention is not counted")
    dim, heads = args.dim, args.n_heads
    q_out = heads * args.qk_head_dim
    q = dim * args.q_lora_rank + args.q_lora_rank * q_out if args.q_lora_rank else dim * q_out
    kv = dim * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank * heads * (
        args.qk_nope_head_dim + args.v_head_dim
    )
    projections = args.n_layers * tokens * (q + kv + heads * args.v_head_dim * dim)
    window = args.index_topk if args.has_dsa else None
    attention = args.n_layers * heads * causal_pairs(tokens, window) * (args.qk_head_dim + args.v_head_dim)
    indexer = 0
    for layer in range(args.n_layers):
        if args.has_indexer(layer):
            index_width = args.index_n_heads * args.index_head_dim
            per_token = args.q_lora_rank * index_width + dim * args.index_head_dim + dim * args.index_n_heads
            indexer += tokens * per_token + index_width * causal_pairs(tokens)
    moe = sum(1 for layer in range(args.n_layers) if args.is_moe(layer))
    expert = 3 * dim * args.moe_inter_dim
    return PromptWork(
        experts=moe * tokens * (args.n_activated_experts * expert + dim * args.n_routed_experts),
        shared=moe * tokens * args.n_shared_experts * expert,
        dense=(args.n_layers - moe) * tokens * 3 * dim * args.inter_dim,
        projections=projections,
        attention=attention,
        indexer=indexer,
        head=dim * args.vocab_size,
    )


# ------------------------------------------------------------------------------------------ calibration
def _int8_mm(m: int, k: int, n: int) -> Callable[[], object]:
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    b = torch.randint(-127, 128, (k, n), dtype=torch.int8)
    return lambda: torch._int_mm(a, b)


def _int8_quantized_linear(m: int, k: int, n: int) -> Callable[[], object]:
    with warnings.catch_warnings():  # quantized tensors are deprecated, not gone: the kernel is the point
        warnings.simplefilter("ignore")
        x = torch.quantize_per_tensor(torch.randn(m, k), 0.05, 128, torch.quint8)
        w = torch.quantize_per_tensor(torch.randn(n, k), 0.05, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(w, None)
    return lambda: torch.ops.quantized.linear(x, packed, 1.0, 0)


def _float_mm(dtype: torch.dtype) -> Callable[[int, int, int], Callable[[], object]]:
    def make(m: int, k: int, n: int) -> Callable[[], object]:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        return lambda: torch.mm(a, b)

    return make


# kernel name -> (format, maker of a call at shape (M, K, N))
KERNELS: dict[str, tuple[str, Callable[[int, int, int], Callable[[], object]]]] = {
    "int8 torch._int_mm": ("int8", _int8_mm),
    "int8 quantized.linear": ("int8", _int8_quantized_linear),
    "bf16 torch.mm": ("bf16", _float_mm(torch.bfloat16)),
    "fp32 torch.mm": ("fp32", _float_mm(torch.float32)),
}


def _rate(call: Callable[[], object], macs: int, repeats: int) -> float:
    """Multiply-adds/s of ``call``: one warm-up, then the fastest of ``repeats``."""
    call()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return macs / max(best, 1e-9)


def calibrate_kernel(
    make: Callable[[int, int, int], Callable[[], object]],
    budget_s: float,
    shapes: Iterable[tuple[int, int, int]] = SHAPES,
    repeats: int = 2,
) -> tuple[float, tuple[int, int, int]]:
    """(best multiply-adds/s, its shape) of one kernel over ``shapes``. First the PROBES while each fits what
    is left of ``budget_s`` at the fastest rate seen (the first always runs), then passes over ``shapes``
    (smallest first), each shape whose run fits, until a pass fits none: on a shared host a lone try can run
    at a fraction of the machine, so the budget buys more tries, not just more shapes. A probe's rate counts
    only where no shape fits (its weights sit in cache): a kernel that falls back to a reference loop
    (``_int_mm`` without VNNI, bf16 without AVX512-BF16) stops there."""
    start = time.perf_counter()

    def fits(shape: tuple[int, int, int], rate: float) -> bool:
        return (repeats + 1) * math.prod(shape) / rate <= budget_s - (time.perf_counter() - start)

    probe, probe_shape = 0.0, PROBES[0]
    for shape in PROBES:
        if probe > 0 and not fits(shape, probe):
            break
        rate = _rate(make(*shape), math.prod(shape), repeats)
        if rate > probe:
            probe, probe_shape = rate, shape
    best, best_shape = 0.0, probe_shape
    ordered = sorted(shapes, key=math.prod)
    measured = True
    while measured:
        measured = False
        for shape in ordered:
            if not fits(shape, max(best, probe)):
                continue
            measured = True
            rate = _rate(make(*shape), math.prod(shape), repeats)
            if rate > best:
                best, best_shape = rate, shape
    return (best, best_shape) if best > 0 else (probe, probe_shape)


def compute_peaks(
    threads: int,
    budget_s: float = CALIBRATION_BUDGET_S,
    shapes: Iterable[tuple[int, int, int]] = SHAPES,
    kernels: Mapping[str, tuple[str, Callable[[int, int, int], Callable[[], object]]]] = KERNELS,
) -> dict:
    """Each kernel's best multiply-adds/s on ``threads`` threads (``budget_s`` split evenly), and per format
    the best of its kernels: {"GMACps": {format: ...}, "kernels": {name: {"format", "GMACps", "shape"}}}.
    A kernel this torch lacks is left out."""
    shapes = tuple(shapes)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows: dict[str, dict] = {}
    try:
        for name, (fmt, make) in kernels.items():
            try:
                rate, shape = calibrate_kernel(make, budget_s / len(kernels), shapes)
            except (RuntimeError, AttributeError, NotImplementedError):  # not built into this torch
                continue
            rows[name] = {"format": fmt, "GMACps": round(rate / 1e9, 2), "shape": list(shape)}
    finally:
        torch.set_num_threads(before)
    peaks: dict[str, float] = {}
    for row in rows.values():
        peaks[row["format"]] = max(peaks.get(row["format"], 0.0), row["GMACps"])
    return {"threads": threads, "GMACps": peaks, "kernels": rows}


# ------------------------------------------------------------------------------------------- the line
def prefill_limit_line(
    peaks: dict, work: Mapping[int, PromptWork], measured_ttft_s: Mapping[str, Mapping[int, float]]
) -> dict:
    """Per prompt length: its multiply-adds and the fastest TTFT the ``LIMIT_FORMAT`` peak allows; per
    contender and length: the measured TTFT and its fraction of the limit (multiply-adds / seconds / peak).
    JSON keys of lengths are strings."""
    peak = peaks["GMACps"].get(LIMIT_FORMAT, 0.0) * 1e9
    prompts = {}
    for tokens, need in sorted(work.items()):
        fastest = need.total / peak if peak > 0 else None
        prompts[str(tokens)] = {
            "multiply_adds": need.as_dict(),
            "fastest_ttft_s": None if fastest is None else round(fastest, 4),
            "fastest_tok_per_s": None if fastest is None else round(tokens / fastest, 2),
        }
    contenders: dict[str, dict] = {}
    for name, by_length in measured_ttft_s.items():
        for tokens, seconds in sorted(by_length.items()):
            total = work[tokens].total
            contenders.setdefault(name, {})[str(tokens)] = {
                "measured_ttft_s": seconds,
                "measured_GMACps": round(total / seconds / 1e9, 2),
                "fraction_of_limit": round(total / seconds / peak, 3) if peak > 0 else None,
            }
    return {
        "limit_format": LIMIT_FORMAT,
        "threads": peaks["threads"],
        "compute_peak_GMACps": peaks["GMACps"],
        "calibration": peaks["kernels"],
        "prompts": prompts,
        "contenders": contenders,
    }


def best_prefill_ttft(prefill: Mapping[str, list[dict]], full_budget: int = 100) -> dict[str, dict[int, float]]:
    """Per contender and prompt length, the lowest TTFT of the llama_cpp section's prefill rows at 100%, page
    cache warm (the rows ``prefill_vs_*`` counts there; cold, a first token pays faulting the weights in):
    ours as "colibri-stream int8" (the int8 path), llama.cpp as "llama.cpp <file kind>" (its best mode)."""
    best: dict[str, dict[int, float]] = {}
    rows = [("colibri-stream int8", r) for r in prefill.get("ours", [])]
    rows += [(f"llama.cpp {r['file']}", r) for r in prefill.get("rows", [])]
    for name, r in rows:
        if r["budget_pct"] >= full_budget and not r["cold"] and r["ttft_s"] > 0:
            lengths = best.setdefault(name, {})
            tokens = r["prompt_tokens"]
            lengths[tokens] = min(lengths.get(tokens, math.inf), r["ttft_s"])
    return best
