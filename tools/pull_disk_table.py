"""The docs/pull.md disk-peak table: whole download + `convert` against `pull`, for DeepSeek-V3, Kimi-K2
and DeepSeek-V4-Flash.

    python tools/pull_disk_table.py

The container's size is `pull`'s own estimate (convert/pull_space.py: what `plan` sizes, per file and
directory) for `convert`'s defaults, from the configs in tools/plan_table.py. Checkpoint and shard sizes
are the published figures as we know them, written below with where each comes from; nothing is
downloaded (this machine has no network). Whole: the checkpoint and the container on disk at once.
Pull: the container plus the 2 largest shards (the default --in-flight) plus the shard index.
"""

from __future__ import annotations

from dataclasses import dataclass

from plan_table import MODELS

from colibri_stream.convert.pull_space import container_bytes
from colibri_stream.planning.geometry import ContainerTarget, geometry_from_config

GB = 1e9


@dataclass(frozen=True)
class Published:
    checkpoint_bytes: float
    shards: int
    largest_shard_bytes: float
    index_bytes: float
    source: str


PUBLISHED = {
    # model.safetensors.index.json total_size 688,586,727,753 (weights; the files add their headers);
    # model-000NN-of-000163, ~4.3 GB each (the last ones smaller)
    "DeepSeek-V3 / R1": Published(688.6 * GB, 163, 4.3 * GB, 8.9e6, "HF listing: 163 shards, 688.6 GB"),
    # model-N-of-61.safetensors, ~1.03 TB in all: ~16.9 GB a shard (assumed even)
    "Kimi-K2": Published(1029 * GB, 61, 16.9 * GB, 9.2e6, "HF listing: 61 shards, ~1.03 TB (assumed 16.9 GB each)"),
    # not checked against the Hub: the checkpoint computed from the config (FP4 experts + e8m0 scales as the
    # container copies them, FP8 dense at half the container's bf16), shards assumed ~4 GB as DeepSeek cuts them
    "DeepSeek-V4-Flash": Published(0.0, 40, 4.0 * GB, 5.0e6, "estimated from the config; shards assumed 4 GB"),
}


def main() -> None:
    rows = ["| model | checkpoint GB | shards | container GB | whole download + convert GB | pull GB | saved |"]
    rows.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, published in PUBLISHED.items():
        geometry = geometry_from_config(MODELS[name], ContainerTarget())
        container = container_bytes(geometry, ContainerTarget().quant_group_size)
        checkpoint = published.checkpoint_bytes or geometry.expert_bytes + (container - geometry.expert_bytes) / 2
        whole = checkpoint + container
        pull = container + 2 * published.largest_shard_bytes + published.index_bytes
        rows.append(
            f"| {name} | {checkpoint / GB:.1f} | {published.shards} x {published.largest_shard_bytes / GB:.1f} | "
            f"{container / GB:.1f} | {whole / GB:.1f} | {pull / GB:.1f} | {1 - pull / whole:.0%} |"
        )
    print("\n".join(rows))
    print()
    for name, published in PUBLISHED.items():
        print(f"- {name}: {published.source}")


if __name__ == "__main__":
    main()
