"""The guard's decisions under threads: many threads on one guard lose no update of a bucket or a counter.

The inline decision path reads a TAT, computes and writes it back; two threads interleaved there would both
admit on one TAT. The clock stands still, so a bucket admits exactly its burst whatever the interleaving,
and the interpreter switches threads as often as it can, so a missing lock shows as an extra admission. (On
CPython 3.11 a plain string key happens not to let another thread in between the read and the write; a key
whose hash releases the GIL does, and that case fails without the lock.)"""

from __future__ import annotations

import sys
import threading
import time

import pytest
from hypothesis import given, settings
from test_guard_core import INLINE_CFG, Clock, replay_on_both, request_ops

from gpuscope.guard import Guard, RequestInfo, parse_config
from gpuscope.guard._bucket import LocalBuckets

THREADS = 8
CALLS = 3000


class StillClock:
    def __call__(self) -> float:
        return 100.0


@pytest.fixture
def switch_often():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _hammer(g: Guard, infos: list[RequestInfo]) -> list[int]:
    admitted = [0] * THREADS
    start = threading.Barrier(THREADS)

    def run(i: int) -> None:
        start.wait()
        for k in range(CALLS):
            if g.acquire(infos[(i + k) % len(infos)]).admitted:
                admitted[i] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return admitted


class Yielding(str):
    """A tenant name whose hash lets the other threads run (time.sleep(0) releases the GIL): the bucket's
    read and write of its TAT each hash the key, so without the lock another thread decides in between."""

    def __hash__(self) -> int:
        time.sleep(0)
        return str.__hash__(self)


@pytest.mark.parametrize("tenant", ["one", Yielding("one")], ids=["str", "yielding"])
def test_threads_on_one_tenant_admit_exactly_the_burst(switch_often, tenant):
    g = Guard(parse_config({"classes": [{"name": "a", "tenant_rate": 1, "tenant_burst": 500}],
                            "controller": {"mode": "fixed", "max_limit": 1e9, "initial_limit": 1e9}}),
              clock=StillClock())
    admitted = _hammer(g, [RequestInfo(tenant=tenant)])
    assert sum(admitted) == 500  # a lost TAT update would admit more
    assert g.admitted_total == [500] and g.inflight_total == 500
    assert g.shed_total == {(0, "tenant_rate"): THREADS * CALLS - 500}  # no lost count either


def test_threads_on_a_class_bucket_and_many_tenants_admit_exactly_the_burst(switch_often):
    g = Guard(parse_config({"classes": [{"name": "a", "rate": 1, "burst": 700, "tenant_rate": 1, "tenant_burst": 50}],
                            "controller": {"mode": "fixed", "max_limit": 1e9, "initial_limit": 1e9}}),
              clock=StillClock())
    admitted = _hammer(g, [RequestInfo(headers={"x-tenant": f"t{k}"}) for k in range(20)])
    assert sum(admitted) == 700  # 20 tenants x 50 would be 1000: the class bucket holds them to 700
    shed = g.shed_total
    assert sum(shed.values()) == THREADS * CALLS - 700 and g.admitted_total == [700]


class SharedLocal:
    """Buckets with LocalBuckets' arithmetic that the guard treats as shared (not a LocalBuckets): so the guard
    takes its shared-bucket inline path, as with Redis, without a server."""

    def __init__(self, classes: list, atomic: bool = False) -> None:
        self._b = LocalBuckets(classes)
        self._lock = threading.Lock() if atomic else None  # as Redis is: one script at a time

    def take(self, idx: int, tenant: str, cost: float, now: float, factor: float = 1.0) -> tuple[float, str]:
        if self._lock is None:
            return self._b.take(idx, tenant, cost, now, factor)
        with self._lock:
            return self._b.take(idx, tenant, cost, now, factor)


@settings(max_examples=100, deadline=None)
@given(reqs=request_ops)
def test_the_shared_bucket_inline_path_decides_as_the_general_one(reqs):
    """acquire()'s inline path for shared buckets against _acquire: the same decisions, reasons, Retry-After
    and counters for the same requests at the same times."""
    ca, cb = Clock(), Clock()
    cfg = parse_config(INLINE_CFG)
    fast = Guard(cfg, clock=ca, buckets=SharedLocal(cfg.classes))
    general = Guard(cfg, clock=cb, buckets=SharedLocal(cfg.classes))
    assert fast.acquire.__name__ == "acquire" and not hasattr(fast.acquire, "caches")  # the shared one
    replay_on_both(fast, general, ca, cb, reqs)


def test_threads_on_the_shared_bucket_path_count_every_decision(switch_often):
    cfg = parse_config({"classes": [{"name": "a", "tenant_rate": 1, "tenant_burst": 300}],
                        "controller": {"mode": "fixed", "max_limit": 1e9, "initial_limit": 1e9}})
    g = Guard(cfg, clock=StillClock(), buckets=SharedLocal(cfg.classes, atomic=True))
    admitted = _hammer(g, [RequestInfo(headers={"x-tenant": "one"})])
    assert sum(admitted) == 300 and g.admitted_total == [300] and g.inflight_total == 300
    assert g.shed_total == {(0, "tenant_rate"): THREADS * CALLS - 300}
