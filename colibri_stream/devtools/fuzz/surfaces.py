"""Every input surface as data: which base inputs a case copies, which files it edits and how, and
the commands that read them. ``draw`` is the hypothesis strategy of one case; ``prepare`` applies a
drawn edit to a fresh case directory and returns the ``Case`` to run."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from colibri_stream.devtools.fuzz import cluster_frames as frames
from colibri_stream.devtools.fuzz import mutations as mut
from colibri_stream.devtools.fuzz.bases import PROMPT_IDS, SESSION, copy_case
from colibri_stream.devtools.fuzz.harness import Case
from colibri_stream.devtools.fuzz.hub_surface import HUB_SCENARIOS
from colibri_stream.devtools.fuzz.pack_scenario import PACK_SCENARIO
from colibri_stream.devtools.fuzz.scenarios import SCENARIOS, Scenario
from colibri_stream.devtools.fuzz.templates import hostile_template

GEN = ["--max-new-tokens", "2", "--json"]
RUN_CKPT = ["run", "ckpt", "--ids", "1,2,3", *GEN]
RUN_CONTAINER = ["run", "container", "--ids", PROMPT_IDS, "--ram", "50%", "--buffered", *GEN]
RUN_SESSION = [*RUN_CONTAINER, "--kv-dir", "kv", "--session", SESSION]
CONVERT = ["convert", "ckpt", "out.cstream"]


@dataclass(frozen=True)
class Surface:
    name: str
    entries: tuple[str, ...]  # base inputs the case copies
    targets: Callable[[Path], list[str]]  # the files an edit may pick (relative to the case dir)
    edit: str  # how the picked file is edited: a key of EDITS
    commands: tuple[tuple[str, ...], ...]  # what reads it (the case picks one)
    stdin: str = ""
    kind: str = "cli"

    def draw(self) -> st.SearchStrategy[dict[str, Any]]:
        return st.fixed_dictionaries(
            {
                "target": st.integers(0, 10**6),
                "ops": EDITS[self.edit],
                "command": st.integers(0, len(self.commands) - 1),
            }
        )

    def prepare(self, base: Path, case_dir: Path, drawn: dict[str, Any], canary: str) -> Case:
        copy_case(base, case_dir, self.entries)
        (case_dir / "home").mkdir()
        targets = sorted(self.targets(case_dir))
        target = targets[drawn["target"] % len(targets)]
        resolved = APPLY[self.edit](case_dir / target, drawn["ops"], canary)
        argv = list(self.commands[drawn["command"]])
        common: dict[str, Any] = dict(
            surface=self.name, cwd=str(case_dir), mutation=[{"file": target}, *resolved], mutated=[target]
        )
        if self.kind == "call":
            return Case(kind="call", target=argv[0], args=[str(case_dir / a) for a in argv[1:]], **common)
        return Case(argv=argv, stdin=self.stdin, **common)


def _files(*patterns: str) -> Callable[[Path], list[str]]:
    def find(case_dir: Path) -> list[str]:
        return [str(p.relative_to(case_dir)) for pattern in patterns for p in case_dir.glob(pattern) if p.is_file()]

    return find


# ------------------------------------------------------------------------------------------- edits

# What an output path (--trace, --kv-dir, --history, convert's OUT, bench --work) may be when a command
# runs: each must work or be refused in one line, never hang (a FIFO), write through a device or a link
# out of the case, or leave a traceback.
OUT_KINDS = (
    "missing", "empty-file", "file", "dir", "nonempty-dir", "fifo", "dev-null", "dev-full", "link-dir",
    "link-file", "dangling", "link-loop", "proc",
)  # fmt: skip
NOT_A_DIRECTORY = ("empty-file", "file", "fifo", "dev-null", "dev-full", "link-file", "link-loop", "proc")
# What a symbolic link planted in the KV directory (as a log, transcript, lock or prefix file) may point
# at: a canary outside the case (must never be read, written or removed through the link), or nothing.
LINK_TARGETS = ("canary", "canary.json", "canary.d", "dangling", "self", "dev-zero", "fifo")


def _kinds(kinds: tuple[str, ...]) -> st.SearchStrategy[list[dict]]:
    return st.lists(
        st.fixed_dictionaries({"op": st.just("path"), "kind": st.sampled_from(kinds)}), min_size=1, max_size=1
    )


def _make_path(path: Path, ops: list[dict], canary: str) -> list[dict]:
    """Put the drawn kind of thing at ``path`` (which does not exist yet)."""
    kind = ops[0]["kind"]
    if kind in ("empty-file", "file"):
        path.write_bytes(b"" if kind == "empty-file" else b"not an output of ours\n")
    elif kind in ("dir", "nonempty-dir"):
        path.mkdir()
        if kind == "nonempty-dir":
            (path / "keep.txt").write_text("someone else's file\n")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind in ("dev-null", "dev-full", "proc"):
        path.symlink_to({"dev-null": "/dev/null", "dev-full": "/dev/full", "proc": "/proc/self/status"}[kind])
    elif kind in ("link-dir", "link-file"):
        target = path.with_name(path.name + "-target")
        target.mkdir() if kind == "link-dir" else target.write_text("linked\n")
        path.symlink_to(target.name)
    elif kind == "dangling":
        path.symlink_to("nowhere/at/all")
    elif kind == "link-loop":
        path.symlink_to(path.name)
    return ops


def _plant_link(path: Path, ops: list[dict], canary: str) -> list[dict]:
    """Replace ``path`` (a KV directory entry, or a name a session would create) by a symbolic link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    to = ops[0]["to"]
    outside = Path(canary).parent
    if to in ("canary", "canary.json", "canary.d"):
        path.symlink_to(outside / to)
    elif to == "dangling":
        path.symlink_to(outside / "missing-file")
    elif to == "self":
        path.symlink_to(path.name)
    elif to == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        fifo = outside / "canary.fifo"
        if not fifo.exists():
            os.mkfifo(fifo)
        path.symlink_to(fifo)
    return ops


