"""A checkpoint on the Hub seen as `convert` sees a directory, before its shards are downloaded.

``HubSource`` is an ``HFSource`` whose tensor table comes from the shard headers fetched by Range
requests (checked as headers on disk are) and whose tensor paths are where each shard will be once
downloaded; config.json, the index and the tokenizer files are on disk already. Its identity (names,
sizes, the commit's date as every file's mtime: pull stamps them so) and its sha256 list (the Hub's) are
what `convert` computes from the same files downloaded whole, so both write the same container.

``Item``: the smallest piece of a conversion, one dense tensor or one expert record, with the shipped
tensors it reads (a weight and its FP8 scale; a compressed-tensors module's parts), so a streaming
conversion knows which shards it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibri_stream.checkpoint.files import (
    FP8_SCALE_SUFFIX,
    INDEX_FILE,
    TensorInfo,
    add_shard,
    inside,
    read_json_object,
)
from colibri_stream.convert.compressed_tensors_source import SUFFIXES
from colibri_stream.convert.converter import Plan
from colibri_stream.convert.hf_source import HFSource
from colibri_stream.convert.pull_hub import PullError, RepoSnapshot, parse_shard_header
from colibri_stream.errors import CheckpointError

SINGLE_FILE = "model.safetensors"


def shard_names(local: Path, snapshot: RepoSnapshot) -> list[str]:
    """The shards, as `convert` finds them: those the index names, else model.safetensors."""
    index = local / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
        names = sorted({inside(local, name, str(index)).relative_to(local).as_posix() for name in weight_map.values()})
    elif SINGLE_FILE in snapshot.files:
        names = [SINGLE_FILE]
    else:
        raise PullError(f"{snapshot.repo_id}: neither {INDEX_FILE} nor {SINGLE_FILE} in the repo")
    missing = [name for name in names if name not in snapshot.files]
    if missing:
        raise PullError(f"{snapshot.repo_id}: {INDEX_FILE} names {missing[0]}, which is not in the repo")
    unsized = [name for name in names if not snapshot.files[name].sized]
    if unsized:
        raise PullError(f"{snapshot.repo_id}: {unsized[0]} has no size in the Hub's listing")
    unsigned = [name for name in names if not snapshot.files[name].sha256]
    if unsigned:
        raise PullError(f"{snapshot.repo_id}: {unsigned[0]} has no sha256 on the Hub (not an LFS file)")
    return names


class HubSource(HFSource):
    def __init__(self, local: Path, snapshot: RepoSnapshot, headers: dict[str, bytes]):
        self.snapshot = snapshot
        self.headers = headers
        super().__init__(local)

    def read_table(self, allowed: dict[str, tuple[str, ...]]) -> dict[str, tuple[Path, TensorInfo]]:
        table: dict[str, tuple[Path, TensorInfo]] = {}
        for name in shard_names(self.path, self.snapshot):
            tensors = parse_shard_header(name, self.headers[name], self.snapshot.files[name].size, self.path)
            add_shard(table, self.path / name, tensors, allowed)
        return table

    def identity(self) -> dict[str, Any]:
        stamp = self.snapshot.modified_ns
        return {
            file.name: {"size": self.snapshot.files[self.shard(file)].size, "mtime_ns": stamp} for file in self.files
        }

    def shard_sha256(self) -> dict[str, str]:
        return {file.name: str(self.snapshot.files[self.shard(file)].sha256) for file in self.files}

    def shard(self, file: Path) -> str:
        """The repo path of a shard file."""
        return file.relative_to(self.path).as_posix()


@dataclass(frozen=True)
class Item:
    key: str  # "dense/<engine name>" or "expert/<layer>/<expert>"
    unit: str  # the converter's unit it belongs to
    tensors: frozenset[str]  # the source's tensor names it reads (keys of HFSource.where)
    dense: tuple[str, str] | None = None  # (hf name, engine name)
    expert: tuple[int, int] | None = None  # (layer, expert)


def reads(source: HFSource, name: str) -> set[str]:
    """The tensors reading logical tensor ``name`` touches: itself and its FP8 scale, or a quantised
    module's shipped parts."""
    module = source.packed_modules.get(name)
    if module is not None:
        return {module.base + s for s in SUFFIXES if module.base + s in source.where}
    return {n for n in (name, name + FP8_SCALE_SUFFIX) if n in source.where}


def items(plan: Plan, source: HFSource) -> list[Item]:
    """Every item of a conversion, in the converter's unit order."""
    out = []
    for unit in plan.units:
        for hf, engine in unit.dense:
            out.append(Item(f"dense/{engine}", unit.key, frozenset(reads(source, hf)), dense=(hf, engine)))
        if unit.experts_layer is not None:
            layer = unit.experts_layer
            for expert, names in sorted(plan.experts[layer].items()):
                tensors = frozenset(t for n in names.values() for t in reads(source, n))
                out.append(Item(f"expert/{layer}/{expert}", unit.key, tensors, expert=(layer, expert)))
    return out
