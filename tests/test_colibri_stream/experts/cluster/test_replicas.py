"""Replicas and the link, without worker processes: which experts are held twice, who computes each
expert of a request, and a link that fails alone (one socket per worker)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from colibri_stream.errors import ColibriError
from colibri_stream.experts.cluster.members import LOST, REJOINED, Member
from colibri_stream.experts.cluster.replicas import COORDINATOR, NONE, Holders, assign, with_replicas
from colibri_stream.experts.cluster.transport import Link, Reply
from colibri_stream.experts.cluster.wire import Hello, Op, WorkerError
from storage.tiers.history import UsageHistory
from storage.tiers.stats import StoreStats


def test_the_hottest_experts_of_each_layer_get_a_second_holder():
    owners = torch.tensor([[1, 2, 1, 2, 1], [2, 1, 2, 1, 2]])  # 2 MoE layers (model layers 3 and 5) x 5
    history = UsageHistory(5, counts={3: [0, 9, 1, 7, 0], 5: [4, 0, 0, 0, 5]})
    holders = with_replicas(owners, [3, 5], history, 2, [1, 2])
    # layer 3: experts 1 (owner 2) and 3 (owner 2) -> held by 1 too; layer 5: 4 (owner 2) and 0 (owner 2)
    assert holders.replicas.tolist() == [[NONE, 1, NONE, 1, NONE], [1, NONE, NONE, NONE, 1]]
    assert holders.replica_count() == 2
    assert holders.held_by(1).tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 1, 1]]
    # with three workers the second holder is the one holding the fewest so far
    three = with_replicas(
        torch.tensor([[1, 1, 2, 3, 3]]), [3], UsageHistory(5, counts={3: [5, 4, 3, 2, 1]}), 3, [1, 2, 3]
    )
    assert three.replicas.tolist() == [[2, 2, 1, NONE, NONE]]
    # no history: nothing to rank, no replicas; one worker: refused
    assert with_replicas(owners, [3, 5], None, 2, [1, 2]).replica_count() == 0
    with pytest.raises(ColibriError, match="needs a second worker"):
        with_replicas(torch.ones(1, 5, dtype=torch.int64), [3], history, 1, [1])


def test_each_expert_goes_to_a_serving_holder_the_less_loaded_of_two():
    owners, replicas = [1, 1, 1, 2, 2], [2, 2, NONE, NONE, 1]
    # 0 and 1 have two holders: 1 computes 2 and 2 computes 3, so 0 goes to its first holder (a tie), 1 to
    # worker 2 (1 is then the more loaded)
    assert assign([0, 1, 2, 3], owners, replicas, {1, 2}) == {1: [2, 0], 2: [3, 1]}
    # worker 1 lost: its replicated experts go to worker 2, the others to the coordinator
    assert assign([0, 1, 2, 4], owners, replicas, {2}) == {COORDINATOR: [2], 2: [0, 1, 4]}
    assert assign([0, 3], owners, replicas, set()) == {COORDINATOR: [0, 3]}


def links() -> tuple[Link, Link]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return Link(a, "worker 1"), Link(b, "the coordinator")


def test_replies_reach_their_requests_in_order_across_threads():
    coordinator, worker = links()
    first = Reply(Op.SUM, torch.empty(3, 5, dtype=torch.float64), "layer 1")
    second = Reply(Op.STATS, torch.empty(4, dtype=torch.float64), "stats")
    coordinator.send(Op.SUM, [b"x" * 100_000], (1, 2), 5.0, first)  # larger than a socket buffer
    coordinator.send(Op.STATS, [], (), 5.0, second)
    sums, stats = torch.randn(3, 5, dtype=torch.float64), torch.arange(4, dtype=torch.float64)

    def serve() -> None:
        for want in (Op.SUM, Op.STATS):
            head, payload = worker.receive(5.0, "request", 1 << 20)
            assert head.op == want
            reply = sums if want == Op.SUM else stats
            worker.send(want, [reply.numpy().tobytes()], (), 5.0)

    thread = threading.Thread(target=serve)
    thread.start()
    assert torch.equal(coordinator.wait(second, 5.0), stats)  # reads the SUM reply on the way
    assert first.done and torch.equal(coordinator.wait(first, 5.0), sums)
    thread.join()


def test_a_silent_or_closed_peer_fails_its_link_only():
    silent, _peer = links()
    other, other_peer = links()
    reply = Reply(Op.SUM, torch.empty(2, dtype=torch.float64), "layer 3")
    silent.send(Op.SUM, [], (), 1.0, reply)
    with pytest.raises(WorkerError, match="worker 1, layer 3: no answer within 0.2 s"):
        silent.wait(reply, 0.2)
    with pytest.raises(WorkerError, match="no answer within 0.2 s"):  # failed for good: at once, the same error
        silent.send(Op.STATS, [], (), 1.0)
    other.send(Op.END_TURN, [], (), 1.0)  # another link is untouched
    assert other_peer.receive(1.0, "request", 0)[0].op == Op.END_TURN
    other_peer.close()
    with pytest.raises(WorkerError, match="connection lost"):
        other.receive(1.0, "a reply", 0)


def test_a_member_counts_its_losses_and_keeps_its_counters_across_a_rejoin():
    hello = Hello(1, "h", 10, 2, 5, 100, 1000, 0, 0)
    coordinator, _ = links()
    member = Member(hello, coordinator, stats=StoreStats(requests=7, misses=2))
    assert member.lose(WorkerError("gone")) is coordinator and member.lose(WorkerError("again")) is None
    assert member.state == LOST and member.failovers == 1 and member.last_loss == "gone"
    back, _ = links()
    assert member.rejoin(Hello(1, "h", 11, 2, 5, 100, 1000, 0, 0), back) >= 0
    member.stats = StoreStats(requests=3)
    view = member.as_dict()
    assert member.state == REJOINED and view["pid"] == 11
    assert view["requests"] == 10 and view["requests_this_process"] == 3 and view["misses"] == 2
    assert isinstance(Holders.single(torch.ones(1, 2, dtype=torch.int64)), Holders)
