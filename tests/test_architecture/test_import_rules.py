"""The package boundaries the architecture fixes (docs/architecture.md "Import rules"), read from the
source with ast: every import statement counts, including those inside functions."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APPS = ("serve", "bench", "convert", "devtools")  # colibri_stream/<app>: import the library, never each other


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(path): path for path in (ROOT / package).rglob("*.py")}


@functools.cache
def _known_modules() -> frozenset[str]:
    return frozenset(name for package in ("colibri_stream", "engine", "storage") for name in _modules(package))


def _imports(path: Path) -> set[str]:
    """Absolute module names imported by one file; ``from pkg import name`` counts pkg.name when that
    is a module of ours, else pkg."""
    names: set[str] = set()
    known = _known_modules()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in known else node.module)
    return names


def _top_levels(package: str) -> set[str]:
    return {name.split(".")[0] for path in _modules(package).values() for name in _imports(path)}


def _importers_of(prefix: str, among: dict[str, Path]) -> set[str]:
    return {
        module
        for module, path in among.items()
        if any(name == prefix or name.startswith(prefix + ".") for name in _imports(path))
    }


def test_engine_imports_neither_storage_nor_the_app():
    assert not _top_levels("engine") & {"storage", "colibri_stream"}


def test_storage_imports_neither_engine_nor_the_app():
    assert not _top_levels("storage") & {"engine", "colibri_stream"}


def test_nothing_imports_the_commands():
    outside = {m: p for m, p in _modules("colibri_stream").items() if not m.startswith("colibri_stream.cli")}
    assert _importers_of("colibri_stream.cli", outside) == {"colibri_stream.__main__"}
    for package in ("engine", "storage", "tools", "tests"):
        users = _importers_of("colibri_stream.cli", _modules(package))
        assert package == "tests" or not users, (package, users)


def test_the_applications_import_the_library_never_each_other():
    modules = _modules("colibri_stream")
    for app in APPS:
        mine = {m: p for m, p in modules.items() if m.startswith(f"colibri_stream.{app}")}
        assert mine, app
        for other in (*APPS, "cli"):
            if other != app:
                assert not _importers_of(f"colibri_stream.{other}", mine), (app, other)


LIBRARY_LAYERS = ("checkpoint", "text", "planning", "experts", "runtime")  # lowest first
LIBRARY_BASE = ("errors", "paths")  # top-level modules every layer may import


def _library() -> dict[str, Path]:
    """The library: its base modules and its layer folders (everything but the applications and cli/)."""
    return {
        m: p
        for m, p in _modules("colibri_stream").items()
        if m.split(".")[1:2] and m.split(".")[1] in (*LIBRARY_BASE, *LIBRARY_LAYERS)
    }


def test_the_library_imports_no_application():
    library = _library()
    assert "colibri_stream.runtime.turn" in library and "colibri_stream.cli" not in library
    for app in (*APPS, "cli"):
        assert not _importers_of(f"colibri_stream.{app}", library), app


def test_the_library_is_only_its_base_and_its_layers():
    """A new top-level module or folder must be placed in a layer (or named an application) here."""
    top = {m.split(".")[1] for m in _modules("colibri_stream") if m.count(".") >= 1}
    assert top <= {*LIBRARY_BASE, *LIBRARY_LAYERS, *APPS, "cli", "__main__"}, top


def test_a_lower_layer_never_imports_a_higher_one():
    library = _library()
    for rank, layer in enumerate(LIBRARY_LAYERS):
        mine = {m: p for m, p in library.items() if m.split(".")[1] == layer}
        assert mine, layer
        for higher in LIBRARY_LAYERS[rank + 1 :]:
            assert not _importers_of(f"colibri_stream.{higher}", mine), (layer, higher)
    base = {m: p for m, p in library.items() if m.split(".")[1] in LIBRARY_BASE}
    for layer in LIBRARY_LAYERS:
        assert not _importers_of(f"colibri_stream.{layer}", base), ("base", layer)


def test_the_library_reaches_kv_persistence_through_its_front_door():
    """Outside colibri_stream/runtime/kv/ the library (the turn) imports its front.py only; the commands and
    the server may name its parts (`kv ls`, session names and locks, chat's transcript)."""
    outside = {m: p for m, p in _library().items() if not m.startswith("colibri_stream.runtime.kv")}
    for module, path in outside.items():
        inside = {n for n in _imports(path) if n.startswith("colibri_stream.runtime.kv")}
        assert inside <= {"colibri_stream.runtime.kv.front"}, (module, inside)
    assert "colibri_stream.runtime.kv.front" in _imports(outside["colibri_stream.runtime.turn"])


def test_the_session_log_and_the_prefix_cache_never_import_each_other():
    kv = {m: p for m, p in _modules("colibri_stream").items() if m.startswith("colibri_stream.runtime.kv.")}
    log_side = {"colibri_stream.runtime.kv.sessions", "colibri_stream.runtime.kv.logs"}
    prefix_side = {"colibri_stream.runtime.kv.prefix_cache", "colibri_stream.runtime.kv.packs"}
    for mine, theirs in ((log_side, prefix_side), (prefix_side, log_side)):
        for module in mine:
            assert not _imports(kv[module]) & theirs, module


def test_no_import_cycles():
    graph = {}
    for package in ("colibri_stream", "engine", "storage"):
        modules = _modules(package)
        graph |= {m: {n for n in _imports(p) if n.split(".")[0] == package} for m, p in modules.items()}
    seen: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join((*path[path.index(module) :], module)))
        if module in seen or module not in graph:
            return
        for imported in sorted(graph[module]):
            visit(imported, (*path, module))
        seen.add(module)

    for module in sorted(graph):
        visit(module, ())


