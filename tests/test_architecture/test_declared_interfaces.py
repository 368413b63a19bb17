"""Every capability the engine uses of an expert source, a cache or a model is declared (engine/core/sources.py,
engine/core/interfaces.py, engine/families.py), every implementation offers all of it, and nothing probes
for an undeclared one with getattr/hasattr (reflection left for other reasons says why)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from colibri_stream.experts.cluster.coordinator import DistributedExperts
from colibri_stream.experts.store import LocalExpertStore, RemoteExpertStore, ResidentStore, StoreReports
from engine.core.cache import KVCache
from engine.core.interfaces import Cache, Model
from engine.core.sources import (
    Acquired,
    Expert,
    ExpertWeights,
    HeldExperts,
    LocalExperts,
    RemoteExperts,
    ResidentExperts,
)
from engine.families import Family, MLAFamily, V4Family
from engine.kernels.quant import QuantizedExpert
from engine.mla.model import Transformer
from engine.v4.cache import V4Cache
from engine.v4.model import V4Transformer
from storage.tiers.tiered import AcquiredExperts, TieredExpertStore

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
    (LocalExperts, ResidentExperts),
    (LocalExperts, ResidentStore),
    (LocalExperts, TieredExpertStore),
    (LocalExpertStore, ResidentStore),
    (LocalExpertStore, TieredExpertStore),
    (StoreReports, DistributedExperts),
    (Acquired, HeldExperts),
    (Acquired, AcquiredExperts),
    (Expert, ExpertWeights),
    (Expert, QuantizedExpert),
    (Cache, KVCache),
    (Cache, V4Cache),
    (Family, MLAFamily),
    (Family, V4Family),
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
    """The distributed source computes routed sums; it does not pretend to hand experts over."""
    assert issubclass(DistributedExperts, RemoteExpertStore) and issubclass(DistributedExperts, RemoteExperts)
    assert not any(hasattr(DistributedExperts, name) for name in ("acquire", "release", "max_acquire"))
    assert not isinstance(ResidentStore({}), RemoteExperts)
    assert issubclass(Transformer, Model) and issubclass(V4Transformer, Model)


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
    ) -> None:
        local: list[LocalExpertStore] = [stores[0], stores[1]]
        remote: list[RemoteExpertStore] = [stores[2]]
        cache: list[Cache] = list(caches)
        family: list[Family] = list(families)
        model: list[Model[Any]] = list(models)
        del local, remote, cache, family, model
