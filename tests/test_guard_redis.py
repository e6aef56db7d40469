"""Shared buckets in a real Redis: two guards keep the global rate; Redis vanishing mid-run falls back to
local buckets at rate / replicas without an exception, and the shared buckets come back with Redis."""

from __future__ import annotations

import asyncio
import threading

import redis
from redis_server import RedisServer, _free_port, redis_server  # noqa: F401

from gpuscope.guard import Guard, RequestInfo, parse_config
from gpuscope.guard._metrics import render
from gpuscope.guard._redis import RedisBuckets

RATE = 200.0
BURST = 10.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _cfg(url: str, rate: float = RATE, **redis_extra) -> dict:
    return {"classes": [{"name": "a", "rate": rate, "burst": BURST, "tenant_rate": 1000, "tenant_burst": 1000}],
            "controller": {"mode": "fixed", "max_limit": 100000, "initial_limit": 100000},
            "redis": {"url": url, "replicas": 2, "retry_s": 0.5, **redis_extra}}


def _guard(url: str, clock=None, rate: float = RATE, **redis_extra) -> Guard:
    cfg = parse_config(_cfg(url, rate, **redis_extra))
    return Guard(cfg, buckets=RedisBuckets(cfg), **({"clock": clock} if clock else {}))


def _redis_time_s(r: redis.Redis) -> float:
    s, us = r.time()
    return s + us / 1e6


def _run_threads(r: redis.Redis, target, n: int) -> float:
    """target(i) on n threads at once; the seconds they took by Redis's clock (the buckets' own)."""
    t0 = _redis_time_s(r)
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return _redis_time_s(r) - t0


def test_two_guards_sharing_redis_keep_the_global_rate(redis_server):  # noqa: F811
    # Redis gets 2 s to answer (50 ms by default): a loaded machine's slow answer is not an outage here.
    guards = [_guard(redis_server.url, timeout_s=2.0), _guard(redis_server.url, timeout_s=2.0)]
    target = 600  # admitted requests in all: about 3 s at 200/s
    admitted = [0, 0]
    refused = [0, 0]
    stop = threading.Event()
    odd: list = []

    def hammer(i: int) -> None:
        g = guards[i]
        while not stop.is_set():
            d = g.acquire(RequestInfo(headers={"x-tenant": f"t{i}"}))
            if d.admitted:
                admitted[i] += 1
                g.release(d)
                if sum(admitted) >= target:
                    stop.set()
            else:
                if not (d.reason == "rate" and 0 < d.retry_after_s <= 1 / RATE + 1e-3):
                    odd.append(d)  # an assert here would die with the thread, unseen
                refused[i] += 1

    r = redis.Redis.from_url(redis_server.url)
    elapsed = _run_threads(r, hammer, 2)
    total = sum(admitted)
    assert odd == []
    assert all(admitted) and all(refused)  # both guards took part and both were held back
    assert not any(g.buckets.fallback_active for g in guards)
    # No more than the one shared bucket holds in the time it ran by Redis's clock (the buckets' own): two guards
    # with a bucket each would have admitted twice that. (A floor on the rate is no check: a guard's thread
    # starved on a loaded machine leaves a full bucket's refill unspent.)
    assert total <= BURST + RATE * elapsed + 1, (total, elapsed)


def test_redis_vanishing_mid_run_falls_back_locally_and_recovers():
    clock = Clock()  # the local buckets' clock; the shared bucket refills by Redis's own
    with RedisServer() as server:
        # One token per 10 s by Redis's clock: at RATE a loaded machine's pause of 10 ms refilled two.
        g = _guard(server.url, clock=clock, rate=0.1, timeout_s=2.0)  # a slow answer under load is no outage
        first = [g.acquire(RequestInfo()).admitted for _ in range(int(BURST) + 5)]
        assert first.count(True) == BURST  # the shared bucket's burst
        server.stop()
        clock.t += 10  # local buckets start full
        during = [g.acquire(RequestInfo()) for _ in range(20)]  # no exception
        assert g.buckets.fallback_active
        assert sum(d.admitted for d in during) == BURST / 2  # burst / replicas
        assert "gpuscope_guard_redis_fallback 1" in render(g).decode()
        server.start()
        clock.t += 1  # past retry_s: Redis is tried again
        assert g.acquire(RequestInfo()).admitted
        assert not g.buckets.fallback_active
        assert "gpuscope_guard_redis_fallback 0" in render(g).decode()


