"""`colibri-stream convert`: a Hugging Face checkpoint -> the expert container, streaming and resumable.

Work is cut into units (per layer: its dense tensors, its routed experts; then the global tensors),
each reading its tensors one at a time, so peak memory is about one layer's tensors whatever the
model size. A journal in the destination records finished units (atomically, with their checksums);
a rerun after a crash redoes only unfinished units, and since every write is deterministic the result
is byte-identical to an uninterrupted conversion. The journal also pins the source and options, so a
rerun can never mix two sources into one container. A full disk (or a device error) is a one-line
DiskFullError / DiskWriteError naming the destination and its free bytes; the rerun, once there is space,
resumes from the journal like one after a kill.
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from colibri_stream import __version__
from colibri_stream.checkpoint.dtypes import bf16_bits, stored_dense_dtype
from colibri_stream.convert.hf_source import HFSource, TensorReader
from colibri_stream.errors import CheckpointError
from colibri_stream.experts.codec import record_from_expert, record_from_quantized
from colibri_stream.planning.geometry import ContainerTarget
from colibri_stream.runtime.loader import check_dense_names
from engine.config.args import ModelArgs
from engine.config.weights import sort_names
from engine.kernels.quant import quantize
from storage.container.layout import ExpertRecordLayout
from storage.container.reader import Container, read_json
from storage.container.write import ContainerWriter
from storage.errors import IncompatibleStateError, StorageError, write_errors
from storage.files.atomic import atomic_write_json

JOURNAL = "convert-journal.json"
# Fault injection for the kill/resume tests: SIGKILL this process midway through unit N+1.
CRASH_ENV = "COLIBRI_STREAM_CRASH_AFTER_UNITS"


@dataclass(frozen=True)
class ConvertOptions(ContainerTarget):
    """--experts, --group-size, --dense: the container to write (defaults and checks: ContainerTarget,
    which `plan` also sizes a conversion with)."""


@dataclass(frozen=True)
class Unit:
    key: str  # journal key, e.g. "layer.003.experts"
    dense: tuple[tuple[str, str], ...] = ()  # (hf name, engine name)
    experts_layer: int | None = None


@dataclass
class Plan:
    args: ModelArgs
    units: list[Unit]
    experts: dict[int, dict[int, dict[str, str]]]  # layer -> expert -> w1/w2/w3 -> hf name
    skipped: list[str]  # a wrapped multimodal checkpoint's vision tensors (text model only)


def _dense_unit_layer(engine_name: str, n_layers: int) -> int | None:
    """The layer whose unit converts a dense tensor: layers.N -> N, an MTP module's mtp.I -> n_layers + I,
    None for the globals."""
    kind, _, rest = engine_name.partition(".")
    if kind == "layers":
        return int(rest.split(".")[0])
    if kind == "mtp":
        return n_layers + int(rest.split(".")[0])
    return None


def plan_conversion(source: HFSource, mtp: bool = True) -> Plan:
    """Map every source tensor to a unit; refuse tensors the engine would not consume."""
    args = ModelArgs.from_hf_config(source.dense_config())
    dense_by_layer: dict[int | None, list[tuple[str, str]]] = defaultdict(list)
    experts: dict[int, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    names = sort_names(source.tensor_names, args.n_layers, mtp)
    args = args.with_mtp_layers(names.mtp_layers)
    for (layer, expert, proj), name in names.routed.items():
        experts[layer][expert][proj] = name
    for name, target in names.dense.items():
        dense_by_layer[_dense_unit_layer(target, args.n_layers)].append((name, target))
    check_dense_names(args, names.unmapped, set(names.dense.values()), str(source.path))
    _check_experts(args, experts, source)
    units = []
    for layer in range(args.n_layers + args.n_mtp_layers):
        units.append(Unit(f"layer.{layer:03d}.dense", tuple(sorted(dense_by_layer[layer]))))
        if args.is_moe(layer):
            units.append(Unit(f"layer.{layer:03d}.experts", experts_layer=layer))
    units.append(Unit("globals", tuple(sorted(dense_by_layer[None]))))
    return Plan(args, units, experts, names.skipped)


def _check_experts(args: ModelArgs, experts: dict, source: HFSource) -> None:
    for layer in args.moe_layers:
        found = experts.get(layer, {})
        for expert in range(args.n_routed_experts):
            missing = {"w1", "w2", "w3"} - set(found.get(expert, {}))
            if missing:
                raise IncompatibleStateError(f"{source.path}: layer {layer} expert {expert} lacks {sorted(missing)}")
    stray = sorted(set(experts) - set(args.moe_layers))
    if stray:
        raise IncompatibleStateError(f"{source.path}: routed experts in dense layer(s) {stray}")


# ----------------------------------------------------------------------------------------- records

DenseArrayData = tuple[str, np.ndarray, str, tuple[int, ...]]  # (array name, array, dtype tag, weight shape)


def dense_arrays(engine: str, tensor: torch.Tensor, scheme: str, group_size: int) -> list[DenseArrayData]:
    """(array name, array, dtype tag, the weight's shape) to store for one dense tensor under ``scheme``.

    The dtype is colibri_stream.checkpoint.dtypes.stored_dense_dtype's, the rule `plan` sizes a conversion with."""
    shape = tuple(tensor.shape)
    stored = stored_dense_dtype(engine, shape, scheme, group_size)
    if stored == "float32":
        return [(engine, tensor.float().contiguous().numpy(), "float32", shape)]
    if stored == "int32":  # an integer table (DeepSeek-V4's tid2eid), exact
        return [(engine, tensor.to(torch.int32).contiguous().numpy(), "int32", shape)]
    if stored in ("int8", "int4"):
        q, scales = quantize(tensor, 8 if stored == "int8" else 4, group_size)
        scale_array = scales.numpy()
        return [(engine, q.numpy(), stored, shape), (f"{engine}.scale", scale_array, "float16", scale_array.shape)]
    return [(engine, bf16_bits(tensor), "bfloat16", shape)]


# ------------------------------------------------------------------------------------------- driver


class Converter:
    def __init__(self, src: str | Path | HFSource, dst: str | Path, options: ConvertOptions, progress: bool = True):
        self.source = src if isinstance(src, HFSource) else HFSource(src)
        self.dst = Path(dst)
        self.options = options
        self.progress = progress
        self.plan = plan_conversion(self.source, options.mtp)
        args = self.plan.args
        packed = self.source.packed
        scheme, group_size = options.expert_kind(packed, self.source.scale_dtype)
        # auto on a quantised source: records copy the shipped codes and scales, nothing is re-quantised
        self.copy_quantized = options.passthrough(packed)
        self.layout = ExpertRecordLayout.build(scheme, args.dim, args.moe_inter_dim, group_size)
        if self.copy_quantized:
            _check_all_quantized(self.plan, self.source)

    def run(self) -> dict[str, Any]:
        journal = self._open_journal()
        if journal is None:
            return {"status": "already converted", "path": str(self.dst)}
        writer = ContainerWriter(self.dst, self.layout, self.plan.args.n_routed_experts)
        if not journal["done"]:
            writer.mark_incomplete()
        todo = [u for u in self.plan.units if u.key not in journal["done"]]
        total = sum(self._unit_bytes(u) for u in self.plan.units)
        done_bytes = total - sum(self._unit_bytes(u) for u in todo)
        crash_after = int(os.environ.get(CRASH_ENV, "-1"))
        with tqdm(
            total=total,
            initial=done_bytes,
            unit="B",
            unit_scale=True,
            desc="convert",
            disable=not self.progress,
        ) as bar:
            for unit in todo:
                with self.source.reading() as reader:
                    crash = len(journal["done"]) == crash_after
                    journal["done"][unit.key] = self._convert_unit(unit, reader, writer, crash)
                atomic_write_json(self.dst / JOURNAL, journal)
                bar.update(self._unit_bytes(unit))
        self.publish(writer, journal)
        return {
            "status": "converted",
            "path": str(self.dst),
            "units": len(self.plan.units),
            "resumed_units": len(self.plan.units) - len(todo),
            **self._skipped_report(),
        }

    def _skipped_report(self) -> dict[str, Any]:
        if not self.plan.skipped:
            return {}
        towers = sorted({name.split(".")[0] for name in self.plan.skipped})
        return {
            "skipped": {"tensors": len(self.plan.skipped), "prefixes": towers, "why": "vision tower: text model only"}
        }

    def _unit_bytes(self, unit: Unit) -> int:
        names = [hf for hf, _ in unit.dense]
        if unit.experts_layer is not None:
            names += [n for e in self.plan.experts[unit.experts_layer].values() for n in e.values()]
        return self.source.unit_bytes(names)

    def _convert_unit(self, unit: Unit, reader: TensorReader, writer: ContainerWriter, crash: bool) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for hf, engine in unit.dense:
            result[engine] = self.convert_dense(hf, engine, reader, writer)
            _crash_if(crash)
        if unit.experts_layer is not None:
            layer = unit.experts_layer
            writer.create_expert_array(layer)
            crcs = []
            for expert in range(self.plan.args.n_routed_experts):
                record = self.expert_record(reader, self.plan.experts[layer][expert])
                crcs.append(writer.write_expert(layer, expert, record))
                _crash_if(crash)
            result = {"crc32c": crcs}
        return result

    def convert_dense(self, hf: str, engine: str, reader: TensorReader, writer: ContainerWriter) -> dict[str, Any]:
        """Write one dense tensor's arrays; return its entry for the container's attributes."""
        written = [
            writer.write_dense(name, array, dtype, shape)
            for name, array, dtype, shape in dense_arrays(
                engine, reader.get(hf), self.options.dense, self.options.quant_group_size
            )
        ]
        if len(written) == 1:
            return written[0]
        # int8 / int4: the codes, their scales and the group size the scales are for
        return {**written[0], "scales": written[1], "group_size": self.options.quant_group_size}

    def expert_record(self, reader: TensorReader, names: dict[str, str]) -> np.ndarray:
        """One expert's record: its shipped codes copied, or its float weights quantised here."""
        if self.copy_quantized:
            return record_from_quantized(self.layout, {w: reader.get_quantized(names[w]) for w in ("w1", "w2", "w3")})
        return record_from_expert(self.layout, {w: reader.get(names[w]) for w in ("w1", "w2", "w3")})

    # ---------------------------------------------------------------------------------- journal
    def _fingerprint(self) -> dict[str, Any]:
        return {"source": self.source.identity(), "options": asdict(self.options)}

    def _open_journal(self) -> dict[str, Any] | None:
        """The journal to continue, or None if DST already holds this exact conversion."""
        path = self.dst / JOURNAL
        fingerprint = self._fingerprint()
        if path.is_file():
            journal = read_json(path, "conversion journal")
            if not isinstance(journal, dict) or {k: journal.get(k) for k in fingerprint} != fingerprint:
                raise IncompatibleStateError(
                    f"{self.dst}: holds an unfinished conversion of another source or with other options; "
                    "use a new destination"
                )
            return journal
        if self.dst.exists() and any(self.dst.iterdir()):
            if _finished_conversion(self.dst) == fingerprint:
                return None
            raise IncompatibleStateError(f"{self.dst}: exists and is not an unfinished conversion of this source")
        self.dst.mkdir(parents=True, exist_ok=True)
        journal = {**fingerprint, "sha256": self.source.shard_sha256(), "done": {}}
        atomic_write_json(path, journal)
        return journal

    def publish(self, writer: ContainerWriter, journal: dict[str, Any]) -> None:
        """Copy the side files and write the final attributes from a journal whose units are all done."""
        done = journal["done"]
        dense = {
            name: entry
            for unit in self.plan.units
            if unit.experts_layer is None
            for name, entry in done[unit.key].items()
        }
        checksums = {
            str(u.experts_layer): done[u.key]["crc32c"] for u in self.plan.units if u.experts_layer is not None
        }
        with write_errors(self.dst, "the container's side files"):  # a rerun copies them again
            copied = self.source.copy_side_files(self.dst)
        writer.publish(
            {
                "model_config": self.source.dense_config(),
                "experts": {
                    "layout": self.layout.to_attrs(),
                    "layers": list(self.plan.args.moe_layers),
                    "checksums": checksums,
                },
                "dense": dict(sorted(dense.items())),
                "converter_version": __version__,
                "source": {"shards_sha256": journal["sha256"]},
                "conversion": {k: journal[k] for k in ("source", "options")},
                "files": copied,
            }
        )
        (self.dst / JOURNAL).unlink(missing_ok=True)  # a pull keeps its own journal (convert/pull_state.py)


def _check_all_quantized(plan: Plan, source: HFSource) -> None:
    """--experts auto copies shipped codes: every routed expert must ship them (not one left in floats)."""
    for experts in plan.experts.values():
        for names in experts.values():
            for name in names.values():
                if name not in source.packed_modules:
                    raise CheckpointError(
                        f"{source.where[name]}: routed expert tensor {name} is not quantised while config.json "
                        "quantizes routed experts; pass --experts int4 (or int8/bf16/f32) to convert it from floats"
                    )


def _finished_conversion(dst: Path) -> dict[str, Any] | None:
    """The fingerprint recorded by a finished conversion in ``dst``, if it holds one."""
    try:
        return Container(dst).attrs.get("conversion")
    except StorageError:
        return None


def _crash_if(crash: bool) -> None:
    if crash:
        os.kill(os.getpid(), signal.SIGKILL)
