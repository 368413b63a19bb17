"""``--local-workers N``: N worker processes on 127.0.0.1, started by the coordinator as children (the
way to try workers on one machine, and what the tests use). They share this machine's disk, so none
measures it (equal shares); the coordinator's RAM budget is split evenly between them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from colibri_stream.errors import ColibriError
from colibri_stream.experts.cluster.auth import KEY_ENV
from colibri_stream.experts.cluster.wire import WorkerError

LOCALHOST = "127.0.0.1"
STOP_WAIT_S = 10.0
# --local-workers at most: each worker is a Python process holding torch (hundreds of MB before its share
# of experts) on this one machine's cores and disk; past a few dozen they only divide the same resources.
MAX_LOCAL_WORKERS = 64


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it; the store binds it moments later)."""
    with socket.socket() as probe:
        probe.bind((LOCALHOST, 0))
        port: int = probe.getsockname()[1]  # (host, port) for an AF_INET socket
        return port


@dataclass
class LocalWorkers:
    """The child processes; ``exited`` names those that have ended, ``end`` kills a lost one, ``stop``
    ends them all."""

    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)  # rank -> process

    @classmethod
    def start(cls, path: str, count: int, port: int, flags: Callable[[int], list[str]], key: bytes) -> LocalWorkers:
        """Workers 1 .. count of a group of count + 1 at 127.0.0.1:port; ``flags(rank)``: their store flags;
        ``key``: the cluster key, passed in their environment (a command line is visible to every user).
        If one cannot be started (no memory, a process limit), those already started are killed and reaped
        before the WorkerError: none is left running without its coordinator."""
        check_local_workers(count)
        workers = cls()
        try:
            for rank in range(1, count + 1):
                workers.processes[rank] = _start_worker(path, count, port, rank, flags(rank), key)
        except BaseException as exc:
            workers.stop(kill=True)
            if isinstance(exc, OSError):
                raise WorkerError(f"cannot start local worker {rank} of {count} ({exc.strerror or exc})") from None
            raise
        return workers

    def exited(self) -> dict[int, str]:
        """rank -> why, for each worker that has ended (reaped)."""
        return {
            rank: f"local worker {rank} (pid {process.pid}) exited with status {process.returncode}"
            for rank, process in self.processes.items()
            if process.poll() is not None
        }

    def pid(self, rank: int) -> int:
        return self.processes[rank].pid

    def end(self, rank: int) -> None:
        """Kill and reap worker ``rank`` (lost: stopped or unreachable, it must not linger)."""
        process = self.processes.get(rank)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def stop(self, kill: bool = False) -> None:
        """Wait a little for workers told to shut down (``kill``: none was), then kill the rest."""
        for process in self.processes.values():
            try:
                process.wait(0 if kill else STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def check_local_workers(count: int) -> None:
    if not 0 <= count <= MAX_LOCAL_WORKERS:
        raise ColibriError(f"--local-workers must be 0..{MAX_LOCAL_WORKERS}, got {count}")


def _start_worker(path: str, count: int, port: int, rank: int, flags: list[str], key: bytes) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "colibri_stream", "worker", str(path), "--rank", str(rank)]
    command += ["--world-size", str(count + 1), "--master-addr", LOCALHOST, "--master-port", str(port)]
    command += ["--disk-speed", "0", *flags]  # one disk for all: equal shares, nothing to measure
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, env=_worker_env(count, key))


def _worker_env(count: int, key: bytes) -> dict[str, str]:
    """Each local worker computes on its part of this machine's cores (the coordinator's torch threads
    over the workers): they compute a layer at the same time, and more threads than cores only switch."""
    threads = max(1, torch.get_num_threads() // count)
    return {**os.environ, "OMP_NUM_THREADS": str(threads), KEY_ENV: key.decode()}
