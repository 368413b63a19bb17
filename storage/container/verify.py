"""Full verification of a container: structure, shapes, and every checksum, one message per problem."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from storage.container.mirror import copy_problems
from storage.container.reader import CONTENT_KEY, Container, ExpertReader, check_plain_name, content_sha256
from storage.errors import StorageError
from storage.files.buffers import aligned_empty

ModelCheck = Callable[[Container], list[str]]


def verify_container(path: str | Path, check_model: ModelCheck | None = None) -> list[str]:
    """Every problem found, each naming its array or expert; empty when the container is sound.

    ``check_model`` adds the problems of the model the container describes (its config, its dense
    table against that model): storage cannot judge a model config, the library can."""
    try:
        container = Container(path)
    except StorageError as exc:
        return [str(exc)]
    model = check_model(container) if check_model else []
    stored = [*_dense_problems(container), *_expert_problems(container), *_file_problems(container)]
    return model + stored + list(_digest_problems(container))


def _digest_problems(container: Container) -> Iterator[str]:
    """The published content digest against one recomputed from the stored checksums: every record can
    match its own checksum while records and checksums were swapped together (another model's
    weights, or the same ones in another order), which only the digest published at convert time shows."""
    published = container.attrs.get(CONTENT_KEY)
    if published is None:  # converted before the digest was published: nothing to compare with
        return
    recomputed = content_sha256(container.attrs)
    if published != recomputed:
        yield (
            f"{container.path}: {CONTENT_KEY} is {str(published)[:64]!r} but the stored checksums give "
            f"{recomputed}: the weights are not the ones converted (records and checksums changed together)"
        )


def _dense_problems(container: Container) -> Iterator[str]:
    for name, entry in {**container.dense, **container.kept}.items():
        try:
            container.read_dense(name)
            if entry.scales is not None:
                container.read_dense_scales(name)
        except StorageError as exc:
            yield str(exc)


def _expert_problems(container: Container) -> Iterator[str]:
    if container.parts is not None:  # spread or mirrored: every copy on every device
        yield from _spread_expert_problems(container)
        return
    reader = ExpertReader(container)
    buffer = None  # allocated once a chunk file of the layout's record size exists, not from metadata alone
    for layer in container.moe_layers:
        try:
            container.check_expert_metadata(layer)
        except StorageError as exc:
            yield str(exc)
            continue
        for expert in range(container.n_experts):
            try:
                container.check_expert_file(layer, expert)  # regular, exactly one record: nothing hangs
                buffer = aligned_empty(container.layout.record_bytes) if buffer is None else buffer
                reader.read_into(layer, expert, buffer)
            except StorageError as exc:
                yield str(exc)


def _spread_expert_problems(container: Container) -> Iterator[str]:
    for layer in container.moe_layers:
        try:
            container.check_expert_metadata(layer)
        except StorageError as exc:
            yield str(exc)
    yield from copy_problems(container, mirrored_only=False)


def _file_problems(container: Container) -> Iterator[str]:
    files = container.attrs.get("files", [])
    for name in files if isinstance(files, list) else [files]:
        try:
            check_plain_name(name, f"{container.path}: files")
        except StorageError as exc:
            yield str(exc)
            continue
        if not (container.path / name).is_file():
            yield f"{container.path / name}: copied from the source checkpoint but now missing"
