"""The measured llama.cpp process of `colibri-stream bench`: one GGUF file, memory-mapped, greedy decode.

What a user of llama.cpp gets on a machine whose RAM does not hold the model: the file is mmapped
(``LLAMA_LOAD_MODE_MMAP``) and the page cache is its expert cache. With ``--repack`` the CPU backend's
extra buffer types are on (llama.cpp's default): weights it can repack for faster kernels are copied
into anonymous memory at load, so the whole model must fit in RAM; without it every weight is read
through the mapping. Greedy decoding takes the argmax of the logits from the low-level API (no
sampler), so the token ids compare one to one with ours. The prompt is decoded as one batch.

Measured here (this process alone, so the counters are its own): load_s, ttft_s (prompt batch to the
first token), decode tok/s over the other tokens, block-device bytes read per decoded token
(/proc/self/io read_bytes: what missed the page cache, mmap faults included), peak RSS and peak
anonymous RSS. OpenMP's waiting policy is llama.cpp's default: the variable colibri-stream sets for
itself on import is removed before llama.cpp loads (``--omp-wait-policy`` sets one).

python -m colibri_stream.bench.llama_cpp_peer FILE.gguf --ids 1,2,3 --max-new-tokens N --threads T [--repack]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

from colibri_stream.runtime.memory import PeakSampler, anon_rss_bytes, disk_read_bytes, peak_rss_bytes
from storage.files.page_cache import drop_cached

LLAMA_LOAD_MODE_MMAP = 1  # llama.h enum llama_load_mode


class LlamaError(RuntimeError):
    pass


def _evict(path: Path) -> None:
    """Drop the file from the page cache, so pages another process cached cannot serve this one free."""
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_cached(fd)  # fadvise where the OS has it (not macOS)
    finally:
        os.close(fd)


def _load(llama_cpp, path: Path, threads: int, n_ctx: int, n_batch: int, repack: bool):
    params = llama_cpp.llama_model_default_params()
    params.load_mode = LLAMA_LOAD_MODE_MMAP
    params.use_extra_bufts = repack
    params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise LlamaError(f"llama.cpp could not load {path}")
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_batch, n_batch
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise LlamaError(f"llama.cpp could not make a context of {n_ctx} positions for {path}")
    return model, ctx


def _argmax_after(llama_cpp, ctx, tokens: list[int], n_vocab: int) -> int:
    """Decode ``tokens`` as one batch; the argmax of the last position's logits."""
    import numpy as np

    array = (llama_cpp.llama_token * len(tokens))(*tokens)
    if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(array, len(tokens))) != 0:
        raise LlamaError(f"llama_decode failed on a batch of {len(tokens)} tokens")
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
    return int(logits.argmax())


def greedy(llama_cpp, ctx, n_vocab: int, ids: list[int], max_new_tokens: int) -> dict:
    """Exactly max_new_tokens greedy tokens (no eos stop), timing and reads split at the first token."""
    read, start = disk_read_bytes(), time.perf_counter()
    token = _argmax_after(llama_cpp, ctx, ids, n_vocab)
    ttft, prefill_read = time.perf_counter() - start, disk_read_bytes() - read
    out = [token]
    read, start = disk_read_bytes(), time.perf_counter()
    for _ in range(max_new_tokens - 1):
        token = _argmax_after(llama_cpp, ctx, [token], n_vocab)
        out.append(token)
    decode_s, decode_read = time.perf_counter() - start, disk_read_bytes() - read
    tokens = max_new_tokens - 1
    return {
        "ids": out,
        "ttft_s": ttft,
        "decode_s": decode_s,
        "decode_tokens": tokens,
        "decode_tok_per_s": tokens / decode_s if tokens and decode_s > 0 else 0.0,
        "prefill_read_bytes": prefill_read,
        "read_bytes_per_token": decode_read / tokens if tokens else 0.0,
    }


def run_llama_cpp(
    gguf: str | Path,
    ids: list[int],
    max_new_tokens: int,
    threads: int,
    repack: bool = False,
    cold: bool = False,
    omp_wait_policy: str | None = None,
) -> dict:
    gguf = Path(gguf)
    if not gguf.is_file():
        raise LlamaError(f"no GGUF file at {gguf}")
    if not ids or max_new_tokens < 1 or threads < 1:
        raise ValueError("need a non-empty prompt, max_new_tokens >= 1 and threads >= 1")
    os.environ.pop("OMP_WAIT_POLICY", None)  # set by `import colibri_stream`, not by llama.cpp's user
    if omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = omp_wait_policy
    if cold:
        _evict(gguf)
    import llama_cpp  # after the environment is settled: it loads libgomp

    llama_cpp.llama_backend_init()
    start = time.perf_counter()
    with PeakSampler(anon_rss_bytes, interval=0.01) as anon:
        model, ctx = _load(llama_cpp, gguf, threads, len(ids) + max_new_tokens, max(len(ids), 1), repack)
        load_s = time.perf_counter() - start
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        if not all(0 <= i < n_vocab for i in ids):
            raise ValueError(f"prompt ids must lie in [0, {n_vocab})")
        result = greedy(llama_cpp, ctx, n_vocab, ids, max_new_tokens)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return {
        **result,
        "load_s": load_s,
        "peak_rss_bytes": peak_rss_bytes(),  # mapped file pages included (reclaimable page cache)
        "peak_anon_bytes": anon.peak,  # what must fit: repacked weights, KV, compute buffers
        "threads": threads,
        "repack": repack,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(OpenMP default)"),
        "file_bytes": gguf.stat().st_size,
        "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
    }


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, not {text!r}")
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m colibri_stream.bench.llama_cpp_peer", description=__doc__.split("\n")[0]
    )
    parser.add_argument("gguf", metavar="FILE.gguf")
    parser.add_argument("--ids", type=_parse_ids, required=True, help="prompt token ids, e.g. 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True, help="llama.cpp threads (prompt and decode)")
    parser.add_argument("--repack", action="store_true", help="llama.cpp's weight repacking (its default)")
    parser.add_argument("--cold", action="store_true", help="evict the file from the page cache first")
    parser.add_argument("--omp-wait-policy", help="OMP_WAIT_POLICY for llama.cpp (default: OpenMP's)")
    args = parser.parse_args(argv)
    try:
        result = run_llama_cpp(**vars(args))
    except (ValueError, OSError, LlamaError, ctypes.ArgumentError) as exc:
        print(f"llama_cpp_peer: error: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
