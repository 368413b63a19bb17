"""The shared USS sampler: a turn's end does not walk the process's pages on the stopping thread (the
server's model thread) once the sampler's thread has sampled the turn; a turn it never sampled is
measured when it stops, so every turn's peak is a measured value; a turn opened right after a sample starts
from it instead of asking for another walk."""

from __future__ import annotations

import threading
import time

from colibri_stream.runtime.memory import SharedPeakSampler


def _wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def test_a_sampled_turn_stops_without_measuring_on_its_own_thread():
    callers: list[str] = []

    def measure() -> int:
        callers.append(threading.current_thread().name)
        return 100 + len(callers)

    sampler = SharedPeakSampler(measure, interval=60.0)  # only the sample a new watch asks for
    watch = sampler.watch()
    assert _wait_for(lambda: watch.samples > 0)  # sampled as soon as it opened, not after the interval
    watch.stop()
    assert set(callers) == {"peak-sampler"} and watch.peak == 100 + len(callers)


def test_a_watch_opened_while_the_thread_waits_is_sampled_at_once():
    sampler = SharedPeakSampler(lambda: 5, interval=60.0, fresh=0.0)  # no sample is recent enough to reuse
    first = sampler.watch()
    assert _wait_for(lambda: first.samples > 0)
    second = sampler.watch()  # the thread is in its 60 s wait
    assert _wait_for(lambda: second.samples > 0, seconds=5.0)
    first.stop(), second.stop()
    assert second.peak == 5


def test_a_watch_opened_soon_after_a_sample_starts_from_it_and_a_later_one_asks_for_its_own():
    values = iter(range(10, 100))
    measured: list[int] = []

    def measure() -> int:
        measured.append(next(values))
        return measured[-1]

    sampler = SharedPeakSampler(measure, interval=60.0, fresh=1.0)
    first = sampler.watch()
    assert _wait_for(lambda: first.samples > 0)
    soon = sampler.watch()  # within 1 s of the first sample: no walk of the pages for it
    assert soon.samples == 1 and soon.peak == 10 and measured == [10]
    time.sleep(1.1)
    later = sampler.watch()  # the last sample is older than fresh: the thread samples again
    assert _wait_for(lambda: later.samples > 0) and later.peak == 11 and measured == [10, 11]
    first.stop(), soon.stop(), later.stop()
    assert first.peak == 11 and soon.peak == 11  # the later sample fell within them too


def test_a_turn_the_sampler_never_reached_is_measured_when_it_stops():
    release = threading.Event()
    callers: list[str] = []

    def measure() -> int:
        callers.append(threading.current_thread().name)
        if threading.current_thread().name == "peak-sampler":
            release.wait(5)  # the sampler's walk of the pages, still running
            return 1
        return 7

    sampler = SharedPeakSampler(measure, interval=60.0)
    watch = sampler.watch()
    assert _wait_for(lambda: "peak-sampler" in callers)
    watch.stop()
    assert watch.peak == 7 and threading.current_thread().name in callers
    release.set()
    assert _wait_for(lambda: sampler._thread is None)  # its last watch closed: the thread ends
