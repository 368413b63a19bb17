"""The pieces without processes: who holds which expert, the message layout, the coordinator's flags
(and what it refuses before starting any)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from colibri_stream.errors import ColibriError
from colibri_stream.experts.cluster import wire
from colibri_stream.experts.cluster.group import ClusterOptions, local_worker_flags
from colibri_stream.experts.cluster.shares import deal, measured_owners, read_expert_map, share_weights
from colibri_stream.experts.cluster.wire import Hello, Op
from storage.tiers.config import StoreConfig
from storage.tiers.stats import StoreStats

RECORD = 1000


def hello(rank: int, ram_records: int, disk: int) -> Hello:
    return Hello(rank, f"host{rank}", 100 + rank, 3, 10, RECORD, ram_records * RECORD, disk, 0)


def test_shares_fill_ram_first_then_split_the_rest_by_disk_speed():
    # 30 records; RAM holds 4 + 2, the other 24 go 3:1 by disk speed -> 4 + 18 = 22 and 2 + 6 = 8
    assert share_weights([hello(1, 4, 300), hello(2, 2, 100)], 30) == pytest.approx([22, 8])
    # everything fits: shares follow the RAM slots (each then holds its whole share in RAM)
    assert share_weights([hello(1, 20, 1), hello(2, 10, 999)], 30) == pytest.approx([20, 10])
    assert share_weights([hello(1, 90, 1), hello(2, 15, 1)], 30) == pytest.approx([20, 10])  # 90 counts as 30
    # speeds not measured (0: local workers on one disk) count as equal
    assert share_weights([hello(1, 0, 0), hello(2, 0, 0)], 30) == pytest.approx([15, 15])


def test_dealing_follows_the_weights_in_every_layer_and_interleaves():
    owners = deal([2.0, 1.0], [1, 2], 3, 12)
    assert owners.shape == (3, 12)
    for layer in owners:
        assert (layer == 1).sum() == 8 and (layer == 2).sum() == 4
    assert owners[0].tolist()[:6] == [1, 2, 1, 1, 2, 1]  # no run of one worker's experts
    assert torch.equal(measured_owners([hello(1, 0, 0), hello(2, 0, 0)], 2, 4), torch.tensor([[1, 2, 1, 2]] * 2))


def test_an_explicit_map_is_checked_with_the_file_and_the_id(tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"1": [0, 2, 3], "2": [1]}))
    assert read_expert_map(path, [1, 2], 2, 4).tolist() == [[1, 2, 1, 1]] * 2
    for bad, message in [
        ({"1": [0, 1, 2], "2": [2, 3]}, "expert 2 is given to worker 1 and worker 2"),
        ({"1": [0, 1, 2]}, r"no worker holds expert\(s\) \[3\]"),
        ({"3": [0, 1, 2, 3]}, "'3' is not a worker rank"),
        ({"1": [0, 1, 2, 9]}, "expert 9 outside 0..3"),
        ({"1": "0-3"}, "expected a list of expert ids"),
        ([0, 1], "expected an object"),
    ]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ColibriError, match=message):
            read_expert_map(path, [1, 2], 2, 4)
    path.write_text("{not json")
    with pytest.raises(ColibriError, match="map.json: not valid JSON"):
        read_expert_map(path, [1, 2], 2, 4)


def test_a_sum_request_round_trips_through_one_payload():
    x = torch.randn(3, 7, dtype=torch.bfloat16)  # an odd width, a 2-byte dtype
    ids, weights, guess = torch.tensor([[1, 4], [0, 2], [3, 4]]), torch.rand(3, 2), torch.tensor([5, 6, 7])
    assigned = torch.tensor([0, 4])
    specs = wire.sum_payload_specs(3, 2, 7, torch.bfloat16, 3, 2)
    payload = torch.frombuffer(
        bytearray(b"".join(wire.tensor_bytes(t).tobytes() for t in (guess, assigned, ids, weights, x))),
        dtype=torch.uint8,
    )
    assert payload.numel() == wire.payload_bytes(specs) == 24 + 16 + 48 + 24 + 42
    for got, sent in zip(wire.unpack(payload, specs), (guess, assigned, ids, weights, x), strict=True):
        assert torch.equal(got, sent)
    with pytest.raises(ValueError, match="payload of"):
        wire.unpack(payload[:-2], specs)
    head = wire.decode_head(wire.encode_head(Op.SUM, 154, 5, 3, 2, 7, 1, wire.FLAG_ROWS_ALONE, 6, 3, 2))
    assert head.op == Op.SUM and head.payload_bytes == 154 and head.values[:9] == (5, 3, 2, 7, 1, 1, 6, 3, 2)
    with pytest.raises(wire.WorkerError, match="not a colibri-stream frame"):
        wire.decode_head(b"GET / HTTP/1.1\r\nHost: x\r\n" + bytes(wire.HEAD.size - 25))


def test_hello_and_stats_survive_the_wire():
    sent = Hello(2, "box-" + "x" * 80, 4242, 58, 256, 7 << 20, 48 << 30, 3 << 30, 0xDEADBEEF)
    got = wire.read_hello(wire.hello_values(sent), sent.host.encode())
    assert got == dataclasses.replace(sent, host=sent.host[: wire.HOST_BYTES])  # a long host name is cut
    assert got.name() == f"worker 2 ({got.host}, pid 4242)"
    values = (99, *wire.hello_values(sent)[1:])
    with pytest.raises(wire.WorkerError, match="protocol 99"):
        wire.read_hello(values, b"box")
    stats = StoreStats(requests=10, hits_ram=6, misses=4, expert_bytes_read=12345, io_wait_s=0.25)
    assert wire.read_stats(wire.stats_tensor(stats, 7, 96)) == (stats, 7, 96)


def test_cluster_options_refuse_what_cannot_form_a_group():
    assert ClusterOptions(local_workers=2).checked_world_size() == 3
    assert ClusterOptions(world_size=4, master_port=29500).checked_world_size() == 4
    assert not ClusterOptions().enabled
    for options, message in [
        (ClusterOptions(world_size=1, master_port=1), "at least one worker"),
        (ClusterOptions(world_size=3), "needs --master-port"),
        (ClusterOptions(world_size=3, local_workers=1), "--world-size 3 with --local-workers 1"),
    ]:
        with pytest.raises(ColibriError, match=message):
            options.checked_world_size()


def test_replicas_without_a_usage_history_are_refused_before_any_worker_starts(make_container):
    import psutil

    from colibri_stream.experts.cluster.group import connect
    from storage.container.reader import Container

    container = Container(make_container("deepseek_v3", "int4"))
    with pytest.raises(ColibriError, match="--replicas 2 .* give --history FILE"):
        connect(container, ClusterOptions(local_workers=2, replicas=2), StoreConfig(ram_bytes=10_000))
    assert not [p for p in psutil.Process().children() if "--rank" in p.cmdline()]


def test_local_workers_split_the_budget_and_keep_their_own_history(tmp_path):
    store = StoreConfig(ram_bytes=10_000, vram_bytes=3_000, vram_device="cpu", prefetch=False, direct=False)
    store = StoreConfig(**{**vars(store), "history_path": tmp_path / "h.json", "threads": 2, "preload": False})
    flags = local_worker_flags(store, 3, 2)
    assert flags[flags.index("--ram") + 1] == "3333" and flags[flags.index("--vram") + 1] == "1000"
    assert "--no-prefetch" in flags and "--buffered" in flags and flags[flags.index("--io-threads") + 1] == "2"
    assert "--no-preload" in flags and "--no-preload" not in local_worker_flags(StoreConfig(ram_bytes=10_000), 3, 2)
    assert flags[flags.index("--history") + 1] == f"{tmp_path / 'h.json'}.worker2"
