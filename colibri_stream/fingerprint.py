"""What identifies a model's state files, in one place.

Two scopes, on purpose: a KV log belongs to the weights, config *and* tokenizer (``model_fingerprint``,
also naming the session directory); a usage history belongs to the routed experts and the config
only (``container_fingerprint``), so re-tokenising does not throw away what the router taught the
hot store. Both are cheap: metadata and stored checksums, never the weights themselves.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from storage.container import Container

_METADATA_FILES = ("config.json", "tokenizer.json", "zarr.json", "model.safetensors.index.json")


def model_fingerprint(path: str | Path) -> str:
    """A checkpoint directory or container: its config, tokenizer, container metadata (which holds
    every expert's checksum) and, for HF directories, shard names and sizes."""
    path = Path(path)
    digest = hashlib.sha256()
    for name in _METADATA_FILES:
        if (path / name).is_file():
            digest.update(name.encode() + (path / name).read_bytes())
    for shard in sorted(path.glob("*.safetensors")):
        digest.update(f"{shard.name}:{shard.stat().st_size}".encode())
    return digest.hexdigest()[:32]


def container_fingerprint(container: Container) -> str:
    """A container's config and expert checksums: what a usage history was learned on."""
    payload = json.dumps({"config": container.model_config, "experts": container.attrs["experts"]}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]
