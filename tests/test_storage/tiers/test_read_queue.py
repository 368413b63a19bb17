"""The expert-read queue: a read the compute thread waits for goes before queued prefetch guesses."""

from __future__ import annotations

import threading

import pytest

from storage.tiers.read_queue import ReadQueue


class Recorder:
    """Jobs that append their name when they run; ``hold`` blocks the only thread until released."""

    def __init__(self):
        self.order: list[str] = []
        self.gate = threading.Event()
        self.holding = threading.Event()

    def job(self, name: str):
        return lambda: self.order.append(name) or name

    def hold(self):
        def blocked():
            self.holding.set()
            assert self.gate.wait(10), "the test never released the held thread"

        return blocked


def _held_queue(recorder: Recorder) -> ReadQueue:
    queue = ReadQueue(1)
    queue.submit(recorder.hold())
    assert recorder.holding.wait(10)
    return queue


def test_a_demand_read_starts_before_queued_guesses():
    recorder = Recorder()
    queue = _held_queue(recorder)
    futures = [queue.submit(recorder.job(f"guess{i}"), demand=False) for i in range(3)]
    futures.append(queue.submit(recorder.job("need"), demand=True))
    recorder.gate.set()
    assert [f.result(10) for f in futures] == ["guess0", "guess1", "guess2", "need"]
    queue.shutdown()
    assert recorder.order == ["need", "guess0", "guess1", "guess2"]


def test_a_promoted_guess_runs_once_and_before_the_other_guesses():
    recorder = Recorder()
    queue = _held_queue(recorder)
    futures = [queue.submit(recorder.job(f"guess{i}"), demand=False) for i in range(3)]
    queue.promote(futures[2])
    queue.promote(futures[2])  # twice: still one run
    recorder.gate.set()
    queue.shutdown()
    assert recorder.order == ["guess2", "guess0", "guess1"]
    assert all(f.done() for f in futures)


def test_promoting_a_finished_or_unknown_future_changes_nothing():
    queue = ReadQueue(2)
    done = queue.submit(lambda: 7, demand=False)
    assert done.result(10) == 7
    queue.promote(done)
    after = queue.submit(lambda: 8)
    assert after.result(10) == 8
    queue.shutdown()


def test_an_exception_reaches_the_waiter_and_the_threads_go_on():
    queue = ReadQueue(1)

    def broken():
        raise OSError("the disk went away")

    failed = queue.submit(broken)
    with pytest.raises(OSError, match="went away"):
        failed.result(10)
    assert queue.submit(lambda: "still reading").result(10) == "still reading"
    queue.shutdown()


def test_shutdown_finishes_what_is_queued_then_refuses_more():
    recorder = Recorder()
    queue = _held_queue(recorder)
    futures = [queue.submit(recorder.job(str(i)), demand=i % 2 == 0) for i in range(6)]
    threading.Timer(0.05, recorder.gate.set).start()
    queue.shutdown()
    assert all(f.done() for f in futures)
    assert sorted(recorder.order) == [str(i) for i in range(6)]
    with pytest.raises(RuntimeError, match="shut down"):
        queue.submit(lambda: None)


def test_many_threads_run_every_job_exactly_once():
    queue = ReadQueue(4)
    counts = [0] * 200
    lock = threading.Lock()

    def bump(i):
        with lock:
            counts[i] += 1

    futures = [queue.submit(lambda i=i: bump(i), demand=i % 3 == 0) for i in range(200)]
    for future in futures[::7]:
        queue.promote(future)
    for future in futures:
        future.result(10)
    queue.shutdown()
    assert counts == [1] * 200


def test_a_queue_needs_a_thread():
    with pytest.raises(ValueError, match="at least one thread"):
        ReadQueue(0)


def test_a_cancelled_read_never_runs_and_a_started_one_cannot_be_cancelled():
    recorder = Recorder()
    queue = ReadQueue(1)
    held = queue.submit(recorder.hold())
    assert recorder.holding.wait(10)
    dropped = queue.submit(recorder.job("dropped"), demand=False)
    kept = queue.submit(recorder.job("kept"), demand=False)
    queue.promote(dropped)  # in both queues now: neither copy may run
    assert queue.cancel(dropped) and dropped.cancelled()
    assert not queue.cancel(held)  # running
    assert not queue.cancel(dropped)  # already gone
    recorder.gate.set()
    assert kept.result(10) == "kept"
    queue.shutdown()
    assert recorder.order == ["kept"]


def test_a_guess_waits_while_a_need_is_read_even_with_idle_threads():
    recorder = Recorder()
    queue = ReadQueue(3)
    need = queue.submit(recorder.hold())  # a demand read in progress
    assert recorder.holding.wait(10)
    guess = queue.submit(recorder.job("guess"), demand=False)
    assert not guess.done() and not guess.running()  # two idle threads, still queued
    assert queue.cancel(guess)  # so a wrong guess can still be dropped
    later = queue.submit(recorder.job("later guess"), demand=False)
    recorder.gate.set()
    need.result(10)
    assert later.result(10) == "later guess"  # the need done, guesses run again
    queue.shutdown()
    assert recorder.order == ["later guess"]


def test_at_most_max_guesses_run_at_once():
    queue = ReadQueue(4, max_guesses=2)
    lock, running, most = threading.Lock(), [0], [0]
    release = threading.Event()

    def guess():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(10)
        with lock:
            running[0] -= 1

    futures = [queue.submit(guess, demand=False) for _ in range(6)]
    threading.Timer(0.2, release.set).start()
    for future in futures:
        future.result(10)
    queue.shutdown()
    assert most[0] == 2


def test_half_the_threads_may_read_guesses_by_default():
    assert ReadQueue(4)._max_guesses == 2 and ReadQueue(1)._max_guesses == 1
