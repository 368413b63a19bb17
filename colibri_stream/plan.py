"""`colibri-stream plan`: what lands where, computed from metadata before anything loads."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

import psutil

from colibri_stream.budget import BudgetFileError
from colibri_stream.cli_help import help_options
from engine.args import ModelArgs
from storage.container import Container
from storage.tiered import StoreConfig, minimum_slots, slots_for, total_records

# Measured here: the process after importing torch and running a first step (code pages, pools).
RUNTIME_BASELINE_BYTES = 330 * 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Placement:
    dense_bytes: int
    kv_bytes_per_token: int
    max_context: int
    kv_bytes_at_max_context: int
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


def kv_bytes_per_token(args: ModelArgs, dtype_bytes: int) -> int:
    """Per position: latent + roped key per layer (compute dtype), indexer key per full DSA layer (float32)."""
    per_layer = (args.kv_lora_rank + args.qk_rope_head_dim) * dtype_bytes
    index = sum(args.index_head_dim * 4 for layer in range(args.n_layers) if args.has_indexer(layer))
    return args.n_layers * per_layer + index


def _bf16_held(container: Container, args: ModelArgs, dtype: str) -> set[str]:
    """The dense arrays the loaded model keeps in bf16 (colibri_stream.container_model does the same)."""
    import torch

    from colibri_stream.container_model import bf16_held_weights
    from engine.bf16 import bf16_candidates
    from engine.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    return bf16_held_weights(container, bf16_candidates(model), getattr(torch, dtype))


def plan(container: Container, config: StoreConfig, dtype: str = "float32") -> Placement:
    args = ModelArgs.from_hf_config(container.model_config)
    dtype_bytes = DTYPE_BYTES[dtype]
    held_bf16 = _bf16_held(container, args, dtype)
    dense = sum(
        math.prod(e.shape) * (2 if name in held_bf16 else 4 if e.dtype == "float32" else dtype_bytes)
        for name, e in container.dense.items()
    )
    kv_token = kv_bytes_per_token(args, dtype_bytes)
    record = container.layout.record_bytes
    ram_slots = min(slots_for(config.ram_bytes, record), total_records(container))
    return Placement(
        dense_bytes=dense,
        kv_bytes_per_token=kv_token,
        max_context=args.max_position_embeddings,
        kv_bytes_at_max_context=kv_token * args.max_position_embeddings,
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
        expected_peak_rss_bytes=RUNTIME_BASELINE_BYTES
        + dense
        + ram_slots * record
        + kv_token * args.max_position_embeddings,
        machine_ram_bytes=psutil.virtual_memory().total,
    )


def check_fits(placement: Placement) -> None:
    """Refuse budgets below the minimum or beyond the machine, with the computed numbers."""
    if placement.ram_slots < placement.minimum_ram_slots:
        raise BudgetFileError(
            f"RAM budget {_gib(placement.ram_budget_bytes)} holds {placement.ram_slots} expert records; one layer "
            f"needs {placement.minimum_ram_slots} ({_gib(placement.minimum_ram_slots * placement.expert_record_bytes)})"
        )
    if placement.ram_budget_bytes + placement.dense_bytes > placement.machine_ram_bytes:
        raise BudgetFileError(
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
        f"routed experts (on disk)     {_gib(p.expert_bytes)} in records of {p.expert_record_bytes / 2**20:.2f} MiB",
        f"RAM tier                     {_gib(p.ram_budget_bytes)}: {p.ram_slots} slots (min {p.minimum_ram_slots})",
        f"VRAM tier                    {_gib(p.vram_budget_bytes)} = {p.vram_slots} slots",
        f"policy / prefetch            {p.policy} / {'on' if p.prefetch else 'off'}",
        f"disk per token at 0% hits    {p.bytes_per_token_at_zero_hits / 2**20:.1f} MiB",
        f"expected peak RSS            {_gib(p.expected_peak_rss_bytes)} (machine: {_gib(p.machine_ram_bytes)})",
    ]
    return "\n".join(lines)


PLAN_EPILOG = """\
examples:
  colibri-stream plan MODEL.cstream --ram 25%
  colibri-stream plan MODEL.cstream --budget budgets/workstation-128g-24gvram.toml --dtype bfloat16 --json
exit status: 0 when the budget fits, 1 when it is below one layer's experts or beyond this machine
(the placement is printed first, then the reason), 2 on bad flags."""


def add_parser(commands: argparse._SubParsersAction, add_store_arguments) -> None:
    parser = commands.add_parser(
        "plan",
        help="show where dense weights, experts and KV will live, before loading",
        description="Compute the placement (dense, KV at max context, expert slots per tier, disk bytes per token "
        "at 0% hits, expected peak RSS) from a container's metadata and a budget, without loading anything.",
        **help_options(PLAN_EPILOG),
    )
    parser.add_argument("path", help="container directory")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="float32", help="compute dtype")
    parser.add_argument("--json", action="store_true", help="print the placement as one JSON object")
    add_store_arguments(parser)
    parser.set_defaults(handler=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from colibri_stream.cli_run import store_config

    container = Container(args.path)
    placement = plan(container, store_config(args, container), args.dtype)
    print(json.dumps(asdict(placement)) if args.json else describe(placement))
    check_fits(placement)
    return 0