def _out_path(case_dir: Path) -> list[str]:
    return ["out"]


def _kv_entries(case_dir: Path) -> list[str]:
    """Every file of the KV directory, and the names a session creates there."""
    found = {str(p.relative_to(case_dir)) for p in (case_dir / "kv").rglob("*")}
    return sorted(found | {"kv/s.kvlog", "kv/s.chat.json", "kv/s.lock"})


_file_or = lambda ops: st.one_of(ops, st.lists(mut.file_op(), min_size=1, max_size=1))  # noqa: E731

EDITS: dict[str, st.SearchStrategy] = {
    "json": mut.json_ops(),
    "json-or-file": _file_or(mut.json_ops()),
    "index": st.one_of(_file_or(mut.json_ops()), st.lists(mut.path_op(), min_size=1, max_size=2)),
    "bytes": _file_or(st.lists(mut.bytes_op(), min_size=1, max_size=2)),
    "safetensors": st.one_of(
        st.lists(st.fixed_dictionaries({"op": st.just("header"), "edit": mut.json_op()}), min_size=1, max_size=3),
        st.lists(
            st.fixed_dictionaries(
                {"op": st.just("length"), "value": st.sampled_from([0, 1, 7, 2**20, 2**32, 2**63, 2**64 - 1])}
            ),
            min_size=1,
            max_size=1,
        ),
        st.lists(mut.bytes_op(), min_size=1, max_size=2),
        st.lists(mut.file_op(), min_size=1, max_size=1),
    ),
    "toml": st.one_of(mut.json_ops(), st.lists(mut.bytes_op(), min_size=1, max_size=2)),
    "lines": st.one_of(
        st.lists(
            st.fixed_dictionaries({"op": st.just("line"), "line": st.integers(0, 10**6), "edit": mut.json_op()}),
            min_size=1,
            max_size=3,
        ),  # fmt: skip
        st.lists(mut.bytes_op(), min_size=1, max_size=2),
    ),
    "outpath": _kinds(OUT_KINDS),
    "outpath-file": _kinds(NOT_A_DIRECTORY),
    "symlink": st.lists(
        st.fixed_dictionaries({"op": st.just("link"), "to": st.sampled_from(LINK_TARGETS)}), min_size=1, max_size=1
    ),
    "frames": frames.frames_ops(),
    "template": st.one_of(
        st.lists(
            st.fixed_dictionaries({"op": st.just("template"), "template": hostile_template()}), min_size=1, max_size=1
        ),  # fmt: skip
        mut.json_ops(),
    ),
}


