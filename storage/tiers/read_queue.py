"""The expert-read thread pool, demand reads first: a read the compute thread is about to wait for is
served before queued prefetch reads.

Why: the model asks for layer L+1's guessed experts just before layer L's own experts, so in a plain
FIFO pool layer L's misses queued behind up to a layer's worth of guesses, with the disk already
saturated by them (docs/benchmarks-log.md, "Figures behind the code"). A guess is only worth reading before
a need when nothing needed is waiting.

Verbs:
    submit(fn, demand)  -> a Future; demand reads start before every queued guess
    promote(future)     -> a guess that became a need (its expert was acquired while still queued)
                           moves to the demand queue; no-op once it has started
    cancel(future)      -> a queued read nobody needs any more (a guess the router did not confirm) is
                           dropped: True if it will never run, False once it has started
    shutdown()          -> finish what is queued, stop the threads
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class ReadScheduler(Protocol):
    """What the tiered store asks of its reads once queued: this queue, or one per device
    (storage/tiers/spread_reads.py)."""

    def promote(self, future: Future[Any]) -> None: ...

    def cancel(self, future: Future[Any]) -> bool: ...

    def shutdown(self) -> None: ...


class _Job:
    __slots__ = ("fn", "future", "taken", "demand")

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.future: Future[Any] = Future()
        self.taken = False  # a thread has claimed it (it may also sit in the other queue after a promote)
        self.demand = False  # taken from the demand queue (a promoted guess counts as a need)


class ReadQueue:
    def __init__(self, threads: int, name: str = "expert-io", max_guesses: int | None = None):
        if threads < 1:
            raise ValueError(f"a read queue needs at least one thread, not {threads}")
        self._max_guesses = max(1, threads // 2) if max_guesses is None else max_guesses
        self._running = {True: 0, False: 0}  # demand?, reads running
        self._demand: deque[_Job] = deque()
        self._guesses: deque[_Job] = deque()
        self._jobs: dict[Future[Any], _Job] = {}  # queued, not yet taken: what promote can move
        self._lock = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[[], T], demand: bool = True) -> Future[T]:
        job = _Job(fn)
        with self._lock:
            if self._closed:
                raise RuntimeError("read queue is shut down")
            (self._demand if demand else self._guesses).append(job)
            self._jobs[job.future] = job
            self._lock.notify()
        return job.future

    def promote(self, future: Future[Any]) -> None:
        with self._lock:
            job = self._jobs.get(future)
            if job is not None and not job.taken:
                self._demand.append(job)  # the copy left in the guess queue is skipped as taken

    def cancel(self, future: Future[Any]) -> bool:
        with self._lock:
            job = self._jobs.pop(future, None)  # only jobs no thread has taken are listed
            if job is None:
                return False
            job.taken = True  # its queue entry is skipped
            return future.cancel()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()

    def _guess_may_start(self) -> bool:
        return not self._running[True] and self._running[False] < self._max_guesses

    def _next(self) -> _Job | None:
        """The next job to run (demand first; a guess only when ``_guess_may_start``), or None when shut
        down with nothing left."""
        with self._lock:
            while True:
                for queue in (self._demand, self._guesses):
                    if queue is self._guesses and not self._guess_may_start():
                        break
                    while queue:
                        job = queue.popleft()
                        if not job.taken:
                            job.taken, job.demand = True, queue is self._demand
                            del self._jobs[job.future]
                            self._running[job.demand] += 1
                            return job
                if self._closed and not self._jobs:
                    return None
                self._lock.wait()

    def _work(self) -> None:
        while (job := self._next()) is not None:
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._running[job.demand] -= 1
                    self._lock.notify_all()  # a guess held back may start now

    @staticmethod
    def _run(job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            result = job.fn()
        except BaseException as exc:  # the waiter re-raises it
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)
