"""A partial mirror: second copies of the hottest records, so each device's expected read time per token
is about the same.

Model: a token reads record r with probability proportional to its routing count c_r (the usage
history). A record with one copy loads its device; a mirrored one is read from whichever copy's device
is less busy, so its load can be split between them. Device d's expected time per token is its load
over its speed (weight, measured bytes/s); decode waits for the slowest device.

Plan (greedy, hottest first): while some device's single-copy records alone take more than (1 - margin)
of the evenly balanced time per token, copy its hottest single-copy record to the device with the least
expected time; stop there, when nothing is left to copy, or when the byte budget is spent.
``MirrorPlan`` says what moves, the bytes, and the expected read time per token before and after.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from storage.container.parts import Parts, RecordKey
from storage.container.reader import Container, read_record_file
from storage.container.spread import Layout, all_keys, current_parts
from storage.errors import StorageError
from storage.files.buffers import aligned_empty
from storage.files.checksum import crc32c

# Copy until no device's single-copy records alone take more than (1 - MARGIN) of the evenly balanced time
# per token: the rest of its share is mirrored and so movable at read time. A history predicts another
# prompt's routing only roughly: mirroring just enough to balance it exactly left one device busier.
MARGIN = 0.2


@dataclass(frozen=True)
class MirrorPlan:
    copies: tuple[tuple[RecordKey, int], ...]  # (record, part it is copied to), hottest first
    record_bytes: int
    tokens: float  # tokens the history covers (routing counts / experts per token, per layer)
    load_before: tuple[float, ...]  # expected records read per token, per part
    load_after: tuple[float, ...]
    weights: tuple[float, ...]

    @property
    def bytes(self) -> int:
        return len(self.copies) * self.record_bytes

    def seconds_per_token(self, loads: tuple[float, ...]) -> float:
        """Expected disk time per token at 0% hits: the slowest device's bytes over its speed."""
        return max(load * self.record_bytes / w for load, w in zip(loads, self.weights, strict=True))

    @property
    def gain(self) -> float:
        after = self.seconds_per_token(self.load_after)
        return self.seconds_per_token(self.load_before) / after if after else 1.0

    def bytes_per_token(self, loads: tuple[float, ...]) -> list[float]:
        return [load * self.record_bytes for load in loads]


def _split_loads(
    parts: Parts, counts: dict[int, list[float]], scale: float
) -> tuple[list[float], dict[RecordKey, tuple[float, tuple[int, ...]]]]:
    """Per part the expected records per token of its single-copy records; per mirrored record its load
    and the parts holding it."""
    single = [0.0] * len(parts.dirs)
    shared: dict[RecordKey, tuple[float, tuple[int, ...]]] = {}
    for key, where in parts.records():
        row = counts.get(key[0])
        load = row[key[1]] * scale if row else 0.0
        if len(where) == 1:
            single[where[0]] += load
        else:
            shared[key] = (load, where)
    return single, shared


def balanced_loads(
    single: list[float], shared: dict[RecordKey, tuple[float, tuple[int, ...]]], weights: tuple[float, ...]
) -> tuple[float, ...]:
    """Expected records per token per part when each mirrored record's reads go to the less busy copy:
    hottest first to the copy whose device has the least time, then split pairwise to even them out."""
    loads = list(single)
    time = lambda p: loads[p] / weights[p]  # noqa: E731  # one line, read twice below
    share: dict[RecordKey, dict[int, float]] = {}
    for key, (load, where) in sorted(shared.items(), key=lambda item: -item[1][0]):
        best = min(where, key=time)
        loads[best] += load
        share[key] = {best: load}
    for _ in range(3):  # pairwise refinement: move part of a record's load from its busier copy
        for key, (_load, where) in shared.items():
            hi, lo = max(where, key=time), min(where, key=time)
            held = share[key].get(hi, 0.0)
            even = (loads[hi] * weights[lo] - loads[lo] * weights[hi]) / (weights[lo] + weights[hi])
            moved = max(0.0, min(held, even))
            loads[hi] -= moved
            loads[lo] += moved
            share[key][hi] = held - moved
            share[key][lo] = share[key].get(lo, 0.0) + moved
    return tuple(loads)