def test_unreachable_redis_from_the_start_and_the_async_path():
    clock = Clock()
    g = _guard(f"redis://127.0.0.1:{_free_port()}/0", clock=clock)

    async def go():
        return [await g.acquire_async(RequestInfo()) for _ in range(10)]

    ds = asyncio.run(go())
    assert sum(d.admitted for d in ds) == BURST / 2 and g.buckets.fallback_active


def test_async_path_shares_the_redis_bucket(redis_server):  # noqa: F811
    # One token per 10 s by Redis's clock: at RATE a pause of 10 ms refilled enough for the async guard.
    rate = 0.1
    # 2 s to answer: a loaded machine's slow answer must not read as an outage (the local fallback admits then)
    sync_guard = _guard(redis_server.url, rate=rate, timeout_s=2.0)
    async_guard = _guard(redis_server.url, rate=rate, timeout_s=2.0)
    r = redis.Redis.from_url(redis_server.url)
    t0 = _redis_time_s(r)
    assert [sync_guard.acquire(RequestInfo()).admitted for _ in range(int(BURST))].count(True) == BURST

    async def go():
        ds = [await async_guard.acquire_async(RequestInfo()) for _ in range(5)]
        await async_guard.buckets.aclose()
        return ds

    ds = asyncio.run(go())
    refilled = int(rate * (_redis_time_s(r) - t0))  # tokens the bucket gained while this ran
    assert sum(d.admitted for d in ds) <= refilled  # the other guard spent the shared burst
    assert not async_guard.buckets.fallback_active


def test_lua_script_refuses_without_spending(redis_server):  # noqa: F811
    # A slow refill (one token per 10 s by Redis's clock): at RATE a busy machine refilled a token
    # between the burst and the refused request, and that request was admitted.
    cfg = parse_config({"classes": [{"name": "a", "rate": 0.1, "burst": BURST}],
                        "controller": {"mode": "fixed", "max_limit": 100000, "initial_limit": 100000},
                        "redis": {"url": redis_server.url}})
    g = Guard(cfg, buckets=RedisBuckets(cfg))
    r = redis.Redis.from_url(redis_server.url)
    assert all(g.acquire(RequestInfo(headers={"x-tenant": "x"})).admitted for _ in range(int(BURST)))
    before = r.get("gpuscope:guard:{a}")
    assert not g.acquire(RequestInfo(headers={"x-tenant": "x"})).admitted
    assert r.get("gpuscope:guard:{a}") == before  # a refusal stores nothing


def test_a_cost_over_the_burst_is_charged_as_the_burst_in_redis(redis_server):  # noqa: F811
    cfg = parse_config({"classes": [{"name": "a", "rate": 1, "burst": 2}], "classify": {"cost": "tokens"},
                        "redis": {"url": redis_server.url}})
    g = Guard(cfg, buckets=RedisBuckets(cfg))
    big = RequestInfo(body={"prompt": "x" * 400, "max_tokens": 100})
    r = redis.Redis.from_url(redis_server.url)
    t0 = _redis_time_s(r)
    first, second = g.acquire(big), g.acquire(big)
    took = _redis_time_s(r) - t0  # the refill between the two is at most this, at 1 token/s
    assert first.admitted and second.reason == "rate" and 2.0 - took - 1e-3 <= second.retry_after_s <= 2.0


def test_packed_command_is_what_redis_py_would_send(redis_server):  # noqa: F811
    cfg = parse_config({"classes": [{"name": "both", "rate": 3, "burst": 7, "tenant_rate": 11},
                                    {"name": "classonly", "rate": 5},
                                    {"name": "tenantonly", "tenant_rate": 2, "tenant_burst": 9}],
                        "redis": {"url": redis_server.url}})
    b = RedisBuckets(cfg)
    conn = redis.Redis.from_url(redis_server.url).connection_pool.make_connection()
    for idx in range(3):
        for tenant, cost, factor in (("acme", 1.0, 1.0), ("", 37.5, 0.4), ("tënant ✓", 2.0, 1.0)):
            args, _ = b._call(idx, tenant, cost, factor)
            assert b.pack(idx, tenant, cost, factor) == b"".join(conn.pack_command(*args))


