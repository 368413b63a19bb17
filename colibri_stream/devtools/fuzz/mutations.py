"""Hypothesis strategies for small hostile edits of a valid input, and the code that applies them.

A mutation is plain JSON (so a finding's repro can be printed and replayed): a list of ops such as
``{"op": "set", "path": ["hidden_size"], "value": 10000000}`` or ``{"op": "truncate", "at": 0.4}``.
Positions are drawn as fractions or large integers taken modulo what the input holds, so one strategy
fits every file and shrinking moves towards the start of the file / the first key.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

CANARY = "{CANARY}"
_DEEP_MARK = "\u0001deep:"  # replaced by the absolute path of a file outside the case's inputs
HUGE_STRING_CHARS = 1 << 20

# Values that break parsers: zero, negatives, non-finite, past int64, huge, wrong types, hostile paths.
NASTY_SCALARS: list[Any] = [
    0,
    -1,
    1,
    2,
    10**7,
    2**31,
    2**63,
    -(2**63),
    10**30,
    1e300,
    0.5,
    -0.0,
    float("nan"),
    float("inf"),
    float("-inf"),
    True,
    False,
    None,
    "",
    "x",
    "0",
    "-1",
    "NaN",
    "1e309",
    "\u0000",
    "é\ud7ff",
    "../outside/canary",
    CANARY,
    "/dev/zero",
    "/proc/self/environ",
]
_nasty = st.one_of(
    st.sampled_from(NASTY_SCALARS),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.just({"huge_string": HUGE_STRING_CHARS}),
    st.just({"deep_list": 100_000}),
    st.just({"long_list": 1_000_000}),
    st.just([]),
    st.just({}),
    st.lists(st.integers(-5, 5), max_size=4),
)


def json_op() -> st.SearchStrategy[dict[str, Any]]:
    """One edit of a JSON document: a node picked by index (modulo the node count)."""
    return st.one_of(
        st.fixed_dictionaries({"op": st.just("set"), "node": st.integers(0, 10**6), "value": _nasty}),
        st.fixed_dictionaries({"op": st.just("delete"), "node": st.integers(0, 10**6)}),
        st.fixed_dictionaries({"op": st.just("retype"), "node": st.integers(0, 10**6)}),
        st.fixed_dictionaries({"op": st.just("add"), "node": st.integers(0, 10**6), "value": _nasty}),
    )


HOSTILE_PATHS = [CANARY, "../outside/canary", "../../outside/canary", "/etc/passwd", "/dev/zero", ".", "..", "",
                 "sub/../../outside/canary", "model.safetensors/", "\u0000"]  # fmt: skip


def path_op() -> st.SearchStrategy[dict[str, Any]]:
    """Point a string that names a file (picked by index among the document's strings) elsewhere."""
    return st.fixed_dictionaries({"op": st.just("set"), "node": st.integers(0, 10**6),
                                  "value": st.sampled_from(HOSTILE_PATHS), "strings_only": st.just(True)})  # fmt: skip


def json_ops() -> st.SearchStrategy[list[dict[str, Any]]]:
    return st.lists(json_op(), min_size=1, max_size=3)


def bytes_op() -> st.SearchStrategy[dict[str, Any]]:
    """One edit of a binary file; ``at`` is a fraction of its size."""
    at = st.floats(0.0, 1.0)
    return st.one_of(
        st.fixed_dictionaries({"op": st.just("truncate"), "at": at}),
        st.fixed_dictionaries({"op": st.just("flip"), "at": at, "bit": st.integers(0, 7)}),
        st.fixed_dictionaries({"op": st.just("overwrite"), "at": at, "data": st.binary(min_size=1, max_size=16)}),
        st.fixed_dictionaries({"op": st.just("append"), "data": st.binary(min_size=1, max_size=64)}),
        st.fixed_dictionaries({"op": st.just("sparse"), "size": st.sampled_from([1 << 32, 1 << 40, (1 << 40) + 3])}),
    )


def file_op() -> st.SearchStrategy[dict[str, Any]]:
    """Replace a file by something that is not a regular file. (No symlink to the canary: Hugging Face
    snapshot directories are symlinks into ../../blobs, so following a model file's symlink is normal;
    containment is about paths *named inside* the inputs.)"""
    return st.fixed_dictionaries(
        {"op": st.just("special"), "kind": st.sampled_from(["missing", "dir", "fifo", "dev-zero", "empty"])}
    )


# ----------------------------------------------------------------------------------------- applying


def decode_value(value: Any) -> Any:
    """Expand the compact stand-ins for big values (kept small in the repro)."""
    if isinstance(value, dict) and len(value) == 1:
        ((kind, n),) = value.items()
        if kind == "huge_string":
            return "A" * n
        if kind == "deep_list":
            return f"{_DEEP_MARK}{n}"  # written as n nested brackets by dump_json (json.dumps would recurse)
        if kind == "long_list":
            return [7] * n
    return value


def _nodes(doc: Any, path: tuple = ()) -> list[tuple]:
    """Every node's path, parents before children, in document order."""
    found = [path]
    if isinstance(doc, dict):
        for key in doc:
            found += _nodes(doc[key], (*path, key))
    elif isinstance(doc, list):
        for i, item in enumerate(doc):
            found += _nodes(item, (*path, i))
    return found


def _get(doc: Any, path: tuple) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def _retyped(value: Any) -> Any:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return {str(i): v for i, v in enumerate(value)}
    if isinstance(value, dict):
        return list(value.values())
    return 0


def apply_json_ops(doc: Any, ops: list[dict[str, Any]], canary: str) -> tuple[Any, list[dict[str, Any]]]:
    """Apply ops; return the new document and the ops resolved to key paths (for the repro)."""
    resolved = []
    for op in ops:
        nodes = _nodes(doc)
        if op.get("strings_only"):
            nodes = [n for n in nodes if isinstance(_get(doc, n), str)] or nodes
        path = nodes[op["node"] % len(nodes)]
        value = op.get("value")
        if isinstance(value, str):
            value = value.replace(CANARY, canary)
        # A copy: hypothesis may hand the same list to two ops, and adding it inside itself would
        # make a cycle (a document no file can hold, and one _nodes would recurse into forever).
        value = copy.deepcopy(decode_value(value))
        step = {"op": op["op"], "path": list(path)}
        if op["op"] == "set":
            doc = _set(doc, path, value)
            step["value"] = op["value"]
        elif op["op"] == "retype":
            doc = _set(doc, path, _retyped(_get(doc, path)))
        elif op["op"] == "delete" and path:
            parent = _get(doc, path[:-1])
            del parent[path[-1]]
        elif op["op"] == "add":
            target = _get(doc, path)
            if isinstance(target, dict):
                target[f"fuzz_{op['node'] % 97}"] = value
            elif isinstance(target, list):
                target.append(value)
            else:
                doc = _set(doc, path, value)
            step["value"] = op["value"]
        resolved.append(step)
    return doc, resolved


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def dump_json(doc: Any) -> str:
    """JSON as Python writes it, NaN/Infinity included (what a hostile file may hold)."""
    text = json.dumps(doc, allow_nan=True)
    for match in set(re.findall(r'"\\u0001deep:(\d+)"', text)):
        n = int(match)
        text = text.replace(f'"\\u0001deep:{n}"', "[" * n + "]" * n)
    return text


def apply_bytes_op(path: Path, op: dict[str, Any]) -> None:
    size = path.stat().st_size
    if op["op"] == "truncate":
        os.truncate(path, math.floor(size * op["at"]))
    elif op["op"] == "flip" and size:
        offset = min(size - 1, math.floor(size * op["at"]))
        with path.open("r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << op["bit"])]))
    elif op["op"] == "overwrite" and size:
        offset = min(size - 1, math.floor(size * op["at"]))
        with path.open("r+b") as f:
            f.seek(offset)
            f.write(op["data"] if isinstance(op["data"], bytes) else bytes.fromhex(op["data"]))
    elif op["op"] == "append":
        with path.open("ab") as f:
            f.write(op["data"] if isinstance(op["data"], bytes) else bytes.fromhex(op["data"]))
    elif op["op"] == "sparse":
        os.truncate(path, op["size"])  # a huge file of holes: costs no disk


def apply_file_op(path: Path, op: dict[str, Any], canary: str) -> None:
    kind = op["kind"]
    if path.is_dir() and not path.is_symlink():
        import shutil

        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "empty":
        path.write_bytes(b"")


def printable(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ops as JSON (bytes as hex) for the repro file."""
    return [{k: (v.hex() if isinstance(v, bytes) else v) for k, v in op.items()} for op in ops]
