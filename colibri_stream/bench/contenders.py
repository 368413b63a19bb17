"""Sections 2 and 3 of the bench: one fresh process per measured configuration, ours and the peer's.

Ours is the real CLI (`colibri-stream run`) and the peer is `python -m colibri_stream.bench.peer`
(transformers + accelerate disk offload), each in its own process under the same memory limit, so
model load, compute and the page cache behave as for a user. Rows report the decode phase only
(counters copied at the first token): the prompt's reads are in ``ttft_s``, not in bytes per token.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from colibri_stream.bench.system import MemoryLimit, ProcessRun, cli_argv, drop_page_cache
from storage.tiers.policy import DEFAULT_POLICY


@dataclass(frozen=True)
class OurConfig:
    budget_pct: int  # RAM for expert slots, % of the int4 container's routed-expert bytes
    policy: str = DEFAULT_POLICY  # what `run` does without --policy
    prefetch: bool = True
    cold: bool = True  # page cache dropped before the process starts
    # which container: int4 (ours, bf16 dense), int4-int8dense (dense int8 records) or bf16 (4x the bytes)
    container: str = "int4"
    activations: str = "float32"  # int8: --activations int8 (with int4-int8dense: llama.cpp's Q4_0 + Q8_0 match)
    # --ram auto (the default) instead of budget_pct's bytes: the slots whatever the memory limit leaves
    auto_ram: bool = False

    @property
    def name(self) -> str:
        fetch = "prefetch" if self.prefetch else "no-prefetch"
        act = {"int8": " int8-act", "int8-tiles": " int8-tiles"}.get(self.activations, "")
        ram = " ram-auto" if self.auto_ram else ""
        return f"{self.container}{act} {self.budget_pct}%{ram} {self.policy} {fetch} {'cold' if self.cold else 'warm'}"


@dataclass(frozen=True)
class RunInputs:
    ids: list[int]
    new_tokens: int
    timeout_s: float


def our_argv(container: Path, config: OurConfig, ram_bytes: int, inputs: RunInputs, extra: list[str]) -> list[str]:
    argv = cli_argv(
        "run",
        str(container),
        "--ids",
        ",".join(map(str, inputs.ids)),
        "--max-new-tokens",
        str(inputs.new_tokens),
        "--no-prefix-cache",
    )
    ram = "auto" if config.auto_ram else f"{ram_bytes}B"
    argv += ["--ram", ram, "--policy", config.policy, "--activations", config.activations, "--json", *extra]
    return argv + ["--prefetch" if config.prefetch else "--no-prefetch"]  # said either way: the row is named by it


def run_ours(
    container: Path,
    config: OurConfig,
    ram_bytes: int,
    inputs: RunInputs,
    limit: MemoryLimit,
    extra: Sequence[str] = (),
) -> dict:
    """One measured run; ``extra`` adds flags such as --trace or --history."""
    dropped = drop_page_cache() if config.cold else False
    done = limit.run(our_argv(container, config, ram_bytes, inputs, list(extra)), inputs.timeout_s)
    return our_row(config, ram_bytes, done, dropped)


def our_row(config: OurConfig, ram_bytes: int, done: ProcessRun, dropped: bool) -> dict:
    out = json.loads(done.last_json_line())
    stats, decode = out["stats"], out["stats"]["decode_phase"]
    tokens = max(1, stats["decode_tokens"])
    requests = max(1, decode["expert_requests"])
    return {
        "contender": "colibri-stream",
        "name": config.name,
        **asdict(config),
        "ram_bytes": None if config.auto_ram else ram_bytes,
        "ram_slots": stats.get("ram_slots"),  # what --ram (auto or a size) gave the store
        "ids": out["ids"],
        "ttft_s": stats["ttft_s"],
        "decode_tok_per_s": stats["decode_tok_per_s"],
        "hit_rate": round((decode["hits"]["ram"] + decode["hits"]["vram"]) / requests, 4),
        "hit_rate_with_prompt": round(
            (stats["hits"]["ram"] + stats["hits"]["vram"]) / max(1, stats["expert_requests"]), 4
        ),
        "bytes_per_token": decode["expert_bytes_read"] // tokens,  # expert records the store read
        "disk_bytes_per_token": decode["disk_read_bytes"] // tokens,  # what the kernel read from the device
        "io_wait_share": round(decode["io_wait_s"] / stats["decode_s"], 4) if stats["decode_s"] else 0.0,
        "prefetch_recall": decode["prefetch_recall"],
        "peak_group_bytes": done.peak_bytes,
        "hit_memory_limit": done.hit_limit,
        "page_cache_dropped": dropped,
        "wall_s": round(done.wall_s, 2),
    }


def run_peer_contender(
    model_dir: Path, budget_pct: int, max_memory: int, inputs: RunInputs, limit: MemoryLimit, offload: Path
) -> dict:
    """transformers + accelerate at ``max_memory`` bytes of resident weights, cold, in the same limit."""
    shutil.rmtree(offload, ignore_errors=True)
    dropped = drop_page_cache()
    argv = [sys.executable, "-m", "colibri_stream.bench.peer", str(model_dir)]
    argv += ["--ids", ",".join(map(str, inputs.ids)), "--max-new-tokens", str(inputs.new_tokens)]
    argv += ["--max-memory", str(max_memory), "--offload-folder", str(offload), "--cold"]
    try:
        done = limit.run(argv, inputs.timeout_s)
        out = json.loads(done.last_json_line())
    finally:
        shutil.rmtree(offload, ignore_errors=True)  # as large as the offloaded weights
    return {
        "contender": "transformers+accelerate",
        "name": f"accelerate {budget_pct}% cold",
        "budget_pct": budget_pct,
        "cold": True,
        "max_memory_bytes": max_memory,
        "ids": out["ids"],
        "ttft_s": round(out["ttft_s"], 6),
        "decode_tok_per_s": round(out["decode_tok_per_s"], 4),
        "disk_bytes_per_token": int(out["read_bytes_per_token"]),
        "load_s": round(out["load_s"], 2),
        "offloaded_bytes": out["offloaded_bytes"],
        "offload_folder_bytes": out["offload_folder_bytes"],  # transformers 5 re-saves fused experts at load
        "peak_anon_bytes": out["peak_anon_bytes"],
        "dtype": out["dtype"],
        "device_map": out["device_map_summary"],
        "peak_group_bytes": done.peak_bytes,
        "hit_memory_limit": done.hit_limit,
        "page_cache_dropped": dropped,
        "wall_s": round(done.wall_s, 2),
    }
