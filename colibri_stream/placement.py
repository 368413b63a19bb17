"""Placement maths: what lands where (dense, KV, expert slots per tier), computed from a container's
metadata before anything loads; `plan`, `run` and `doctor` all ask here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import psutil
import torch

from colibri_stream.activations import prefill_activation_bytes
from colibri_stream.dtypes import COMPUTE_DTYPES
from colibri_stream.dtypes import dtype_bytes as dtype_bytes_of
from colibri_stream.errors import BudgetError
from colibri_stream.generate import PREFILL_CHUNK_TOKENS
from colibri_stream.kv_geometry import cache_bytes_per_token
from engine.args import ModelArgs
from engine.bf16 import bf16_candidates, bf16_kernel_available
from engine.model import meta_transformer
from storage.container import Container
from storage.tiered import StoreConfig, minimum_slots, slots_for, total_records

# Measured here: the process after importing torch and running a first step (code pages, pools).
RUNTIME_BASELINE_BYTES = 330 * 2**20


@dataclass(frozen=True)
class Placement:
    dense_bytes: int
    kv_bytes_per_token: int
    max_context: int
    kv_bytes_at_max_context: int
    prefill_chunk_tokens: int
    activation_bytes: int
    expert_record_bytes: int
    expert_bytes: int
    ram_budget_bytes: int
    ram_slots: int
    minimum_ram_slots: int
    vram_budget_bytes: int
    vram_slots: int
    policy: str
    prefetch: bool
    bytes_per_token_at_zero_hits: int
    expected_peak_rss_bytes: int
    machine_ram_bytes: int


def bf16_held_weights(container: Container, args: ModelArgs, dtype: torch.dtype) -> set[str]:
    """The dense arrays a float32 model on this CPU keeps in bf16: bf16 in the container and candidates
    of engine.bf16 (bias-free Linears used only through forward). None without the C kernel."""
    if dtype != torch.float32 or not bf16_kernel_available():
        return set()
    candidates = bf16_candidates(meta_transformer(args))
    return {name for name, entry in container.dense.items() if entry.dtype == "bfloat16" and name in candidates}


def plan(container: Container, config: StoreConfig, dtype: str = "float32") -> Placement:
    args = ModelArgs.from_hf_config(container.model_config)
    dtype_bytes = dtype_bytes_of(dtype)
    held_bf16 = bf16_held_weights(container, args, COMPUTE_DTYPES[dtype])
    dense = sum(
        math.prod(e.shape) * (2 if name in held_bf16 else 4 if e.dtype == "float32" else dtype_bytes)
        for name, e in container.dense.items()
    )
    kv_token = cache_bytes_per_token(args, dtype)
    context = args.max_position_embeddings
    activations = prefill_activation_bytes(
        args,
        COMPUTE_DTYPES[dtype],
        PREFILL_CHUNK_TOKENS,
        context,
        # the head sees one row per chunk (prefill keeps only the last position): the C kernel, no upcast
        [container.dense[name].shape for name in held_bf16 - {"head.weight"}],
    )
    record = container.layout.record_bytes
    ram_slots = min(slots_for(config.ram_bytes, record), total_records(container))
    return Placement(
        dense_bytes=dense,
        kv_bytes_per_token=kv_token,
        max_context=context,
        kv_bytes_at_max_context=kv_token * context,
        prefill_chunk_tokens=PREFILL_CHUNK_TOKENS,
        activation_bytes=activations,
        expert_record_bytes=record,
        expert_bytes=container.expert_bytes,
        ram_budget_bytes=config.ram_bytes,
        ram_slots=ram_slots,
        minimum_ram_slots=minimum_slots(container),
        vram_budget_bytes=config.vram_bytes,
        vram_slots=slots_for(config.vram_bytes, record),
        policy=config.policy,
        prefetch=config.prefetch,
        bytes_per_token_at_zero_hits=len(container.moe_layers) * args.n_activated_experts * record,
        expected_peak_rss_bytes=RUNTIME_BASELINE_BYTES + dense + ram_slots * record + kv_token * context + activations,
        machine_ram_bytes=psutil.virtual_memory().total,
    )


def check_fits(placement: Placement) -> None:
    """Refuse budgets below the minimum or beyond the machine, with the computed numbers."""
    if placement.ram_slots < placement.minimum_ram_slots:
        raise BudgetError(
            f"RAM budget {_gib(placement.ram_budget_bytes)} holds {placement.ram_slots} expert records; one layer "
            f"needs {placement.minimum_ram_slots} ({_gib(placement.minimum_ram_slots * placement.expert_record_bytes)})"
        )
    if placement.ram_budget_bytes + placement.dense_bytes > placement.machine_ram_bytes:
        raise BudgetError(
            f"RAM budget {_gib(placement.ram_budget_bytes)} + dense weights {_gib(placement.dense_bytes)} exceed "
            f"this machine's {_gib(placement.machine_ram_bytes)}"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def describe(placement: Placement) -> str:
    p = placement
    lines = [
        f"dense weights (resident)     {_gib(p.dense_bytes)}",
        f"KV cache                     {p.kv_bytes_per_token} B/token, "
        f"{_gib(p.kv_bytes_at_max_context)} at {p.max_context} tokens",
        f"activations                  {_gib(p.activation_bytes)} (prefill in chunks of {p.prefill_chunk_tokens} "
        f"tokens, at {p.max_context} tokens)",
        f"routed experts (on disk)     {_gib(p.expert_bytes)} in records of {p.expert_record_bytes / 2**20:.2f} MiB",
        f"RAM tier                     {_gib(p.ram_budget_bytes)}: {p.ram_slots} slots (min {p.minimum_ram_slots})",
        f"VRAM tier                    {_gib(p.vram_budget_bytes)} = {p.vram_slots} slots",
        f"policy / prefetch            {p.policy} / {'on' if p.prefetch else 'off'}",
        f"disk per token at 0% hits    {p.bytes_per_token_at_zero_hits / 2**20:.1f} MiB",
        f"expected peak RSS            {_gib(p.expected_peak_rss_bytes)} (machine: {_gib(p.machine_ram_bytes)})",
    ]
    return "\n".join(lines)
