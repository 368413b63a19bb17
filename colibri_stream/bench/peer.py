"""The peer of `colibri-stream bench`: transformers + accelerate disk offload under the same RAM budget.

What an ordinary user does with a model bigger than RAM and no GPU is `from_pretrained(...,
device_map="auto", max_memory={"cpu": budget}, offload_folder=dir)`: accelerate keeps what fits in
the budget resident and maps the rest to "disk". This module runs exactly that documented path, decodes
greedily with a plain KV-cache loop, and measures what the comparison needs: load time, time to first
token, decode tok/s, block-device bytes read per decoded token (/proc/self/io `read_bytes`: what
missed the page cache) and peak memory.

How the peer really moves bytes (transformers 5.23, accelerate 1.15, safetensors 0.8): at load the
per-expert tensors are fused into 3-D parameters, so the experts of offloaded layers are re-saved into
the offload folder (the other offloaded weights are indexed in the checkpoint itself). On each forward
accelerate's hooks fetch a module's weights with safetensors `get_tensor`, which returns a view of a
file mmap, not a copy: the kernel pages in only what the compute touches (the routed experts' slices,
plus read-around), and the page cache is the peer's expert cache. In float32 the bf16 weights read
from the checkpoint are upcast copies and the re-saved experts take twice the bytes.

Run it as its own process (the bench puts it in a memory cgroup), so memory and I/O counters are its own:
python -m colibri_stream.bench.peer MODEL --ids 1,2,3 --max-new-tokens N --max-memory BYTES --offload-folder DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from colibri_stream.checkpoint.dtypes import COMPUTE_DTYPES
from colibri_stream.runtime.memory import PeakSampler, anon_rss_bytes, disk_read_bytes, disk_write_bytes, peak_rss_bytes
from storage.files.page_cache import drop_cached


def _tree_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def evict_page_cache(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache, so pages cached by another process (and charged to
    another cgroup, beyond this one's budget) cannot serve the peer's reads for free."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                drop_cached(fd)  # fadvise where the OS has it (not macOS)
            finally:
                os.close(fd)


def _load(model_dir: Path, max_memory_bytes: int, offload_folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    # The documented big-model path and nothing else: low_cpu_mem_usage and offload_state_dict are
    # silently dropped by transformers 5, `dtype` replaces `torch_dtype`, offload_buffers keeps its
    # default (False: buffers such as rotary tables stay resident, they are tiny).
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        device_map="auto",
        max_memory={"cpu": max_memory_bytes},
        offload_folder=str(offload_folder),
        dtype=dtype,
    )
    return model.eval()


def _device_map(model: torch.nn.Module) -> dict[str, str]:
    # transformers sets hf_device_map only when the model spans devices; otherwise it is all on CPU.
    return {name: str(dev) for name, dev in getattr(model, "hf_device_map", {"": "cpu"}).items()}


def _offloaded_bytes(model: torch.nn.Module, device_map: dict[str, str]) -> int:
    """Bytes of parameters whose module accelerate placed on "disk" (their dtype is the compute dtype)."""
    disk = [name for name, dev in device_map.items() if dev == "disk"]

    def on_disk(param_name: str) -> bool:
        return any(p == "" or param_name == p or param_name.startswith(p + ".") for p in disk)

    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if on_disk(n))


def _step(model: torch.nn.Module, ids: torch.Tensor, past: object | None) -> tuple[int, object]:
    out = model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax()), out.past_key_values


@torch.inference_mode()
def _greedy(model: torch.nn.Module, ids: list[int], max_new_tokens: int) -> dict:
    """Exactly max_new_tokens greedy tokens (no eos stop), timing and I/O split at the first token."""
    read, start = disk_read_bytes(), time.perf_counter()
    token, past = _step(model, torch.tensor([ids]), None)
    ttft, prefill_read = time.perf_counter() - start, disk_read_bytes() - read
    out = [token]
    read, start = disk_read_bytes(), time.perf_counter()
    for _ in range(max_new_tokens - 1):
        token, past = _step(model, torch.tensor([[token]]), past)
        out.append(token)
    decode_s, decode_read = time.perf_counter() - start, disk_read_bytes() - read
    decode_tokens = max_new_tokens - 1
    return {
        "ids": out,
        "ttft_s": ttft,
        "decode_s": decode_s,
        "decode_tokens": decode_tokens,
        "decode_tok_per_s": decode_tokens / decode_s if decode_tokens and decode_s > 0 else 0.0,
        "disk_read_bytes": prefill_read + decode_read,
        "prefill_read_bytes": prefill_read,
        "read_bytes_per_token": decode_read / decode_tokens if decode_tokens else 0.0,
    }


def run_peer(
    model_dir: str | Path,
    ids: list[int],
    max_new_tokens: int,
    max_memory_bytes: int,
    offload_folder: str | Path,
    dtype: str = "bfloat16",
    threads: int | None = None,
    cold: bool = False,
) -> dict:
    """Load ``model_dir`` with accelerate disk offload under ``max_memory_bytes`` and decode greedily.

    ``cold`` evicts the checkpoint from the page cache first, so every byte the peer reads is charged to
    its own cgroup. ``offload_folder`` must be empty or absent: its size after load is reported."""
    model_dir, offload_folder = Path(model_dir), Path(offload_folder)
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(COMPUTE_DTYPES)}, not {dtype!r}")
    if not ids or max_new_tokens < 1 or max_memory_bytes < 1:
        raise ValueError("need a non-empty prompt, max_new_tokens >= 1 and max_memory_bytes >= 1")
    if offload_folder.exists() and any(offload_folder.iterdir()):
        raise ValueError(f"offload folder {offload_folder} is not empty")
    if threads:
        torch.set_num_threads(threads)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if not all(0 <= i < vocab for i in ids):
        raise ValueError(f"prompt ids must lie in [0, {vocab})")
    if cold:
        evict_page_cache(model_dir)

    written, start = disk_write_bytes(), time.perf_counter()
    with PeakSampler(anon_rss_bytes, interval=0.01) as load_anon:
        model = _load(model_dir, max_memory_bytes, offload_folder, COMPUTE_DTYPES[dtype])
    load_s = time.perf_counter() - start
    device_map = _device_map(model)
    load = {
        "load_s": load_s,
        "load_peak_anon_bytes": load_anon.peak,
        "load_write_bytes": disk_write_bytes() - written,
        "offload_folder_bytes": _tree_bytes(offload_folder) if offload_folder.exists() else 0,
    }
    with PeakSampler(anon_rss_bytes, interval=0.01) as run_anon:
        result = _greedy(model, ids, max_new_tokens)
    return {
        **result,
        **load,
        "run_peak_anon_bytes": run_anon.peak,
        # VmHWM includes the mmapped safetensors (reclaimable page cache); the anon peak is what must fit.
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_anon_bytes": max(load_anon.peak, run_anon.peak),
        "offloaded_bytes": _offloaded_bytes(model, device_map),
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "device_map_summary": dict(Counter(device_map.values())),
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
    parser = argparse.ArgumentParser(prog="python -m colibri_stream.bench.peer", description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", metavar="MODEL", help="HF checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("--ids", type=_parse_ids, required=True, help="prompt token ids, e.g. 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument(
        "--max-memory", dest="max_memory_bytes", type=int, required=True, help="accelerate's CPU budget in bytes"
    )
    parser.add_argument("--offload-folder", required=True, help="empty or absent directory for offloaded weights")
    parser.add_argument("--dtype", choices=sorted(COMPUTE_DTYPES), default="bfloat16")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads")
    parser.add_argument("--cold", action="store_true", help="evict the checkpoint from the page cache first")
    args = parser.parse_args(argv)
    try:
        result = run_peer(**vars(args))
    except (ValueError, OSError, RuntimeError) as exc:
        # One line, so the bench can quote it; the traceback would bury the reason.
        print(f"bench_peer: error: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
