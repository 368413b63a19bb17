"""Placement maths: what lands where (dense, KV, expert slots per tier), computed from a model's
geometry (a container, or the container a checkpoint / config.json would convert to) before anything
loads; `plan`, `run` and `doctor` all ask here, and all get their verdict from ``verdict``.

Expected decode speed (``expected_speed``), from this machine's measured bandwidths:
    slowest (every routed expert missed) = 1 / (disk bytes per token at 0% hits / disk bandwidth
                                                 + bytes touched per token / memory bandwidth)
    fastest (every routed expert hit)    = 1 / (bytes touched per token / memory bandwidth)
    bytes touched per token = dense weights a decode step reads (all but the embedding table)
                              + top-k expert records per MoE layer
Compute, the KV cache and the VRAM tier are left out: the range bounds a memory-bound decode. A model's
MTP modules (engine/mla/mtp.py) are held, in the dense and expert bytes, but a plain decode step does not
run them (drafting is opt-in): they are not in the bytes per token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from colibri_stream.checkpoint.dtypes import COMPUTE_DTYPES, FLOAT32_PARAMETERS
from colibri_stream.checkpoint.dtypes import dtype_bytes as dtype_bytes_of
from colibri_stream.errors import BudgetError
from colibri_stream.planning.activations import PREFILL_CHUNK_TOKENS, prefill_activation_bytes
from colibri_stream.planning.bandwidth import Bandwidth
from colibri_stream.planning.geometry import MTP_PREFIX, DenseArray, ModelGeometry
from colibri_stream.planning.kv_bytes import cache_bytes_per_token, held_rows_bytes
from colibri_stream.planning.machine_memory import memory_here
from engine.config.args import ModelArgs
from engine.families import meta_transformer
from engine.kernels.bf16 import bf16_candidates, bf16_kernel_available, linear_candidates
from storage.container.reader import Container
from storage.tiers.config import StoreConfig
from storage.tiers.tiered import slots_for

# Measured here: the process after importing torch and running a first step (code pages, pools).
RUNTIME_BASELINE_BYTES = 330 * 2**20
EMBEDDING = "embed.weight"  # one row per token is read, not the table


@dataclass(frozen=True)
class Placement:
    model: str  # what the numbers describe (ModelGeometry.description)
    dense_bytes: int
    dense_bytes_per_token: int
    kv_bytes_per_token: int
    max_context: int  # the context planned for: --context, or the model's max_position_embeddings
    kv_bytes_at_max_context: int  # for every sequence held at once (serve: its slots and held sessions)
    kv_sequences: int
    prefill_chunk_tokens: int
    activation_bytes: int
    expert_record_bytes: int
    expert_bytes: int
    moe_layers: int
    experts_per_layer: int
    experts_per_token: int
    ram_budget_bytes: int
    ram_slots: int
    minimum_ram_slots: int
    vram_budget_bytes: int
    vram_slots: int
    cached_fraction: float  # of all expert records, RAM + VRAM slots
    policy: str
    prefetch: bool
    bytes_per_token_at_zero_hits: int
    expected_peak_rss_bytes: int
    machine_ram_bytes: int
    available_ram_bytes: int
    memory_limited_by: str | None  # the memory cgroup limit that capped the two above, if one did
    # The multi-token-prediction modules (speculative decoding's drafter), counted in dense_bytes and
    # expert_bytes above; mtp_left_out: those the model ships that are not held (--no-mtp, or not in the
    # checkpoint)
    mtp_layers: int
    mtp_dense_bytes: int
    mtp_expert_bytes: int
    mtp_left_out: int


@dataclass(frozen=True)
class Machine:
    """RAM of the machine planned for: this one unless given (tools/plan_table.py). Here, the memory
    cgroup's limit and headroom where they are lower than the machine's (planning/machine_memory.py)."""

    total_bytes: int
    available_bytes: int  # MemAvailable, or the cgroup's headroom
    limited_by: str | None = None  # the cgroup limit's file, where it set the numbers

    @classmethod
    def here(cls) -> Machine:
        memory = memory_here()
        return cls(memory.total_bytes, memory.available_bytes, None if memory.cap is None else memory.cap.source)


@dataclass(frozen=True)
class Speed:
    """Expected decode tokens/s between every expert missed (low) and every expert hit (high)."""

    low_tok_per_s: float
    high_tok_per_s: float
    memory_bytes_per_s: float
    disk_bytes_per_s: float
    disk_method: str


@dataclass(frozen=True)
class Verdict:
    fits: bool
    line: str  # "fits" / "fits with N% of experts cached" / "does not fit: <why>"


def bf16_held_weights(container: Container, args: ModelArgs, dtype: torch.dtype) -> set[str]:
    """The dense arrays a float32 model on this CPU keeps in bf16 (see ``held_in_bf16``)."""
    dense = tuple(DenseArray(name, tuple(e.shape), e.dtype, e.group_size) for name, e in container.dense.items())
    return held_in_bf16(dense, args, dtype)


def held_in_bf16(dense: tuple[DenseArray, ...], args: ModelArgs, dtype: torch.dtype) -> set[str]:
    """bf16-stored arrays that are candidates of engine.kernels.bf16 (bias-free Linears used only through
    forward), when the model computes in float32 and the C kernel exists; else none."""
    if dtype != torch.float32 or not bf16_kernel_available():
        return set()
    candidates = _bf16_candidates(args)
    return {a.name for a in dense if a.dtype == "bfloat16" and a.name in candidates}


@functools.cache
def _bf16_candidates(args: ModelArgs) -> frozenset[str]:
    return frozenset(bf16_candidates(meta_transformer(args)))


@functools.cache
def _linear_candidates(args: ModelArgs) -> frozenset[str]:
    """The Linears the loader keeps as codes with int8 activations (runtime/loader.py _load_dense)."""
    return frozenset(linear_candidates(meta_transformer(args)))


def resident_bytes(geometry: ModelGeometry, dtype: str, int8_activations: bool = False) -> dict[str, int]:
    """Bytes of each dense array once loaded, as the loader holds it (float32-only parameters, bf16-held
    Linears, int8/int4 Linears kept as their codes with int8 activations, everything else in the compute
    dtype)."""
    held = held_in_bf16(geometry.dense, geometry.args, COMPUTE_DTYPES[dtype])
    coded = _linear_candidates(geometry.args) if int8_activations else frozenset()
    compute = dtype_bytes_of(dtype)

    def size(a: DenseArray) -> int:
        if a.group_size is not None and a.name in coded:
            return a.coded_bytes
        per = 4 if a.name.endswith(FLOAT32_PARAMETERS) else 2 if a.name in held else compute
        return a.numel * per

    return {a.name: size(a) for a in geometry.dense}


def plan(
    geometry: ModelGeometry,
    config: StoreConfig,
    dtype: str = "float32",
    machine: Machine | None = None,
    sequences: int = 1,
    context: int | None = None,
    int8_activations: bool = False,
) -> Placement:
    """Where everything goes. ``sequences``: KV caches held at once, each up to the context (1 for run and
    chat; serve holds its batch and its sessions kept in memory). ``context``: the positions KV and
    activations are sized for (budget.planned_context; None: the model's max_position_embeddings).
    ``int8_activations``: int8/int4 dense records stay codes (--activations int8), not dequantised."""
    args, record = geometry.args, geometry.record_bytes
    resident = resident_bytes(geometry, dtype, int8_activations)
    dense = sum(resident.values())
    mtp_dense = sum(size for name, size in resident.items() if name.startswith(MTP_PREFIX))
    embedding_row = args.dim * dtype_bytes_of(dtype) if EMBEDDING in resident else 0
    per_token = dense - mtp_dense - resident.get(EMBEDDING, 0) + embedding_row
    kv_token = cache_bytes_per_token(args, dtype)
    machine = machine or Machine.here()
    context = args.max_position_embeddings if context is None else context
    kv_max = (kv_token * context + held_rows_bytes(args, dtype)) * sequences
    held = held_in_bf16(geometry.dense, args, COMPUTE_DTYPES[dtype])
    activations = prefill_activation_bytes(
        args,
        COMPUTE_DTYPES[dtype],
        PREFILL_CHUNK_TOKENS,
        context,
        # the head sees one row per chunk (prefill keeps only the last position): the C kernel, no upcast
        [a.shape for a in geometry.dense if a.name in held - {"head.weight"}],
    )
    unplaced = Placement(
        model=geometry.description,
        dense_bytes=dense,
        dense_bytes_per_token=per_token,
        kv_bytes_per_token=kv_token,
        max_context=context,
        kv_bytes_at_max_context=kv_max,
        kv_sequences=sequences,
        prefill_chunk_tokens=PREFILL_CHUNK_TOKENS,
        activation_bytes=activations,
        expert_record_bytes=record,
        expert_bytes=geometry.expert_bytes,
        moe_layers=geometry.n_moe_layers,
        experts_per_layer=geometry.experts_per_layer,
        experts_per_token=args.n_activated_experts,
        ram_budget_bytes=0,  # the store's part: with_store
        ram_slots=0,
        minimum_ram_slots=geometry.minimum_slots,
        vram_budget_bytes=0,
        vram_slots=0,
        cached_fraction=0.0,
        policy="",
        prefetch=False,
        bytes_per_token_at_zero_hits=geometry.active_records_per_token * record,
        expected_peak_rss_bytes=0,
        machine_ram_bytes=machine.total_bytes,
        available_ram_bytes=machine.available_bytes,
        memory_limited_by=machine.limited_by,
        mtp_layers=args.n_mtp_layers,
        mtp_dense_bytes=mtp_dense,
        mtp_expert_bytes=geometry.mtp_records * record,
        mtp_left_out=geometry.mtp_left_out,
    )
    return with_store(unplaced, config, geometry.total_records)


def with_store(placement: Placement, config: StoreConfig, total_records: int) -> Placement:
    """``placement`` with ``config``'s tiers: the store's part of a plan, cheap where the rest is not (it
    builds the model on the meta device), so a command sizes `auto` RAM from one plan and places it after."""
    p, record = placement, placement.expert_record_bytes
    ram_slots = min(slots_for(config.ram_bytes, record), total_records)
    vram_slots = min(slots_for(config.vram_bytes, record), total_records)
    return replace(
        p,
        ram_budget_bytes=config.ram_bytes,
        ram_slots=ram_slots,
        vram_budget_bytes=config.vram_bytes,
        vram_slots=vram_slots,
        cached_fraction=min(1.0, (ram_slots + vram_slots) / total_records),
        policy=config.policy,
        prefetch=config.prefetch,
        expected_peak_rss_bytes=RUNTIME_BASELINE_BYTES
        + p.dense_bytes
        + ram_slots * record
        + p.kv_bytes_at_max_context
        + p.activation_bytes,
    )


def floor_bytes(placement: Placement) -> int:
    return placement.minimum_ram_slots * placement.expert_record_bytes


def refusal(placement: Placement) -> str | None:
    """Why this placement cannot run, with the numbers; None when it can."""
    p = placement
    needed = p.dense_bytes + p.kv_bytes_at_max_context + p.activation_bytes + floor_bytes(p)
    if needed > p.available_ram_bytes:
        return (
            f"RAM available {_gib(p.available_ram_bytes)} < dense {_gib(p.dense_bytes)} + KV "
            f"{_gib(p.kv_bytes_at_max_context)} at {p.max_context} tokens + prefill activations "
            f"{_gib(p.activation_bytes)} + the floor of {p.minimum_ram_slots} expert records "
            f"{_gib(floor_bytes(p))} = {_gib(needed)}"
        )
    if p.ram_slots < p.minimum_ram_slots:
        return (
            f"RAM budget {_gib(p.ram_budget_bytes)} holds {p.ram_slots} expert records; "
            f"the minimum is {p.minimum_ram_slots} (one token's routed experts: {_gib(floor_bytes(p))})"
        )
    if p.ram_budget_bytes + p.dense_bytes > p.machine_ram_bytes:
        return f"RAM budget {_gib(p.ram_budget_bytes)} + dense weights {_gib(p.dense_bytes)} exceed {_machine(p)}"
    return None


def _machine(p: Placement) -> str:
    if p.memory_limited_by is None:
        return f"this machine's {_gib(p.machine_ram_bytes)}"
    return f"the memory limit of {_gib(p.machine_ram_bytes)} ({p.memory_limited_by})"


def verdict(placement: Placement) -> Verdict:
    """The one verdict line `plan` and `doctor` print."""
    why = refusal(placement)
    if why is not None:
        return Verdict(False, f"does not fit: {why}")
    if placement.cached_fraction >= 1.0:
        return Verdict(True, "fits")
    return Verdict(True, f"fits with {_percent(placement.cached_fraction)} of experts cached")


def check_fits(placement: Placement) -> None:
    """Refuse budgets below the floor or beyond the machine, with the computed numbers."""
    why = refusal(placement)
    if why is not None:
        raise BudgetError(why)


def expected_speed(placement: Placement, bandwidth: Bandwidth) -> Speed:
    """Decode tokens/s bounds from measured bandwidths (the formula is in this module's docstring)."""
    touched = placement.dense_bytes_per_token + placement.bytes_per_token_at_zero_hits
    hit_s = touched / bandwidth.memory_bytes_per_s
    miss_s = placement.bytes_per_token_at_zero_hits / bandwidth.disk_bytes_per_s + hit_s
    return Speed(1 / miss_s, 1 / hit_s, bandwidth.memory_bytes_per_s, bandwidth.disk_bytes_per_s, bandwidth.disk_method)


def _rate(tok_per_s: float) -> str:
    """Two significant digits without exponents: 0.071, 2.6, 840."""
    return f"{tok_per_s:.0f}" if tok_per_s >= 100 else f"{tok_per_s:.2g}"


def _percent(fraction: float) -> str:
    """Whole percent, rounded down (never 100% when some expert is not cached); "<1%" below one."""
    return "<1%" if fraction < 0.01 else f"{int(fraction * 100)}%"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def mtp_line(placement: Placement) -> str | None:
    """What the multi-token-prediction modules add, or that they are left out; None for a model without."""
    p = placement
    if p.mtp_layers:
        layers, them = ("1 layer", "it") if p.mtp_layers == 1 else (f"{p.mtp_layers} layers", "them")
        return (
            f"multi-token prediction       {layers} for speculative decoding: {_gib(p.mtp_dense_bytes)} dense + "
            f"{_gib(p.mtp_expert_bytes)} routed experts of the sizes above (--no-mtp leaves {them} out)"
        )
    if p.mtp_left_out:
        layers = "1 layer" if p.mtp_left_out == 1 else f"{p.mtp_left_out} layers"
        return (
            f"multi-token prediction       none: the model ships {layers}, left out (--no-mtp, or not in the "
            "checkpoint); no speculative decoding"
        )
    return None


def describe(placement: Placement, speed: Speed | None = None) -> str:
    p = placement
    mtp = mtp_line(p)
    lines = [
        f"model                        {p.model}",
        f"dense weights (resident)     {_gib(p.dense_bytes)} ({_gib(p.dense_bytes_per_token)} read per token)",
        f"KV cache                     {p.kv_bytes_per_token} B/token, "
        f"{_gib(p.kv_bytes_at_max_context)} at {p.max_context} tokens"
        + (f" x {p.kv_sequences} sequences" if p.kv_sequences > 1 else ""),
        f"activations                  {_gib(p.activation_bytes)} (prefill in chunks of {p.prefill_chunk_tokens} "
        f"tokens, at {p.max_context} tokens)",
        f"routed experts (on disk)     {_gib(p.expert_bytes)}: {p.moe_layers} layers x {p.experts_per_layer} "
        f"records of {p.expert_record_bytes / 2**20:.2f} MiB, {p.experts_per_token} per token",
        *([mtp] if mtp else []),  # beside the bytes it adds to
        f"RAM tier                     {_gib(p.ram_budget_bytes)}: {p.ram_slots} slots (min {p.minimum_ram_slots})",
        f"VRAM tier                    {_gib(p.vram_budget_bytes)} = {p.vram_slots} slots",
        f"experts cached               {p.cached_fraction:.1%}",
        f"policy / prefetch            {p.policy} / {'on' if p.prefetch else 'off'}",
        f"disk per token at 0% hits    {p.bytes_per_token_at_zero_hits / 2**20:.1f} MiB",
        f"expected peak RSS            {_gib(p.expected_peak_rss_bytes)} ({_machine(p)}, "
        f"available {_gib(p.available_ram_bytes)})",
    ]
    if speed is not None:
        lines.append(
            f"expected decode              {_rate(speed.low_tok_per_s)}-{_rate(speed.high_tok_per_s)} tok/s "
            f"(0%-100% hits; disk {speed.disk_bytes_per_s / 1e9:.2f} GB/s {speed.disk_method}, "
            f"memory {speed.memory_bytes_per_s / 1e9:.1f} GB/s)"
        )
    lines.append(verdict(p).line)
    return "\n".join(lines)
