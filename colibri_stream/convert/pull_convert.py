"""Streaming conversion: shards arrive one at a time (in index order), each is converted into the
container as far as it goes, and is then no longer needed.

Per shard: every item (a dense tensor, an expert record) whose tensors are all on disk now — in this
shard or in the carry — is written with the converter's own code (so the bytes are `convert`'s); the
tensors of this shard (and of the old carry) that unfinished items still need are copied into a new
carry file; then the journal records the shard, the results and the carry, atomically. Only then may
the shard be deleted. A crash before the journal write redoes this shard (its writes are deterministic,
so redoing them changes nothing); after it, nothing of this shard is needed again.

The container is published by the converter's own ``publish`` from the journal's results, so a pull and
a `convert` of the same files give byte-identical containers.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.convert.pull_source import HubSource, Item, items
from colibri_stream.convert.pull_state import PullJournal, save, state_dir
from storage.container.write import ContainerWriter
from storage.errors import write_errors


class StreamingConversion:
    def __init__(self, source: HubSource, out: Path, options: ConvertOptions, journal: PullJournal):
        self.source = source
        self.out = out
        self.journal = journal
        self.converter = Converter(source, out, options, progress=False)
        self.items = items(self.converter.plan, source)
        self.by_shard: dict[Path, list[Item]] = defaultdict(list)
        for item in self.items:
            for shard in {source.where[t] for t in item.tensors}:
                self.by_shard[shard].append(item)
        self.writer = ContainerWriter(out, self.converter.layout, self.converter.plan.args.n_routed_experts)
        if not journal.converted:
            self.writer.mark_incomplete()

    @property
    def shards(self) -> list[str]:
        """Every shard, in the order they are converted."""
        return [self.source.shard(file) for file in self.source.files]

    def _done(self, item: Item) -> bool:
        if item.dense is not None:
            return item.dense[1] in self.journal.dense
        layer, expert = item.expert  # type: ignore[misc]  # an item is dense or an expert
        return str(expert) in self.journal.experts.get(str(layer), {})

    def convert_shard(self, shard: str, path: Path) -> int:
        """Convert what ``path`` (shard ``shard``, verified) completes; journal it. Returns items written."""
        carry = state_dir(self.out) / self.journal.carry if self.journal.carry else None
        where = {t: path for t, file in self.source.where.items() if file == self.source.path / shard}
        where.update(dict.fromkeys(self.journal.carried, carry) if carry else {})
        ready = [i for i in self.by_shard[self.source.path / shard] if not self._done(i) and i.tensors <= where.keys()]
        ready_keys = {i.key for i in ready}
        with self.source.reading(where) as reader:
            for item in ready:
                self._write(item, reader)
        pending = [i for i in self.items if i.key not in ready_keys and not self._done(i)]
        needed = sorted({t for i in pending for t in i.tensors} & where.keys())
        new_carry = self._write_carry(shard, needed, where) if needed else None
        self.journal.converted.append(shard)
        self.journal.carry, self.journal.carried = new_carry, needed
        save(self.out, self.journal)
        if carry is not None and carry.name != new_carry:
            carry.unlink(missing_ok=True)
        return len(ready)

    def _write(self, item: Item, reader: Any) -> None:
        if item.dense is not None:
            hf, engine = item.dense
            self.journal.dense[engine] = self.converter.convert_dense(hf, engine, reader, self.writer)
            return
        layer, expert = item.expert  # type: ignore[misc]
        if layer not in self.journal.arrays:  # created once: creating it again would drop its records
            self.writer.create_expert_array(layer)
            self.journal.arrays.append(layer)
        record = self.converter.expert_record(reader, self.converter.plan.experts[layer][expert])
        crc = self.writer.write_expert(layer, expert, record)
        self.journal.experts.setdefault(str(layer), {})[str(expert)] = crc

    def _write_carry(self, shard: str, names: list[str], where: dict[str, Path]) -> str:
        """The tensors ``names`` (as shipped: FP8 bytes, packed codes) into a new carry file."""
        tensors = {}
        for name in names:
            stored = self.source.shipped.get(name, name)
            with safe_open(where[name], framework="pt") as f:
                tensors[stored] = f.get_tensor(stored)
        file = f"carry-{len(self.journal.converted):06d}.safetensors"
        target = state_dir(self.out) / file
        with write_errors(target, "the pull's carry file"):
            save_carry(tensors, target)
            fd = os.open(target, os.O_RDONLY)
            try:  # durable before the journal that names it
                os.fsync(fd)
            finally:
                os.close(fd)
        return file

    def complete(self) -> bool:
        return all(self._done(i) for i in self.items)

    def publish(self) -> None:
        """The container's final attributes from the journal, by the converter (as `convert` writes them)."""
        plan = self.converter.plan
        done: dict[str, Any] = {}
        for unit in plan.units:
            if unit.experts_layer is None:
                done[unit.key] = {engine: self.journal.dense[engine] for _, engine in unit.dense}
            else:
                crcs = self.journal.experts[str(unit.experts_layer)]
                done[unit.key] = {"crc32c": [crcs[str(e)] for e in range(plan.args.n_routed_experts)]}
        fingerprint = {"source": self.source.identity(), "options": asdict(self.converter.options)}
        self.converter.publish(self.writer, {**fingerprint, "sha256": self.source.shard_sha256(), "done": done})


def save_carry(tensors: dict[str, Any], target: Path) -> None:
    """safetensors' save_file, its I/O failures raised as the OSError they are: it reports them as a
    SafetensorError ("... No space left on device (os error 28)"), which write_errors does not see, so a
    disk that filled while a carry file was written escaped as a raw error instead of DiskFullError."""
    try:
        save_file(tensors, target)
    except SafetensorError as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), str(exc)) from exc