def _edit_json(path: Path, ops: list[dict], canary: str) -> list[dict]:
    if ops[0]["op"] == "special":
        mut.apply_file_op(path, ops[0], canary)
        return ops
    doc, resolved = mut.apply_json_ops(json.loads(path.read_text()), ops, canary)
    path.write_text(mut.dump_json(doc))
    return resolved


def _edit_bytes(path: Path, ops: list[dict], canary: str) -> list[dict]:
    for op in ops:
        if op["op"] == "special":
            mut.apply_file_op(path, op, canary)
        else:
            mut.apply_bytes_op(path, op)
    return mut.printable(ops)


def _edit_safetensors(path: Path, ops: list[dict], canary: str) -> list[dict]:
    if ops[0]["op"] not in ("header", "length"):
        return _edit_bytes(path, ops, canary)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8 : 8 + n]), data[8 + n :]
    if ops[0]["op"] == "length":
        path.write_bytes(struct.pack("<Q", ops[0]["value"]) + data[8:])
        return ops
    header, resolved = mut.apply_json_ops(header, [op["edit"] for op in ops], canary)
    text = mut.dump_json(header).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    return [{"op": "header", **step} for step in resolved]


def _edit_toml(path: Path, ops: list[dict], canary: str) -> list[dict]:
    if ops[0]["op"] not in ("set", "delete", "retype", "add"):
        return _edit_bytes(path, ops, canary)
    doc, resolved = mut.apply_json_ops(tomllib.loads(path.read_text()), ops, canary)
    path.write_text(to_toml(doc))
    return resolved


def _edit_lines(path: Path, ops: list[dict], canary: str) -> list[dict]:
    if ops[0]["op"] != "line":
        return _edit_bytes(path, ops, canary)
    lines = path.read_text().splitlines()
    edited: dict[int, object] = {}  # line -> its document, kept parsed: a line made 100k deep is not re-read
    resolved = []
    for op in ops:
        number = op["line"] % len(lines)
        doc = edited[number] if number in edited else json.loads(lines[number])
        edited[number], steps = mut.apply_json_ops(doc, [op["edit"]], canary)
        resolved += [{"line": number, **step} for step in steps]
    for number, doc in edited.items():
        lines[number] = mut.dump_json(doc)
    path.write_text("\n".join(lines) + "\n")
    return resolved


def _edit_template(path: Path, ops: list[dict], canary: str) -> list[dict]:
    if ops[0]["op"] != "template":
        return _edit_json(path, ops, canary)
    config = json.loads(path.read_text())
    config["chat_template"] = ops[0]["template"].replace(mut.CANARY, canary)
    path.write_text(json.dumps(config))
    return ops


APPLY: dict[str, Callable[[Path, list[dict], str], list[dict]]] = {
    "json": _edit_json,
    "json-or-file": _edit_json,
    "index": _edit_json,
    "bytes": _edit_bytes,
    "safetensors": _edit_safetensors,
    "toml": _edit_toml,
    "lines": _edit_lines,
    "template": _edit_template,
    "outpath": _make_path,
    "outpath-file": _make_path,
    "symlink": _plant_link,
    "frames": frames.edit_frames,
}