def plan_mirror(
    container: Container,
    counts: dict[int, list[float]],
    weights: tuple[float, ...] | None = None,
    max_bytes: int | None = None,
    parts: Parts | None = None,
    margin: float = MARGIN,
) -> MirrorPlan:
    """What to copy where (see the module doc). ``parts`` may add a part the container does not list
    yet (``mirror stage --to`` a new directory); ``weights`` override the manifest's."""
    parts = parts or current_parts(container)
    weights = weights or parts.weights
    k = container.experts_per_token
    per_layer = [float(sum(row)) / k for layer, row in counts.items() if layer in container.moe_layers and any(row)]
    tokens = sum(per_layer) / len(per_layer) if per_layer else 0.0
    scale = 1.0 / tokens if tokens else 0.0
    single, shared = _split_loads(parts, counts, scale)
    before = balanced_loads(single, shared, weights)
    fair = sum(before) / sum(weights)  # time per token of every device when evenly loaded
    budget = max_bytes // container.layout.record_bytes if max_bytes is not None else None
    ranked = sorted(
        ((counts[key[0]][key[1]] * scale, key, where) for key, where in parts.records() if counts.get(key[0])),
        key=lambda item: (-item[0], item[1]),
    )
    # per part, its single-copy records hottest first (routed at least once): what it may copy out
    queues = {p: deque(item for item in ranked if item[2] == (p,) and item[0] > 0) for p in range(len(weights))}
    chosen: list[tuple[RecordKey, int]] = []
    expected = list(before)  # where the copied records' reads are expected to go (all to their new copy)
    while budget is None or len(chosen) < budget:
        times = [load / w for load, w in zip(single, weights, strict=True)]
        hi = max(range(len(times)), key=times.__getitem__)
        if fair <= 0 or times[hi] <= (1 - margin) * fair:
            break
        if not queues[hi]:
            break
        load, key, _ = queues[hi].popleft()
        lo = min((p for p in range(len(weights)) if p != hi), key=lambda p: expected[p] / weights[p])
        single[hi] -= load
        expected[hi] -= load
        expected[lo] += load
        shared[key] = (load, (hi, lo))
        chosen.append((key, lo))
    after = balanced_loads(single, shared, weights)
    return MirrorPlan(tuple(chosen), container.layout.record_bytes, tokens, before, after, tuple(weights))


def mirror_layout(parts: Parts, plan: MirrorPlan) -> Layout:
    target = {key: where for key, where in parts.records()}
    for key, part in plan.copies:
        target[key] = (*target[key], part)
    return Layout(parts.dirs, plan.weights, target)


def copy_problems(container: Container, mirrored_only: bool = True) -> Iterator[str]:
    """Every copy (of mirrored records only, by default) read and checked against its crc32c; one line
    per bad copy naming the record and its device."""
    parts = current_parts(container)
    size = container.layout.record_bytes
    buffer = aligned_empty(size)
    for key in all_keys(container):
        copies = container.expert_copies(*key)
        if mirrored_only and len(copies) < 2:
            continue
        for part, path in copies:
            try:
                if path.exists() and path.stat().st_size != size:
                    yield f"layer {key[0]} expert {key[1]}: {path} holds {path.stat().st_size} bytes, expected {size}"
                    continue
                data = read_record_file(path, *key, buffer, size)
            except StorageError as exc:
                yield f"{exc} (device {parts.device_name(part)})"
                continue
            if crc32c(data) != container.expert_checksum(*key):
                yield f"layer {key[0]} expert {key[1]}: checksum mismatch in {path} (device {parts.device_name(part)})"
