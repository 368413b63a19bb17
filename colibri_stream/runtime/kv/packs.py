"""KV packs (storage/kv/pack.py) to and from a model's prefix cache: `kv export` writes the cached blocks
of a token sequence (a session's conversation, a preamble) to one file; `kv import` checks it was made
by this model with this chat template, that its values are ones the model produces (and, asked to,
recomputes some of them: pack_checks.py), and adds its blocks to the prefix cache of one tenant, each
recording the pack it came from, so a request starting with that preamble computes only what follows it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from colibri_stream.errors import SessionError
from colibri_stream.planning.kv_bytes import kv_geometry
from colibri_stream.runtime.kv.pack_checks import (
    Recompute,
    check_values,
    default_tolerance,
    value_bounds,
    verify_positions,
)
from colibri_stream.runtime.kv.prefix_cache import BLOCK_TOKENS, PrefixCache
from storage.kv.pack import PackHeader, read_pack_header, read_pack_records, write_pack
from storage.kv.prefix_blocks import Block
from storage.kv.prefix_store import PrefixConfig


def template_digest(template: str, bos: str, eos: str) -> str:
    """What a pack's tokens were rendered with, as a short digest: the template and its special tokens."""
    return hashlib.sha256("\x00".join((template, bos, eos)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Imported:
    positions: int
    blocks_added: int
    name: str


def export_pack(
    prefix: PrefixCache, ids: Sequence[int], path: Path, name: str, chat_template: str, tenant: str | None = None
) -> int:
    """Write ``tenant``'s cached blocks ``ids`` starts with to ``path``; SessionError when none is cached (the
    message says how to compute them). Returns the positions written (whole blocks only)."""
    blocks = []
    for key in prefix.block_keys(ids, len(ids), tenant):
        got = prefix.store.get(key)
        if got is None:
            break
        blocks.append(got[0])
    wanted = len(ids) // BLOCK_TOKENS
    if not blocks:
        raise SessionError(
            f"none of the {wanted} block(s) of {BLOCK_TOKENS} tokens of {name!r} is in the prefix cache: run the "
            "prompt once (colibri-stream run MODEL --prompt ... --max-new-tokens 1) with the same --dtype, "
            "--activations and --kv-dtype, then export"
        )
    namespace = prefix.store.namespace
    header = PackHeader(namespace.fingerprint, namespace.geometry, dict(namespace.state), name, chat_template, 0)
    return write_pack(path, header, ((block.tokens, block.payloads) for block in blocks))


@dataclass(frozen=True)
class ImportOptions:
    """How a pack is imported: into ``tenant``'s namespace (None: the one of a server without API keys, or
    with a shared prefix cache), with ``verify`` leading and ``verify`` drawn positions recomputed
    (pack_checks.py; 0: bounds only) within ``tolerance`` (None: the compute state's default)."""

    tenant: str | None = None
    verify: int = 0
    tolerance: float | None = None


def import_pack(
    kv_dir: Path,
    fingerprint: str,
    chat_template: str,
    path: Path,
    config: PrefixConfig,
    recompute: Recompute,
    options: ImportOptions | None = None,
) -> Imported:
    """Add the pack's blocks to the model's prefix cache (in the state the pack was computed in, in
    ``options.tenant``'s namespace, each block recording where it came from). Refused, naming what differs,
    when another model or chat template made it; refused whole when damaged, when a value is not finite or
    beyond what the model produces, or when a verified position disagrees with the model (pack_checks.py)."""
    options = options or ImportOptions()
    header = read_pack_header(path)
    args = recompute.args
    if header.fingerprint != fingerprint:
        raise SessionError(
            f"{path}: KV pack {header.name!r} was made by another model (its fingerprint {header.fingerprint[:16]}, "
            f"this model's {fingerprint[:16]})"
        )
    if header.chat_template != chat_template:
        raise SessionError(
            f"{path}: KV pack {header.name!r} was rendered with another chat template (digest {header.chat_template}, "
            f"this model's {chat_template}): its tokens would not be the prompts this model's template renders"
        )
    if header.geometry != kv_geometry(args, header.geometry.dtype) or header.geometry != recompute.geometry:
        raise SessionError(f"{path}: KV pack {header.name!r} has another KV geometry than this model's records")
    tokens, payloads = _checked_records(path, header, recompute)
    if options.verify > 0:
        tolerance = options.tolerance if options.tolerance is not None else default_tolerance(recompute)
        verify_positions(path, header.name, tokens.tolist(), payloads, recompute, options.verify, tolerance)
    prefix = PrefixCache.open(kv_dir, fingerprint, args, header.geometry.dtype, header.state, config)
    ids = tokens.tolist()
    keys = prefix.block_keys(ids, len(ids), options.tenant)  # a shorter tail keys nothing: packs hold whole blocks
    origin, added = _origin(path, header.name), 0
    for index, key in enumerate(keys):
        if not prefix.store.contains(key):
            block = slice(index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS)
            tenant = options.tenant or ""
            prefix.store.put(key, Block(block.start, tokens[block].copy(), payloads[block].copy(), tenant, origin))
            added += 1
    return Imported(len(keys) * BLOCK_TOKENS, added, header.name)


def _checked_records(path: Path, header: PackHeader, recompute: Recompute) -> tuple[np.ndarray, np.ndarray]:
    """Every record's tokens and payloads, each chunk's checksums and values checked before any is added."""
    bounds = value_bounds(recompute)
    tokens, payloads = [], []
    for index, (ids, chunk) in enumerate(read_pack_records(path, header, BLOCK_TOKENS)):
        check_values(path, header.name, index * BLOCK_TOKENS, chunk, recompute, bounds)
        tokens.append(ids)
        payloads.append(chunk)
    if not tokens:
        return np.empty(0, dtype=np.uint32), np.empty((0, header.geometry.payload_bytes), dtype=np.uint8)
    return np.concatenate(tokens), np.concatenate(payloads)


def _origin(path: Path, name: str) -> str:
    """Where imported blocks came from, as their headers record it: the pack's name, file and SHA-256, and
    the time of the import (UTC)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"pack {name[:64]!r} file {path.name[:64]!r} sha256 {digest.hexdigest()} imported {when}"