def to_toml(doc: Any) -> str:
    """A minimal TOML writer for a budget: top-level tables of scalars (anything else as a string)."""
    if not isinstance(doc, dict):
        return f"value = {_toml_value(doc)}\n"
    lines = []
    for key, value in doc.items():
        if isinstance(value, dict):
            lines.append(f"[{json.dumps(str(key))}]")
            lines += [f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()]
        else:
            lines.insert(0, f"{json.dumps(str(key))} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(str(value), repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if value is None or isinstance(value, dict):
        return json.dumps(json.dumps(value))
    return json.dumps(str(value))


# ---------------------------------------------------------------------------------------- surfaces

SURFACES: dict[str, Surface | Scenario] = {
    s.name: s
    for s in (
        Surface("config", ("ckpt",), _files("ckpt/config.json"), "json",
                (tuple(RUN_CKPT), ("plan", "ckpt/config.json"), ("plan", "ckpt"))),
        Surface("safetensors", ("ckpt",), _files("ckpt/model.safetensors"), "safetensors",
                (tuple(RUN_CKPT), tuple(CONVERT), ("plan", "ckpt"))),
        Surface("shard-index", ("ckpt",), _files("ckpt/model.safetensors.index.json"), "index",
                (tuple(RUN_CKPT), tuple(CONVERT))),
        Surface("zarr-json", ("container",), _files("container/zarr.json", "container/*/zarr.json",
                "container/*/*/zarr.json"), "json",
                (tuple(RUN_CONTAINER), ("verify", "container"), ("plan", "container"))),
        Surface("chunks", ("container",), _files("container/experts/*/c/*/0", "container/dense/*/c/*",
                "container/dense/*/c/*/*"), "bytes",
                (tuple(RUN_CONTAINER), ("verify", "container"))),
        Surface("budget", ("container", "budget.toml"), _files("budget.toml"), "toml",
                (("plan", "container", "--budget", "budget.toml"), (*RUN_CONTAINER[:4], "--budget", "budget.toml",
                                                                    *GEN))),
        Surface("history", ("container", "history.json"), _files("history.json"), "json-or-file",
                ((*RUN_CONTAINER, "--history", "history.json", "--policy", "pinned"),)),
        Surface("trace", ("trace.jsonl",), _files("trace.jsonl"), "lines",
                (("colibri_stream.devtools.fuzz.calls:replay_trace", "trace.jsonl"),), kind="call"),
        Surface("kvlog", ("container", "kv"), _files("kv/*"), "bytes",
                (tuple(RUN_SESSION), ("kv", "info", "container", SESSION, "--kv-dir", "kv"),
                 ("kv", "ls", "container", "--kv-dir", "kv"))),
        Surface("chat-template", ("ckpt",), _files("ckpt/tokenizer_config.json"), "template",
                (("chat", "ckpt", "--max-new-tokens", "2", "--kv-dir", "kv", "--session", "t"),),
                stdin="hello\n"),
        Surface("output-paths", ("ckpt", "container"), _out_path, "outpath",
                ((*RUN_CONTAINER, "--trace", "out"), (*RUN_CONTAINER, "--kv-dir", "out", "--session", "s"),
                 (*CONVERT[:2], "out", "--no-progress"), (*RUN_CONTAINER, "--history", "out", "--policy", "pinned"),
                 ("chat", "ckpt", "--max-new-tokens", "2", "--kv-dir", "out", "--session", "t")),
                stdin="hello\n"),
        Surface("bench-work", (), _out_path, "outpath-file",
                (("bench", "--quick", "--sections", "disk", "--work", "out", "--out", "results"),)),
        Surface("kv-symlinks", ("container", "kv"), _kv_entries, "symlink",
                (tuple(RUN_SESSION), (*RUN_SESSION, "--reset"), ("kv", "info", "container", SESSION, "--kv-dir", "kv"),
                 ("kv", "ls", "container", "--kv-dir", "kv"), ("kv", "rm", "container", SESSION, "--kv-dir", "kv"),
                 ("chat", "container", "--max-new-tokens", "2", "--kv-dir", "kv", "--session", SESSION)),
                stdin="hello\n"),
        Surface("cluster-to-coordinator", ("container", "cluster"), _files(frames.TO_COORDINATOR), "frames",
                tuple((f"colibri_stream.devtools.fuzz.cluster_calls:{call}", frames.TO_COORDINATOR)
                      for call in ("to_coordinator_raw", "to_coordinator_sealed")), kind="call"),
        Surface("cluster-to-worker", ("container", "cluster"), _files(frames.TO_WORKER), "frames",
                tuple((f"colibri_stream.devtools.fuzz.cluster_calls:{call}", frames.TO_WORKER)
                      for call in ("to_worker_raw", "to_worker_sealed")), kind="call"),
    )
}  # fmt: skip
SURFACES.update(SCENARIOS)  # the multi-step ones: state changes between runs, concurrent writers, full disks
SURFACES.update(HUB_SCENARIOS)  # `pull` against a Hub that breaks its own listing
SURFACES[PACK_SCENARIO.name] = PACK_SCENARIO  # KV packs edited, imported, then run
