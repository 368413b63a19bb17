"""The KV-pack fuzz surface: a pack written by a real `kv export` (bases.PACK), edited the way a careless or
hostile tool would, then `kv import`ed (with or without ``--verify``, into a key's namespace or not) and, when
the import goes through, the pack's prompt run against the cache it filled and without any cache.

Edits keep every checksum valid (the checksums only say the bytes are the ones written): values set to NaN,
infinity, huge or random bytes (the import must refuse them: else BAD ``poisoned``), rows scaled or
negated within the bounds, the tokens replaced from a position on (an honest pack filed under other
tokens), header fields re-encoded with a valid checksum; and raw byte edits (checksums broken). Whatever
the edit: one-line refusals only, never a traceback. After an import that went through, the run's tokens
must be the uncached run's when the pack was not edited, or when ``--verify`` covered every position (else
BAD ``poisoned``); an in-bounds edit at positions no check drew is the documented limit of an unverified
import, not a finding.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

from colibri_stream.devtools.fuzz import mutations as mut
from colibri_stream.devtools.fuzz.bases import PACK, PACK_IDS
from colibri_stream.devtools.fuzz.harness import BAD_POISON
from colibri_stream.devtools.fuzz.scenarios import RUN, Scenario, Verdict, _bad, _finish, _must_not_break, _step

OUT_OF_BOUNDS = ("nan", "inf", "huge", "random")  # an import must refuse these
IN_BOUNDS = ("scale", "tokens")  # only recomputing tells these from honest values
HEADER_VALUES = ("", "x", "float64", "bfloat16", "int8", "float32", "../../canary", "0" * 200)


def kv_pack(case_dir: str, params_json: str, canary: str) -> int:
    params = json.loads(params_json)

    def run() -> None:
        os.chdir(case_dir)
        tokens = _edit(Path(PACK), params)
        flags = ["--verify", str(params["verify"])] if params["verify"] else []
        if params["key"]:
            Path("key").write_text("sk-fuzz\n")
            flags += ["--key-file", "key"]
        imported = _must_not_break(_step(["kv", "import", "container", PACK, "--kv-dir", "kv-i", *flags]))
        edit = params["edit"]
        if imported.code != 0:
            raise Verdict(1, imported.error_lines[0])
        if edit in OUT_OF_BOUNDS:
            raise _bad(BAD_POISON, f"a pack with {edit} values was imported: {imported.out.strip()[-200:]}")
        if params["key"] or tokens is None:
            return  # the blocks are a key's (no run here sees them), or the edit left no tokens to prompt with
        prompt = ",".join(map(str, [*tokens, *params["extra"]]))
        cached = _must_not_break(_step([*RUN, "--ids", prompt, "--kv-dir", "kv-i"]))
        plain = _must_not_break(_step([*RUN, "--ids", prompt, "--kv-dir", "kv-r", "--no-prefix-cache"]))
        if cached.code != 0 or plain.code != 0:
            return
        got, want = cached.json()["ids"], plain.json()["ids"]
        covered = params["verify"] >= len(tokens)
        if got != want and (edit == "none" or covered):
            raise _bad(BAD_POISON, f"after importing a pack edited by {edit} (--verify {params['verify']}) the "
                       f"tokens are {got}; without the cache {want}")  # fmt: skip

    return _finish(run)


def _edit(path: Path, params: dict[str, Any]) -> list[int] | None:
    """Apply the drawn edit; the pack's tokens afterwards (None when the edit leaves no readable pack)."""
    from storage.kv.log import HEADER_BYTES, decode_header, encode_header, encode_records
    from storage.kv.pack import read_pack_header, read_pack_records

    edit = params["edit"]
    if edit == "bytes":
        for op in params["ops"]:  # drawn as JSON (printable): overwritten bytes as hex
            mut.apply_bytes_op(path, {**op, "data": bytes.fromhex(op["data"])} if "data" in op else op)
        return None
    header = read_pack_header(path)
    ids, payloads = (np.concatenate(x) for x in zip(*read_pack_records(path, header, 1024), strict=True))
    ids, payloads = ids.copy(), payloads.copy()
    raw = path.read_bytes()[:HEADER_BYTES]
    n, position = len(ids), params["position"] % len(ids)
    values = payloads.view(np.float32)  # the base pack's records are float32
    width = values.shape[1]
    start = params["row"] % width
    stop = min(width, start + params["span"])
    if edit == "nan":
        values[position, start] = np.nan
    elif edit == "inf":
        values[position, start] = -np.inf if params["negative"] else np.inf
    elif edit == "huge":
        values[position, start:stop] = -1e12 if params["negative"] else 1e12
    elif edit == "random":
        rows = payloads[position:]
        rows[:] = np.random.default_rng(params["seed"]).integers(0, 256, rows.shape, dtype=np.uint8)
    elif edit == "scale":
        values[position, start:stop] *= params["factor"]
    elif edit == "tokens":
        ids[position:] = (ids[position:] + params["shift"]) % 512
    elif edit == "header":
        meta = decode_header(raw, path)
        state = dict(meta["state"])
        state[params["field"]] = params["value"]
        try:
            raw = encode_header(str(meta["fingerprint"]), header.geometry, state)
        except Exception:  # the value does not fit a header: the edit is nothing
            return [int(i) for i in ids]
    records = encode_records(ids, payloads, 0, header.geometry.record_bytes)
    path.write_bytes(raw + records.tobytes())
    assert n == len(ids)
    return [int(i) for i in ids]


def _params() -> st.SearchStrategy[dict[str, Any]]:
    positions = len(PACK_IDS.split(",")) // 64 * 64
    header = st.fixed_dictionaries(
        {
            "field": st.sampled_from(["compute_dtype", "activations", "pack_name", "chat_template", "other"]),
            "value": st.sampled_from(HEADER_VALUES),
        }  # fmt: skip
    )
    return st.fixed_dictionaries(
        {
            "edit": st.sampled_from(["none", *OUT_OF_BOUNDS, *IN_BOUNDS, "header", "bytes"]),
            "position": st.integers(0, 10**6),
            "row": st.integers(0, 10**6),
            "span": st.integers(1, 64),
            "negative": st.booleans(),
            "seed": st.integers(0, 2**32 - 1),
            "factor": st.sampled_from([0.0, -1.0, 0.5, 2.0, 3.0]),
            "shift": st.integers(1, 511),
            "ops": st.lists(mut.bytes_op(), min_size=1, max_size=2).map(mut.printable),
            "verify": st.sampled_from([0, 0, 1, 4, positions, positions + 7]),
            "key": st.booleans(),
            "extra": st.lists(st.integers(1, 120), min_size=1, max_size=3),
        }
    ).flatmap(lambda p: header.map(lambda h: {**p, **h}) if p["edit"] == "header" else st.just(p))


PACK_SCENARIO = Scenario("kv-pack", ("container", PACK), "kv_pack", _params, module=__name__)
