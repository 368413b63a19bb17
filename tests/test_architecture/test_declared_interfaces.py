"""Every capability the engine uses of an expert source, a cache or a model is declared (engine/core/sources.py,
engine/core/interfaces.py, engine/families.py), every implementation offers all of it, and nothing probes
for an undeclared one with getattr/hasattr (reflection left for other reasons says why)."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from colibri_stream.experts.cluster.coordinator import DistributedExperts
from colibri_stream.experts.store import LocalExpertStore, RemoteExpertStore, ResidentStore, StoreReports
from colibri_stream.planning.family_memory import FamilyMemory, MLAMemory, V4Memory
from engine.core.cache import KVCache
from engine.core.interfaces import Cache, Model
from engine.core.sources import (
    Acquired,
    Expert,
    ExpertSource,
    ExpertWeights,
    HeldExperts,
    Offered,
    Offers,
    ReadAheadMemory,
    RemoteExperts,
    RemoteSum,
    ResidentExperts,
    ResidentSet,
    is_remote,
)
from engine.families import Family, KVLogFormat, MLAFamily, MLALog, V4Family, V4Log
from engine.kernels.quant import QuantizedExpert
from engine.mla.model import Transformer
from engine.v4.cache import V4Cache
from engine.v4.model import V4Transformer
from storage.tiers.tiered import AcquiredExperts, StoreOffers, TieredExpertStore

ROOT = Path(__file__).resolve().parents[2]
APPS = ("devtools", "bench")  # colibri_stream/<app>: applications, not the library's contracts
PROBE = re.compile(r"\b(getattr|hasattr)\(")


def _members(protocol: type) -> dict[str, Any]:
    """A protocol's declared members (methods, properties, attributes) -> their declaration."""
    members: dict[str, Any] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, Protocol) or cls.__module__ == "typing":
            continue
        members |= {name: None for name in getattr(cls, "__annotations__", {})}
        members |= {
            name: value
            for name, value in vars(cls).items()
            if (not name.startswith("_") or name == "__getitem__" or name == "__call__") and name != "_is_protocol"
        }
    return members


def _parameters(function: Any) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


CONFORMING = [
    (ExpertSource, ResidentExperts),
    (ExpertSource, ResidentStore),
    (ExpertSource, TieredExpertStore),
    (LocalExpertStore, ResidentStore),
    (LocalExpertStore, TieredExpertStore),
    (RemoteExperts, DistributedExperts),
    (RemoteSum, DistributedExperts),
    (RemoteExpertStore, DistributedExperts),
    (StoreReports, DistributedExperts),
    (ResidentSet, ResidentExperts),
    (ResidentSet, TieredExpertStore),
    (ReadAheadMemory, ResidentExperts),
    (ReadAheadMemory, TieredExpertStore),
    (Offers, Offered),
    (Offers, StoreOffers),
    (Acquired, HeldExperts),
    (Acquired, AcquiredExperts),
    (Expert, ExpertWeights),
    (Expert, QuantizedExpert),
    (Cache, KVCache),
    (Cache, V4Cache),
    (Family, MLAFamily),
    (Family, V4Family),
    (KVLogFormat, MLALog),
    (KVLogFormat, V4Log),
    (FamilyMemory, MLAMemory),
    (FamilyMemory, V4Memory),
]


@pytest.mark.parametrize(
    ("protocol", "implementation"), CONFORMING, ids=[f"{i.__name__}-{p.__name__}" for p, i in CONFORMING]
)
def test_each_implementation_has_every_declared_member_with_its_parameters(protocol, implementation):
    for name, declared in _members(protocol).items():
        assert hasattr(implementation, name) or _assigned_in_init(implementation, name), (
            f"{implementation.__name__} lacks {protocol.__name__}.{name}"
        )
        offered = inspect.getattr_static(implementation, name, None)
        if inspect.isfunction(declared) and inspect.isfunction(offered):
            assert _parameters(offered) == _parameters(declared), f"{implementation.__name__}.{name}"


def _assigned_in_init(cls: type, name: str) -> bool:
    """An instance attribute: a dataclass field, or assigned as ``self.<name> ... =`` in its source."""
    if name in getattr(cls, "__dataclass_fields__", {}):
        return True
    return re.search(rf"self\.{name}\b[^=\n]*=(?!=)", inspect.getsource(cls)) is not None


@pytest.mark.parametrize("implementation", [DistributedExperts, Transformer, V4Transformer])
def test_nominal_implementations_leave_nothing_abstract(implementation):
    assert not inspect.isabstract(implementation), sorted(implementation.__abstractmethods__)


