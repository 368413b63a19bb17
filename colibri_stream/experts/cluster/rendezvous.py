"""Forming the gloo process group: the coordinator (rank 0) hosts torch's TCPStore and waits for every
worker to check in, checking meanwhile that the workers it started itself are still running (a worker
that fails at start is reported at once, not after the connect timeout); then all ranks join the group."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from colibri_stream.experts.cluster.wire import WorkerError

POLL_S = 0.05
# Operations without an explicit timeout (a worker's replies) may take this long; every wait that matters
# passes its own: the coordinator's answer timeout, a worker's idle wait for the next request.
GROUP_TIMEOUT = timedelta(minutes=10)


def _joined_key(rank: int) -> str:
    return f"colibri/joined/{rank}"


def join_group(addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
    """A worker: connect to the coordinator's store, check in, join the group."""
    try:
        store = dist.TCPStore(addr, port, world_size=world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        store.set(_joined_key(rank), "1")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
    except (RuntimeError, dist.DistStoreError) as exc:
        raise WorkerError(f"worker {rank}: cannot join the coordinator at {addr}:{port} ({exc})") from None


def host_group(
    addr: str,
    port: int,
    world_size: int,
    timeout_s: float,
    check_children: Callable[[], None] = lambda: None,
    answer_timeout_s: float | None = None,
) -> None:
    """The coordinator: wait (up to ``timeout_s``) until workers 1 .. world_size - 1 have checked in,
    calling ``check_children`` between polls (it raises for a local worker that exited), then join.
    Joining waits for every worker's address in the store: ``answer_timeout_s`` (--worker-timeout) bounds
    it, and is the group's own timeout, so a stray client that wrote the check-in keys but is no worker
    (or a worker that died after checking in) is a WorkerError then, not a wait of GROUP_TIMEOUT."""
    try:
        store = dist.TCPStore(
            addr, port, world_size=world_size, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False
        )
    except (RuntimeError, dist.DistStoreError) as exc:
        raise WorkerError(f"cannot listen for workers on {addr}:{port} ({exc})") from None
    deadline = time.monotonic() + timeout_s
    while missing := [r for r in range(1, world_size) if not store.check([_joined_key(r)])]:
        check_children()
        if time.monotonic() > deadline:
            raise WorkerError(f"worker(s) {missing} did not join {addr}:{port} within {timeout_s:g} s")
        time.sleep(POLL_S)
    answer = GROUP_TIMEOUT if answer_timeout_s is None else timedelta(seconds=answer_timeout_s)
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=world_size, timeout=answer)
    except (RuntimeError, dist.DistStoreError) as exc:
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise WorkerError(
            f"worker(s) checked in at {addr}:{port} but did not form the group within "
            f"{answer.total_seconds():g} s ({detail})"
        ) from None
