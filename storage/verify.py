"""Full verification of a container: structure, shapes, and every checksum, one message per problem."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from storage.buffers import aligned_empty
from storage.container import Container, ExpertReader
from storage.errors import StorageError


def verify_container(path: str | Path) -> list[str]:
    """Every problem found, each naming its array or expert; empty when the container is sound."""
    try:
        container = Container(path)
    except StorageError as exc:
        return [str(exc)]
    return list(_dense_problems(container)) + list(_expert_problems(container)) + list(_file_problems(container))


def _dense_problems(container: Container) -> Iterator[str]:
    for name, entry in container.dense.items():
        try:
            container.read_dense(name)
            if entry.scales is not None:
                container.read_dense_scales(name)
        except StorageError as exc:
            yield str(exc)


def _expert_problems(container: Container) -> Iterator[str]:
    reader = ExpertReader(container)
    size = container.layout.record_bytes
    buffer = aligned_empty(size)
    for layer in container.moe_layers:
        try:
            container.check_expert_metadata(layer)
        except StorageError as exc:
            yield str(exc)
            continue
        for expert in range(container.n_experts):
            path = container.expert_path(layer, expert)
            if path.is_file() and os.path.getsize(path) != size:
                yield f"layer {layer} expert {expert}: {path} holds {os.path.getsize(path)} bytes, expected {size}"
                continue
            try:
                reader.read_into(layer, expert, buffer)
            except StorageError as exc:
                yield str(exc)


def _file_problems(container: Container) -> Iterator[str]:
    for name in container.attrs.get("files", []):
        if not (container.path / name).is_file():
            yield f"{container.path / name}: copied from the source checkpoint but now missing"