def test_the_remote_source_offers_only_what_it_has():
    """The distributed source computes routed sums; it does not pretend to hand experts over. The MoE
    layer tells the kinds apart by the declared ``routed_sum``, not by a nominal base."""
    assert not any(hasattr(DistributedExperts, name) for name in ("acquire", "release", "max_acquire"))
    assert DistributedExperts.__bases__ == (object,)
    assert not is_remote(ResidentStore({}))
    assert issubclass(Transformer, Model) and issubclass(V4Transformer, Model)


def test_the_source_protocols_are_narrow():
    """Four verbs, the routed-sum kind and one accessor for the speed paths (optional objects)."""
    assert set(_members(ExpertSource)) == {"acquire", "release", "prefetch", "lookahead", "routed_sum", "offers"}
    assert set(_members(RemoteExperts)) == {"prefetch", "lookahead", "routed_sum", "offers"}
    assert set(_members(Offers)) == {"max_acquire", "resident", "read_ahead"}


def test_a_family_is_its_construction_its_log_format_and_its_geometry():
    """The memory estimates are planning's (colibri_stream/planning/family_memory.py), from the geometry."""
    assert set(_members(Family)) == {"args", "swiglu_limit", "model", "kv_log", "geometry"}
    log = {"log_record", "log_row_widths", "log_row_layers", "cache_from_log", "session_log_record"}
    log |= {"cache_from_snapshot"}
    assert set(_members(KVLogFormat)) == log


def test_a_type_checker_holds_the_implementations_to_the_protocols():
    """The ``_conformance`` block below is checked by test_types.py's mypy run, which takes this file with
    the library (one mypy process: each run re-analyses the whole library)."""
    spec = importlib.util.spec_from_file_location("test_types", Path(__file__).with_name("test_types.py"))
    assert spec is not None and spec.loader is not None
    test_types = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test_types)
    assert Path(__file__).relative_to(ROOT).as_posix() in test_types.mypy_files()
    assert "_conformance" in Path(__file__).read_text()


def _library_files() -> list[Path]:
    files = [*(ROOT / "engine").rglob("*.py"), *(ROOT / "storage").rglob("*.py")]
    files += [p for p in (ROOT / "colibri_stream").rglob("*.py") if p.relative_to(ROOT).parts[1] not in APPS]
    return sorted(files)


def test_no_capability_probes_remain_and_reflection_says_why():
    """getattr/hasattr only with a ``# reflection:`` comment on its line or the line above (a stale C
    extension build, the OS, a third-party object's markers); never to ask what our objects can do."""
    unexplained = []
    for path in _library_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if PROBE.search(line.split("#")[0]) and not any("# reflection:" in lines[j] for j in (i - 1, i) if j >= 0):
                unexplained.append(f"{path.relative_to(ROOT)}:{i + 1}: {line.strip()}")
    assert not unexplained, "\n".join(unexplained)


def test_the_probe_check_sees_a_probe():
    assert PROBE.search('depth = getattr(experts, "prefetch_layers", 1)')
    assert not PROBE.search("experts.prefetch_layers")


if TYPE_CHECKING:  # what a type checker holds the implementations to (nothing runs here)

    def _conformance(
        stores: tuple[ResidentStore, TieredExpertStore, DistributedExperts],
        caches: tuple[KVCache, V4Cache],
        families: tuple[MLAFamily, V4Family],
        models: tuple[Transformer, V4Transformer],
        engine_sources: tuple[ResidentExperts, Offered, StoreOffers],
        logs: tuple[MLALog, V4Log],
        memories: tuple[MLAMemory, V4Memory],
    ) -> tuple[object, ...]:
        local: list[LocalExpertStore] = [stores[0], stores[1]]
        sources: list[ExpertSource] = [engine_sources[0], stores[0], stores[1]]
        remote: list[RemoteExpertStore] = [stores[2]]
        remote_sources: list[RemoteExperts] = [stores[2]]
        sums: list[RemoteSum] = [stores[2]]
        resident: list[ResidentSet] = [engine_sources[0], stores[1]]
        memory: list[ReadAheadMemory] = [engine_sources[0], stores[1]]
        offers: list[Offers] = [engine_sources[1], engine_sources[2], stores[1].offers(), stores[2].offers()]
        cache: list[Cache] = list(caches)
        family: list[Family] = list(families)
        model: list[Model[Any]] = list(models)
        log: list[KVLogFormat] = [*logs, families[0].kv_log, families[1].kv_log]
        memory_models: list[FamilyMemory] = list(memories)
        held = (local, sources, remote, remote_sources, sums, resident, memory, offers, cache, family, model)
        return (*held, log, memory_models)
