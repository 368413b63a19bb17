"""KV packs (storage/kv/pack.py) to and from a model's prefix cache: `kv export` writes the cached blocks
of a token sequence (a session's conversation, a preamble) to one file; `kv import` checks it was made
by this model with this chat template and adds its blocks to the prefix cache, so a request starting
with that preamble computes only what follows it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from colibri_stream.errors import SessionError
from colibri_stream.planning.kv_bytes import kv_geometry
from colibri_stream.runtime.kv.prefix_cache import BLOCK_TOKENS, PrefixCache
from engine.config.args import ModelArgs
from storage.kv.pack import PackHeader, pack_tokens, read_pack_header, read_pack_records, write_pack
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


def export_pack(prefix: PrefixCache, ids: Sequence[int], path: Path, name: str, chat_template: str) -> int:
    """Write the cached blocks ``ids`` starts with to ``path``; SessionError when none is cached (the
    message says how to compute them). Returns the positions written (whole blocks only)."""
    blocks = []
    for key in prefix.block_keys(ids, len(ids)):
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


def import_pack(
    kv_dir: Path, fingerprint: str, args: ModelArgs, chat_template: str, path: Path, config: PrefixConfig
) -> Imported:
    """Add the pack's blocks to the model's prefix cache (in the state the pack was computed in). Refused,
    naming what differs, when another model or chat template made it; a damaged pack is refused whole."""
    header = read_pack_header(path)
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
    if header.geometry != kv_geometry(args, header.geometry.dtype):
        raise SessionError(f"{path}: KV pack {header.name!r} has another KV geometry than this model's records")
    ids = pack_tokens(path, header, BLOCK_TOKENS).tolist()  # every record checked before any is added
    prefix = PrefixCache.open(kv_dir, fingerprint, args, header.geometry.dtype, header.state, config)
    keys = prefix.block_keys(ids, len(ids))  # a shorter tail keys nothing: packs hold whole blocks
    added = 0
    records = read_pack_records(path, header, BLOCK_TOKENS)
    for index, (key, (tokens, payloads)) in enumerate(zip(keys, records, strict=False)):  # the tail: no key
        if not prefix.store.contains(key):
            prefix.store.put(key, Block(index * BLOCK_TOKENS, tokens.copy(), payloads.copy()))
            added += 1
    return Imported(len(keys) * BLOCK_TOKENS, added, header.name)