# The rooms of engine/ and storage/, lowest first: a room imports its own modules and lower groups' only
# (rooms in one group never import each other). The package's top-level modules sit above every room.
ROOMS = {
    "engine": (("config", "kernels"), ("core",), ("mla", "v4")),
    "storage": (("errors",), ("files",), ("container",), ("tiers", "kv")),
}
MOST_TOP_LEVEL_ENTRIES = 10


def _room(module: str) -> str | None:
    """engine.mla.model -> mla; None for the package itself and its top-level modules (engine.families)."""
    parts = module.split(".")
    rooms = {room for group in ROOMS[parts[0]] for room in group}
    return parts[1] if len(parts) >= 2 and parts[1] in rooms else None


def _room_violations(package: str) -> list[tuple[str, str]]:
    rank = {room: level for level, group in enumerate(ROOMS[package]) for room in group}
    found = []
    for module, path in _modules(package).items():
        mine = _room(module)
        if mine is None:
            continue
        for name in _imports(path):
            if name.split(".")[0] != package:
                continue
            theirs = _room(name)
            if theirs is None and name != package:
                found.append((module, name))  # a room importing the package's top-level modules
            elif theirs is not None and theirs != mine and rank[theirs] >= rank[mine]:
                found.append((module, name))
    return found


def test_engine_and_storage_rooms_import_only_lower_rooms():
    for package, groups in ROOMS.items():
        rooms = {room for group in groups for room in group}
        present = {m.split(".")[1] for m in _modules(package) if m.count(".") >= 2 or m.endswith(".errors")}
        assert present == rooms, (package, present ^ rooms)  # a new room is placed in ROOMS first
        assert not _room_violations(package), (package, _room_violations(package))


def test_engine_and_storage_have_few_top_level_entries():
    for package in ROOMS:
        entries = [p.name for p in (ROOT / package).iterdir() if p.name != "__pycache__" and not p.name.endswith(".so")]
        assert len(entries) <= MOST_TOP_LEVEL_ENTRIES, (package, sorted(entries))


def test_only_the_kernels_front_door_asks_what_the_extension_offers():
    """engine/kernels/native.py imports the extension and checks its ABI version; every other module asks
    ``_kernels is not None``, never hasattr/getattr of one function (a build is whole or absent)."""
    front = ROOT / "engine" / "kernels" / "native.py"
    for path in (ROOT / "engine").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if path != front and isinstance(node, ast.ImportFrom) and node.module == "engine.kernels":
                assert all(alias.name != "_kernels" for alias in node.names), path
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr")
            ):
                target = node.args[0] if node.args else None
                asks_the_build = isinstance(target, ast.Name) and target.id == "_kernels"
                assert path == front or not asks_the_build, path


MOST_ENGINE_FLOORS = 10  # 17 before the rooms: a new floor is a chain to shorten, not a number to raise


def longest_import_chain(package: str) -> list[str]:
    """The longest chain of imports between the package's modules (a folder's __init__ holds no code here,
    so it is not a floor of its own)."""
    modules = {m: p for m, p in _modules(package).items() if p.name != "__init__.py"}
    graph = {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}
    chains: dict[str, list[str]] = {}

    def chain(module: str) -> list[str]:
        if module not in chains:
            chains[module] = [module, *max((chain(n) for n in graph[module]), key=len, default=[])]
        return chains[module]

    return max((chain(m) for m in graph), key=len)


def test_the_engines_import_chains_stay_short():
    floors = longest_import_chain("engine")
    assert len(floors) <= MOST_ENGINE_FLOORS, " -> ".join(floors)


def test_the_rules_would_catch_a_violation(tmp_path):
    """The checker itself: a cycle and a forbidden import written to a file are found."""
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from colibri_stream.cli import run\nimport colibri_stream.bench.suite\n")
    assert {"colibri_stream.cli.run", "colibri_stream.bench.suite"} <= _imports(path)


def test_no_unsafe_loaders_in_package_code():
    for package in ("colibri_stream", "engine", "storage"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert "pickle.load" not in text and "torch.load(" not in text, path
