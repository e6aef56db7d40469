"""What the sampler spends per tick besides its reads (issue 19): a short wait between ticks sleeps (Event.wait
costs about twice sleep's CPU per wake-up) and still lets stop() end the thread; a long one waits on the stop
event; each cadence group's CPU is measured only when asked (two system calls per group and tick)."""

from __future__ import annotations

import threading
import time

from gpuscope import sampler as sampler_mod
from gpuscope.testing import healthy_gpus


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpuscope-sampler" and t.is_alive()]


def _wait_ticks(s, n: int, limit_s: float = 30.0) -> None:
    end = time.monotonic() + limit_s
    while s.ticks < n and time.monotonic() < end:
        time.sleep(0.01)
    assert s.ticks >= n, s.ticks


def test_the_tick_cpu_is_kept_and_the_groups_only_when_asked(make_sampler):
    s = make_sampler(healthy_gpus(1), interval=0.05)
    for _ in range(5):
        s.sample_once()
    assert s.cpu_seconds > 0 and s.overhead()["group_cpu_seconds"] == {}
    s.measure_groups = True
    for _ in range(5):
        s.sample_once()
    groups = s.overhead()["group_cpu_seconds"]
    assert "fast" in groups and all(v >= 0 for v in groups.values()), groups


def test_a_short_wait_sleeps_and_stop_still_ends_the_thread(make_sampler, monkeypatch):
    slept: list[float] = []
    real_sleep = time.sleep

    def sleep(d: float) -> None:
        if threading.current_thread().name == "gpuscope-sampler":
            slept.append(d)
        real_sleep(d)

    monkeypatch.setattr(sampler_mod.time, "sleep", sleep)
    s = make_sampler(healthy_gpus(1), interval=0.1)
    s.start()
    _wait_ticks(s, 3)
    s.stop()
    assert _threads() == [] and s._thread is None
    # the sampler thread slept between its ticks, each time for less than one interval
    assert slept and all(0 < d <= 0.1 for d in slept), slept
    ticks = s.ticks
    real_sleep(0.15)
    assert s.ticks == ticks


def test_a_long_wait_is_cut_short_by_stop(make_sampler):
    """At a 30 s interval the thread waits on the stop event: stop() joins it at once, not after its sleep (the
    join gives up after 5 s and leaves the thread behind)."""
    s = make_sampler(healthy_gpus(1), interval=30.0, processes=30.0, process_utilization=30.0, slow=30.0,
                     energy=30.0, rare=30.0, host=30.0)
    assert 30.0 > sampler_mod.SLEEP_AT_MOST_S
    s.start()
    _wait_ticks(s, 1)
    s.stop()
    assert _threads() == [] and s._thread is None