def test_one_guard_many_threads_and_a_flushed_script(redis_server):  # noqa: F811
    """Threads share one guard: one uses the held connection, the others the pool, none falls back; after
    SCRIPT FLUSH the script is loaded again and the shared bucket still counts every admission."""
    g = _guard(redis_server.url, timeout_s=2.0)  # a loaded machine's slow answer is not an outage here
    r = redis.Redis.from_url(redis_server.url)
    r.script_flush()
    counts = [0] * 4
    odd: list = []

    def hammer(i: int) -> None:
        for _ in range(150):
            d = g.acquire(RequestInfo(headers={"x-tenant": f"t{i}"}))
            if d.admitted:
                counts[i] += 1
                g.release(d)
            elif d.reason != "rate":
                odd.append(d)

    elapsed = _run_threads(r, hammer, 4)
    assert odd == [] and not g.buckets.fallback_active
    assert BURST <= sum(counts) <= BURST + RATE * elapsed + 1  # no admission outside the shared bucket


def _decide_in_child(g: Guard, out) -> None:
    ds = [g.acquire(RequestInfo(headers={"x-tenant": "child"})) for _ in range(3)]
    out.put((all(d.admitted for d in ds), g.buckets.fallback_active, _held_socket(g)))


def _held_socket(g: Guard) -> tuple:
    return g.buckets._raw._conn._sock.getsockname()


def test_a_forked_worker_takes_its_own_connection(redis_server):  # noqa: F811
    """A guard built before a fork (a pre-loading server): parent and child must not share the held socket."""
    import multiprocessing

    g = _guard(redis_server.url, timeout_s=2.0)
    assert g.acquire(RequestInfo(headers={"x-tenant": "parent"})).admitted  # the parent's connection is open
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_decide_in_child, args=(g, out))
    child.start()
    admitted, fell_back, child_socket = out.get(timeout=30)
    child.join(30)
    assert admitted and not fell_back
    assert child_socket != _held_socket(g)  # the child connected on its own
    assert [g.acquire(RequestInfo(headers={"x-tenant": "parent"})).admitted for _ in range(3)] == [True] * 3
    assert not g.buckets.fallback_active


def test_the_redis_password_stays_out_of_the_fallback_log(caplog):
    g = _guard(f"redis://:s3cret@127.0.0.1:{_free_port()}/0", clock=Clock())
    with caplog.at_level("WARNING", logger="gpuscope.guard"):
        assert g.acquire(RequestInfo()).admitted  # local fallback
    assert "failed" in caplog.text and ":***@127.0.0.1" in caplog.text and "s3cret" not in caplog.text


def test_a_tenant_key_expires_once_its_bucket_is_full_and_a_class_key_never(redis_server):  # noqa: F811
    import time

    cfg = parse_config({"classes": [{"name": "a", "rate": 1000, "burst": 1000, "tenant_rate": 10, "tenant_burst": 2}],
                        "redis": {"url": redis_server.url}})
    g = Guard(cfg, buckets=RedisBuckets(cfg))
    r = redis.Redis.from_url(redis_server.url)
    assert [g.acquire(RequestInfo(tenant="x")).admitted for _ in range(3)] == [True, True, False]
    tau_ms = 2 / 10 * 1000
    assert 0 < r.pttl("gpuscope:guard:{a}:t:x") <= tau_ms + 1  # lives at most tau past its last admission
    assert r.pttl("gpuscope:guard:{a}") == -1  # one key per class: no expiry
    time.sleep((tau_ms + 100) / 1000)
    assert not r.exists("gpuscope:guard:{a}:t:x") and r.exists("gpuscope:guard:{a}")
    assert g.acquire(RequestInfo(tenant="x")).admitted  # a full bucket again
