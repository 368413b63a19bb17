"""Which worker holds which routed expert: the owner table [MoE layers, experts] -> worker rank.

By default from what each worker measured and was given: a worker first gets as many records as its RAM
slots hold, and what no RAM holds is split in proportion to the workers' disk read speeds, so every
worker's misses take about as long (time ~ records beyond RAM / disk speed); when everything fits, the
shares follow the slots. Records are dealt out by smooth weighted round robin over (layer, expert), so
each layer is split in about the same proportions and no worker gets a run of neighbouring experts.

An explicit map (``--expert-map FILE``, JSON ``{"1": [0, 1, 2, ...], "2": [...]}``: worker rank -> the
expert ids it holds in every MoE layer) overrides it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from colibri_stream.errors import ColibriError
from colibri_stream.experts.cluster.wire import Hello
from storage.files.safe_read import decode_utf8, read_bounded

MAX_MAP_BYTES = 16 << 20


def share_weights(hellos: Sequence[Hello], total_records: int) -> list[float]:
    """Records each worker should hold (fractional, summing to ``total_records``)."""
    slots = [min(h.ram_bytes // max(h.record_bytes, 1), total_records) for h in hellos]
    held = sum(slots)
    if held >= total_records:
        return [total_records * s / held for s in slots]
    speeds = [max(h.disk_bytes_per_s, 1) for h in hellos]
    per_speed = (total_records - held) / sum(speeds)
    return [s + per_speed * v for s, v in zip(slots, speeds, strict=True)]


def deal(weights: Sequence[float], ranks: Sequence[int], moe_layers: int, n_experts: int) -> torch.Tensor:
    """Owner table int64 [moe_layers, n_experts]: records dealt by smooth weighted round robin (each record
    to the worker with the most credit; credit grows by its weight and drops by the total when it takes one)."""
    total = sum(weights)
    credit = [0.0] * len(weights)
    owners = torch.empty(moe_layers * n_experts, dtype=torch.int64)
    for record in range(owners.numel()):
        credit = [c + w for c, w in zip(credit, weights, strict=True)]
        pick = max(range(len(credit)), key=lambda i: (credit[i], -i))
        credit[pick] -= total
        owners[record] = ranks[pick]
    return owners.view(moe_layers, n_experts)


def measured_owners(hellos: Sequence[Hello], moe_layers: int, n_experts: int) -> torch.Tensor:
    weights = share_weights(hellos, moe_layers * n_experts)
    return deal(weights, [h.rank for h in hellos], moe_layers, n_experts)


def read_expert_map(path: str | Path, ranks: Sequence[int], moe_layers: int, n_experts: int) -> torch.Tensor:
    """The owner table an explicit map file gives: every expert id held by exactly one listed worker."""
    path = Path(path)
    try:
        data = json.loads(decode_utf8(read_bounded(path, MAX_MAP_BYTES, "expert map"), path, "expert map"))
    except FileNotFoundError:
        raise ColibriError(f"{path}: expert map not found") from None
    except json.JSONDecodeError as exc:
        raise ColibriError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ColibriError(f'{path}: expected an object {{"<worker rank>": [expert ids], ...}}')
    owner = [-1] * n_experts
    for key, ids in data.items():
        if not key.isdigit() or int(key) not in ranks:
            raise ColibriError(f"{path}: {key!r} is not a worker rank (the workers are {list(ranks)})")
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise ColibriError(f"{path}: worker {key}: expected a list of expert ids")
        for expert in ids:
            if not 0 <= expert < n_experts:
                raise ColibriError(f"{path}: worker {key}: expert {expert} outside 0..{n_experts - 1}")
            if owner[expert] != -1:
                raise ColibriError(f"{path}: expert {expert} is given to worker {owner[expert]} and worker {key}")
            owner[expert] = int(key)
    missing = [e for e, rank in enumerate(owner) if rank == -1]
    if missing:
        raise ColibriError(f"{path}: no worker holds expert(s) {missing[:8]}{'...' if len(missing) > 8 else ''}")
    return torch.tensor(owner, dtype=torch.int64).expand(moe_layers, n_experts).clone()
