"""The guard's algorithms against their definitions: GCRA, shares and priority shedding, the breaker,
the gradient / AIMD / simple limits, the GPU signal's staleness rules, classification, metrics."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gpuscope.guard import Decision, GpuSignal, Guard, RequestInfo, estimate_tokens, parse_config
from gpuscope.guard._breaker import Breaker
from gpuscope.guard._bucket import Gcra
from gpuscope.guard._config import BreakerConfig
from gpuscope.guard._metrics import render


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def two_classes(**extra) -> dict:
    cfg = {"classes": [{"name": "interactive", "share": 0.9, "queue_timeout_s": 1000},
                       {"name": "batch", "share": 0.1, "queue_timeout_s": 1000}]}
    cfg.update(extra)
    return cfg


# ---- GCRA ------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(rate=st.floats(0.5, 1000), burst=st.floats(1, 50),
       steps=st.lists(st.tuples(st.floats(0, 2.0), st.floats(0.1, 5)), min_size=1, max_size=60))
def test_gcra_never_admits_more_than_rate_times_t_plus_burst(rate, burst, steps):
    b = Gcra(rate, burst)
    now = 0.0
    admitted: list[tuple[float, float]] = []
    for dt, cost in steps:
        now += dt
        if b.take("k", cost, now) == 0.0:
            admitted.append((now, min(cost, burst)))  # a cost over the burst is charged as the burst
    for i in range(len(admitted)):
        total = 0.0
        for j in range(i, len(admitted)):
            total += admitted[j][1]
            span = admitted[j][0] - admitted[i][0]
            assert total <= rate * span + burst + 1e-6 * (1 + total)


@settings(max_examples=100, deadline=None)
@given(rate=st.floats(0.5, 100), burst=st.floats(1, 20), n=st.integers(1, 40), cost=st.floats(0.1, 1))
def test_gcra_retry_after_is_when_the_request_conforms(rate, burst, n, cost):
    b = Gcra(rate, burst)
    for _ in range(n):
        b.take("k", cost, 0.0)
    wait = b.peek("k", cost, 0.0)
    if wait > 1e-6:
        assert b.peek("k", cost, wait - 1e-6) > 0  # not before
    if wait > 0:
        assert b.take("k", cost, wait) == 0.0  # but then


def test_gcra_burst_then_rate():
    b = Gcra(rate=10, burst=5)
    assert [b.take("k", 1, 0.0) for _ in range(6)].count(0.0) == 5
    assert b.take("k", 1, 0.1) == 0.0  # one token back after 1/rate


def test_gcra_a_clock_jumping_back_admits_nothing_extra():
    b = Gcra(rate=1, burst=3)
    ok = [b.take("k", 1, 100.0) for _ in range(3)] + [b.take("k", 1, 50.0) for _ in range(3)]
    assert ok.count(0.0) == 3


def test_gcra_keys_are_bounded():
    b = Gcra(rate=1, burst=1, max_keys=100)
    for i in range(1000):
        b.take(f"tenant{i}", 1, float(i))
    assert len(b._tat) <= 100


# ---- classification -----------------------------------------------------------------------------------
def test_classification_header_route_tenant_and_token_cost():
    g = Guard(parse_config(two_classes(classify={"routes": {"/v1/embeddings": "batch"}, "default": "interactive",
                                                 "cost": "tokens"})))
    c = g._classifier
    assert c.classify(RequestInfo(path="/v1/embeddings"))[0] == 1
    assert c.classify(RequestInfo(path="/v1/chat", headers={"x-priority": "batch"}))[0] == 1
    assert c.classify(RequestInfo(path="/v1/chat", headers={"x-priority": "vip"}))[0] == 0  # unknown: default
    assert c.classify(RequestInfo(headers={"x-tenant": "acme"}))[1] == "acme"
    body = {"messages": [{"role": "user", "content": "a" * 400}], "max_tokens": 50}
    assert c.classify(RequestInfo(body=body))[2] == pytest.approx(150)
    assert estimate_tokens(b"not json") == 1.0
    assert estimate_tokens({"prompt": "abcd"}) == pytest.approx(1 + 256)  # unbounded completion: the default


def test_the_class_cache_is_bounded_and_keyed_by_path_and_header():
    g = Guard(parse_config(two_classes(classify={"routes": {"/v1/embeddings": "batch"}, "default": "interactive"})))
    c = g._classifier
    c._max_cached = 8
    for i in range(50):  # client-chosen paths: the cache never holds more than its bound
        assert c.classify(RequestInfo(path=f"/v1/embeddings/{i}"))[0] == 1
        assert len(c.cache) <= 8
    # the same path with another header value, and the same header on another path, are other entries
    assert g.acquire(RequestInfo(path="/v1/chat", headers={"x-priority": "batch"})).klass == "batch"
    assert g.acquire(RequestInfo(path="/v1/chat")).klass == "interactive"
    assert g.acquire(RequestInfo(path="/v1/embeddings", headers={"x-priority": " Interactive "})).klass == "interactive"
    assert g.acquire(RequestInfo(path="/v1/embeddings")).klass == "batch"
    assert g.acquire(RequestInfo(path="/v1/chat", headers={"x-priority": "vip"})).klass == "interactive"
    assert c.classify(RequestInfo(path="/v1/chat", headers={"x-priority": "batch"}))[0] == 1
    assert c.cache[("/v1/chat", None)] == 0
    # the inline path's own caches (class header value -> class, path -> class) are bounded the same way
    by_header, by_path = g.acquire.caches
    for i in range(50):
        assert g.acquire(RequestInfo(path=f"/v1/embeddings/{i}")).klass == "batch"
        assert g.acquire(RequestInfo(path="/v1/chat", headers={"x-priority": " batch" + " " * i})).klass == "batch"
        assert len(by_path) <= 8 and len(by_header) <= 8
    # an override is never cached under the request's path and header
    assert g.acquire(RequestInfo(path="/v1/chat", klass="batch")).klass == "batch"
    assert g.acquire(RequestInfo(path="/v1/chat")).klass == "interactive"
    # a new config is a new guard with its own, empty cache: answers follow the new routes
    g2 = Guard(parse_config(two_classes(classify={"routes": {"/v1/chat": "batch"}, "default": "interactive"})))
    assert g2._classifier.cache == {} and g2.acquire(RequestInfo(path="/v1/chat")).klass == "batch"


request_ops = st.lists(st.tuples(st.sampled_from(["/v1/chat", "/v1/embeddings", "/x"]),
                                 st.sampled_from([None, "interactive", "batch", "vip", " BATCH"]),
                                 st.sampled_from(["", "a", "b"]), st.floats(0, 0.5), st.booleans()),
                       min_size=1, max_size=60)
#: classes with class and tenant buckets, shares and a fixed limit of 6: every branch of a decision
INLINE_CFG = {
    "classes": [{"name": "interactive", "share": 0.7, "rate": 8, "burst": 3, "tenant_rate": 4, "tenant_burst": 2},
                {"name": "batch", "share": 0.3, "tenant_rate": 2, "tenant_burst": 1}],
    "classify": {"routes": {"/v1/embeddings": "batch"}},
    "controller": {"mode": "fixed", "min_limit": 1, "initial_limit": 6, "max_limit": 6}}


def replay_on_both(fast: Guard, general: Guard, ca: Clock, cb: Clock, reqs: list) -> None:
    """The same requests at the same times through fast.acquire and general._acquire (the general path):
    every field of every decision, and the counters at the end, must agree."""
    held: list[tuple] = []
    for path, prio, tenant, dt, finish in reqs:
        ca.t += dt
        cb.t = ca.t
        headers = {"x-tenant": tenant} if prio is None else {"x-tenant": tenant, "x-priority": prio}
        a = fast.acquire(RequestInfo(path=path, headers=headers))
        b = general._acquire(RequestInfo(path=path, headers=headers), cb.t)
        assert [getattr(a, f) for f in Decision.FIELDS] == [getattr(b, f) for f in Decision.FIELDS], (a, b)
        if a.admitted:
            held.append((a, b))
        if finish and held:
            a, b = held.pop(0)
            fast.release(a, 200, 0.1)
            general.release(b, 200, 0.1)
    assert (fast.inflight, fast.admitted_total, fast.shed_total) == \
        (general.inflight, general.admitted_total, general.shed_total)


@settings(max_examples=100, deadline=None)
@given(reqs=request_ops, factor=st.sampled_from([1.0, 0.5]))
def test_the_inline_decision_path_decides_as_the_general_one(reqs, factor):
    """acquire()'s inline common path against _acquire (classify(), _pre, LocalBuckets.take): the same
    decisions, reasons, Retry-After and counters for the same requests at the same times."""
    ca, cb = Clock(), Clock()
    fast, general = Guard(parse_config(INLINE_CFG), clock=ca), Guard(parse_config(INLINE_CFG), clock=cb)
    for g in (fast, general):
        g.limiter.rate_factor = factor
    replay_on_both(fast, general, ca, cb, reqs)


def test_tenant_bucket_limits_one_tenant_not_the_other():
    g = Guard(parse_config({"classes": [{"name": "a", "tenant_rate": 1, "tenant_burst": 2}]}), clock=Clock())
    hog = [g.acquire(RequestInfo(headers={"x-tenant": "hog"})) for _ in range(5)]
    assert [d.admitted for d in hog] == [True, True, False, False, False]
    assert hog[2].reason == "tenant_rate" and hog[2].status == 429 and hog[2].retry_after_header() == "1"
    assert g.acquire(RequestInfo(headers={"x-tenant": "other"})).admitted


def test_class_bucket_retry_after_comes_from_the_bucket():
    g = Guard(parse_config({"classes": [{"name": "a", "rate": 0.2, "burst": 1}]}), clock=Clock())
    assert g.acquire(RequestInfo()).admitted
    d = g.acquire(RequestInfo())
    assert d.reason == "rate" and d.retry_after_s == pytest.approx(5.0)


# ---- shares and priority: a random workload on the async API ---------------------------------------------
ops = st.lists(st.one_of(st.tuples(st.just("arrive"), st.integers(0, 1)), st.tuples(st.just("finish"),
                                                                                  st.integers(0, 1000))),
               min_size=1, max_size=80)


@settings(max_examples=60, deadline=None)
@given(ops=ops, limit=st.integers(1, 12), queue_max=st.integers(0, 6))
def test_shares_are_honoured_and_the_lowest_priority_is_shed_first(ops, limit, queue_max):
    cfg = parse_config(two_classes(controller={"mode": "fixed", "max_limit": limit, "initial_limit": limit,
                                                "min_limit": 1}, queue_max=queue_max))

    async def scenario() -> None:
        g = Guard(cfg)
        running: list = []
        pending: list[tuple[int, asyncio.Task]] = []
        for op, arg in ops:
            if op == "arrive":
                queued_classes = {w.decision.class_index for q in g._queues for w in q if not w.fut.done()}
                pending.append((arg, asyncio.ensure_future(g.acquire_async(RequestInfo(klass=["interactive",
                                                                                               "batch"][arg])))))
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            elif running:
                g.release(running.pop(arg % len(running)), 200, 0.1)
                queued_classes = set()
                await asyncio.sleep(0)
            for cls, t in list(pending):
                if t.done():
                    pending.remove((cls, t))
                    d = t.result()
                    if d.admitted:
                        running.append(d)
                    elif d.reason == "queue_full":
                        # shed on arrival: nothing of a lower priority was waiting to give way
                        assert all(c <= cls for c in queued_classes)
            assert g.queued_total <= queue_max
            assert g.inflight_total <= limit  # the shares never take the total past the limit
            for q in g._queues:
                if any(not w.fut.done() for w in q):  # someone waits: the limit is full
                    assert g.inflight_total >= limit
        for _, t in pending:
            t.cancel()

    asyncio.run(scenario())


def test_batch_keeps_its_guaranteed_share_under_interactive_flood():
    cfg = parse_config(two_classes(controller={"mode": "fixed", "max_limit": 10, "initial_limit": 10}))

    async def scenario() -> tuple:
        g = Guard(cfg)
        flood = [g.acquire(RequestInfo(klass="interactive")) for _ in range(10)]
        waiting = [asyncio.ensure_future(g.acquire_async(RequestInfo(klass="interactive"))) for _ in range(3)]
        await asyncio.sleep(0)
        batch = asyncio.ensure_future(g.acquire_async(RequestInfo(klass="batch")))
        await asyncio.sleep(0)
        full = (batch.done(), g.inflight_total)  # the total is at the limit: it waits, not over it
        g.release(flood[0], 200, 0.1)
        for _ in range(3):
            await asyncio.sleep(0)
        got = (batch.done() and batch.result().admitted, [w.done() for w in waiting], g.inflight_total_peak)
        for w in waiting:
            w.cancel()
        return full, got

    full, got = asyncio.run(scenario())
    assert full == (False, 10)
    # its 1 reserved slot is not in use: the first slot that frees is its, before the older interactive waiters
    assert got == (True, [False, False, False], 10)


def test_unused_share_is_borrowable():
    g = Guard(parse_config(two_classes(controller={"mode": "fixed", "max_limit": 10, "initial_limit": 10})))
    assert sum(g.acquire(RequestInfo(klass="batch")).admitted for _ in range(20)) == 10


def test_a_high_priority_arrival_evicts_the_newest_low_priority_waiter():
    cfg = parse_config({"classes": [{"name": "interactive", "share": 0.5, "queue_timeout_s": 100},
                                    {"name": "batch", "share": 0.0, "queue_timeout_s": 100}],
                        "controller": {"mode": "fixed", "max_limit": 1, "initial_limit": 1, "min_limit": 1},
                        "queue_max": 2})

    async def scenario() -> list:
        g = Guard(cfg)
        first = await g.acquire_async(RequestInfo(klass="interactive"))
        b1 = asyncio.ensure_future(g.acquire_async(RequestInfo(klass="batch")))
        b2 = asyncio.ensure_future(g.acquire_async(RequestInfo(klass="batch")))
        await asyncio.sleep(0)
        hi = asyncio.ensure_future(g.acquire_async(RequestInfo(klass="interactive")))
        await asyncio.sleep(0.01)
        assert b2.done() and b2.result().reason == "evicted"
        g.release(first, 200, 0.1)
        await asyncio.sleep(0.01)
        assert hi.done() and hi.result().admitted  # the interactive waiter is served before the older batch one
        b1.cancel()
        return [b2.result().reason, hi.result().queued_s >= 0]

    assert asyncio.run(scenario()) == ["evicted", True]


def test_queue_deadline_sheds_with_queue_timeout():
    cfg = parse_config({"classes": [{"name": "a", "queue_timeout_s": 0.01}],
                        "controller": {"mode": "fixed", "max_limit": 1, "initial_limit": 1, "min_limit": 1}})

    async def scenario():
        g = Guard(cfg)
        await g.acquire_async(RequestInfo())
        d = await g.acquire_async(RequestInfo())
        return d, g.queued_total

    d, depth = asyncio.run(scenario())
    assert (d.admitted, d.reason, depth) == (False, "queue_timeout", 0)


def test_a_waiter_whose_client_left_gives_its_place_back():
    cfg = parse_config({"classes": [{"name": "a", "queue_timeout_s": 100}],
                        "controller": {"mode": "fixed", "max_limit": 1, "initial_limit": 1, "min_limit": 1}})

    async def scenario():
        g = Guard(cfg)
        first = await g.acquire_async(RequestInfo())
        w = asyncio.ensure_future(g.acquire_async(RequestInfo()))
        await asyncio.sleep(0)
        w.cancel()
        await asyncio.sleep(0)
        g.release(first, 200, 0.1)
        await asyncio.sleep(0)
        return g.inflight_total, g.queued_total

    assert asyncio.run(scenario()) == (0, 0)


# ---- the breaker -----------------------------------------------------------------------------------------------
def test_breaker_state_machine():
    b = Breaker(BreakerConfig(min_requests=4, failure_rate=0.5, open_s=10, probes=1, success_threshold=2,
                              failures=["5xx", "timeout"]))
    for t, status in ((0, 200), (1, 500), (2, 200)):
        b.record(b.allow(t), status, 0.1, False, t)
    assert b.state == "closed"
    b.record(b.allow(3), 0, 0.1, True, 3)  # a timeout: 2 of 4 failed
    assert b.state == "open" and b.allow(12.9) is None
    assert b.allow(13.0) == "probe" and b.state == "half_open"
    assert b.allow(13.1) is None  # one probe at a time
    b.record("probe", 500, 0.1, False, 13.2)
    assert b.state == "open"
    assert b.allow(23.2) == "probe"
    b.record("probe", 200, 0.1, False, 23.3)
    assert b.state == "half_open" and b.allow(23.4) == "probe"
    b.record("probe", 200, 0.1, False, 23.5)
    assert b.state == "closed"


def test_a_client_that_left_is_no_outcome_for_the_breaker_and_no_sample_for_the_limiter():
    b = Breaker(BreakerConfig(min_requests=1, failure_rate=0.5, open_s=10, failures=["5xx", "timeout", "slo"],
                              slo_s=1.0))
    b.record(b.allow(0), 499, 30.0, False, 0)  # slower than the SLO, yet the client's doing
    assert b.state == "closed" and len(b._outcomes) == 0
    b.record(b.allow(1), 500, 0.1, False, 1)
    assert b.state == "open"
    assert b.allow(11) == "probe" and b.allow(11.1) is None
    b.record("probe", 499, 30.0, False, 11.2)  # the probe's slot comes back; the breaker learned nothing
    assert b.state == "half_open" and b.allow(11.3) == "probe"

    clock = Clock()
    g = Guard(parse_config({"classes": [{"name": "a"}], "controller": {"mode": "aimd", "timeout_s": 1.0}}),
              clock=clock)
    before = g.limiter.limit
    for _ in range(20):
        d = g.acquire(RequestInfo())
        clock.t += 5.0
        g.release(d, 499, 5.0)  # each far past the AIMD timeout: would be a drop from the service
    assert g.limiter.limit == before and g.inflight_total == 0


def test_breaker_failure_classes():
    b = Breaker(BreakerConfig(failures=["429", "slo"], slo_s=1.0))
    assert [b.is_failure(s, lat, to) for s, lat, to in ((429, 0.1, False), (500, 0.1, False), (200, 2.0, False),
                                                        (200, 0.5, False), (0, 9, True))] == \
        [True, False, True, False, False]
    b = Breaker(BreakerConfig(failures=["503"]))
    assert (b.is_failure(503, 0, False), b.is_failure(502, 0, False)) == (True, False)


@settings(max_examples=100, deadline=None)
@given(outcomes=st.lists(st.tuples(st.floats(0, 3), st.booleans()), max_size=100))
def test_breaker_never_passes_traffic_while_open_and_never_opens_below_the_rate(outcomes):
    cfg = BreakerConfig(min_requests=5, failure_rate=0.5, open_s=5, window_s=10, probes=2)
    b = Breaker(cfg)
    t = 0.0
    probes_out = 0
    for dt, failed in outcomes:
        t += dt
        state_before = b.state
        token = b.allow(t)
        if state_before == "open" and t - b._opened_at < cfg.open_s:
            assert token is None
        if token == "probe":
            probes_out += 1
            assert probes_out <= cfg.probes
        b.record(token, 500 if failed else 200, 0.1, False, t)
        if token == "probe":
            probes_out -= 1
    never_fail = Breaker(cfg)
    for i in range(100):
        never_fail.record(never_fail.allow(i * 0.1), 500 if i % 3 == 0 else 200, 0.1, False, i * 0.1)
    assert never_fail.state == "closed"  # a third failing is under 0.5


def test_open_breaker_sheds_with_503_or_routes_to_the_cheaper_model():
    clock = Clock()
    base = {"classes": [{"name": "a"}], "breaker": {"min_requests": 1, "failure_rate": 0.5, "open_s": 30}}
    g = Guard(parse_config(base), clock=clock)
    g.release(g.acquire(RequestInfo()), 500, 0.1)
    d = g.acquire(RequestInfo())
    assert (d.admitted, d.status, d.reason, d.retry_after_header()) == (False, 503, "breaker_open", "30")
    g = Guard(parse_config({**base, "breaker": {**base["breaker"], "fallback": "model:small"}}), clock=clock)
    g.release(g.acquire(RequestInfo()), 500, 0.1)
    d = g.acquire(RequestInfo())
    assert (d.admitted, d.degrade, d.target) == (True, "model", "small")


# ---- adaptive limits ----------------------------------------------------------------------------------------------
def _feed(g: Guard, clock: Clock, latency: float, n: int, inflight: int | None = None) -> None:
    """n completions of `latency` each with `inflight` in flight (default: the limit), spaced as Little's law has
    them (latency / inflight apart): an upstream that shows no queue at that concurrency."""
    for _ in range(n):
        k = inflight if inflight is not None else max(1, int(g.limiter.limit))
        clock.t += latency / k
        g.limiter.observe(latency, k, False, clock.t)


def test_gradient_grows_while_the_upstream_shows_no_queue_and_a_slower_upstream_is_not_a_queue():
    clock = Clock()
    g = Guard(parse_config({"classes": [{"name": "a"}]}), clock=clock)
    start = g.limiter.limit
    _feed(g, clock, 0.1, 600)
    grown = g.limiter.limit
    assert grown > 1.5 * start  # latency flat as concurrency rises: no queue, so the limit is not the bound yet
    assert g.limiter.base_s == pytest.approx(0.1)
    assert g.limiter.probes >= 1  # the no-load latency was measured, not assumed
    # 10x slower at every concurrency (longer answers): latency that does not grow with concurrency is no queue
    _feed(g, clock, 1.0, 600)
    assert g.limiter.limit >= grown * 0.9
    assert g.limiter.base_s == pytest.approx(1.0)  # re-measured by a probe, not left at 0.1


def test_gradient_does_not_move_when_app_limited():
    clock = Clock()
    g = Guard(parse_config({"classes": [{"name": "a"}]}), clock=clock)
    _feed(g, clock, 0.1, 300, inflight=1)
    assert g.limiter.limit == 20.0


def test_aimd_backs_off_on_drops_and_grows_when_busy():
    clock = Clock()
    g = Guard(parse_config({"classes": [{"name": "a"}], "controller": {"mode": "aimd"}}), clock=clock)
    g.limiter.observe(0.1, 20, False, clock.t)
    assert g.limiter.limit == 21
    g.limiter.observe(0.1, 20, True, clock.t)
    assert g.limiter.limit == pytest.approx(21 * 0.9)
    g.limiter.observe(9.0, 20, False, clock.t)  # slower than timeout_s: a drop
    assert g.limiter.limit == pytest.approx(21 * 0.81)


def test_gpu_overload_backs_off_and_sm_activity_alone_only_stops_growth():
    clock = Clock()
    g = Guard(parse_config({"classes": [{"name": "a"}]}), clock=clock)
    g.observe_gpu(GpuSignal(clock.t, sm_active_ratio=1.0, memory_free_ratio=0.5))
    assert g.limiter.limit == 20.0
    _feed(g, clock, 0.1, 300)
    g.observe_gpu(GpuSignal(clock.t, sm_active_ratio=1.0, memory_free_ratio=0.5))
    _feed(g, clock, 0.1, 300)
    assert not g.limiter.probing
    assert g.limiter.limit == 20.0  # saturated: no growth while the signal is fresh (unsaturated, it grows: above)
    for what in ({"memory_free_ratio": 0.01}, {"throttled": True}, {"queue_waiting": 50}):
        before = g.limiter.limit
        g.observe_gpu(GpuSignal(clock.t, **what))
        assert g.limiter.limit == pytest.approx(before * 0.9)


def test_stale_gpu_signal_holds_then_falls_back_to_latency_alone():
    clock = Clock()
    g = Guard(parse_config({"classes": [{"name": "a"}], "signals": {"interval_s": 1, "stale_hold_s": 10}}),
              clock=clock)
    g.observe_gpu(GpuSignal(clock.t, sm_active_ratio=0.2))
    clock.t += 5
    assert g.limiter.gpu_signal_state(clock.t) == "stale_hold"
    _feed(g, clock, 0.1, 300)
    assert max(lim for _, lim, *_ in g.limiter.history) <= 20.0  # held: no growth (a probe may lower it)
    held = g.limiter.limit
    clock.t += 10
    assert g.limiter.gpu_signal_state(clock.t) == "stale_ignored"
    _feed(g, clock, 0.1, 300)
    assert held < g.limiter.limit < 200  # the gradient runs again, within its bounds: never 'admit everything'
    text = render(g).decode()
    assert 'gpuscope_guard_gpu_signal_state{state="stale_ignored"} 1' in text


def test_simple_mode_steps_after_three_readings_and_recovers():
    clock = Clock()
    g = Guard(parse_config({"classes": [{"name": "a"}], "controller": {"mode": "simple"}}), clock=clock)

    def read(sat: float) -> float:
        clock.t += 1
        g.observe_gpu(GpuSignal(clock.t, sm_active_ratio=sat))
        return g.limiter.rate_factor

    assert [read(0.87), read(0.87), read(0.87)] == [1.0, 1.0, 0.7]
    assert [read(0.92), read(0.92), read(0.92)] == [0.7, 0.7, 0.4]
    assert [read(0.97), read(0.97), read(0.97)] == [0.4, 0.4, 0.0]
    d = g.acquire(RequestInfo())
    assert (d.admitted, d.reason) == (False, "gpu_saturated")
    assert [read(0.5), read(0.5), read(0.5)] == [0.0, 0.0, 0.4]  # up one level per three readings below
    clock.t += 100  # the signal goes stale: hold, then the gradient limit alone and full rate
    g.acquire(RequestInfo())
    assert g.limiter.rate_factor == 1.0


def test_simple_mode_factor_scales_the_concurrency_limit():
    clock = Clock()
    g = Guard(parse_config({"classes": [{"name": "a"}], "controller": {"mode": "simple", "initial_limit": 10}}),
              clock=clock)
    for _ in range(3):
        clock.t += 1
        g.observe_gpu(GpuSignal(clock.t, sm_active_ratio=0.91))
    assert sum(g.acquire(RequestInfo()).admitted for _ in range(20)) == 4


# ---- metrics and robustness --------------------------------------------------------------------------------------
def test_metrics_parse_as_prometheus_text():
    g = Guard(parse_config({"classes": [{"name": "a", "rate": 1, "burst": 1}]}), clock=Clock())
    g.release(g.acquire(RequestInfo()), 200, 0.1)
    g.acquire(RequestInfo())
    fams = {f.name: f for f in text_string_to_metric_families(render(g).decode())}
    assert fams["gpuscope_guard_admitted"].samples[0].value == 1
    shed = fams["gpuscope_guard_shed"].samples[0]
    assert (shed.labels, shed.value) == ({"class": "a", "reason": "rate"}, 1)
    assert fams["gpuscope_guard_concurrency_limit"].samples[0].value == 20
    assert {s.labels["state"]: s.value for s in fams["gpuscope_guard_breaker_state"].samples}["closed"] == 1
    assert "gpuscope_guard_gpu_signal_age_seconds" not in fams  # no reading yet: absent, not 0


def test_release_twice_and_release_of_a_shed_decision_do_nothing():
    g = Guard(parse_config({"classes": [{"name": "a", "rate": 1, "burst": 1}]}), clock=Clock())
    d = g.acquire(RequestInfo())
    g.release(d)
    g.release(d)
    g.release(g.acquire(RequestInfo()))
    assert g.inflight_total == 0 and not math.isnan(g.limiter.limit)


def test_a_cost_over_the_burst_is_charged_as_the_burst():
    clock = Clock()
    g = Guard(parse_config({"classes": [{"name": "a", "rate": 2, "burst": 4}], "classify": {"cost": "tokens"}}),
              clock=clock)
    big = RequestInfo(body={"prompt": "x" * 400, "max_tokens": 100})  # 200 tokens against a burst of 4
    assert g.acquire(big).admitted
    d = g.acquire(big)
    assert d.reason == "rate" and d.retry_after_s == pytest.approx(2.0)  # until the bucket is full again
    clock.t += 2.0
    assert g.acquire(big).admitted


def test_a_body_too_large_to_read_costs_the_burst_not_one_token():
    # Padding a prompt past classify.max_body_bytes must not make a request cheap.
    from gpuscope.guard._classify import OVERSIZE

    clock = Clock()
    g = Guard(parse_config({"classes": [{"name": "a", "rate": 2, "burst": 4}], "classify": {"cost": "tokens"}}),
              clock=clock)
    assert estimate_tokens(OVERSIZE) > 4
    assert g.acquire(RequestInfo(body=OVERSIZE)).admitted
    d = g.acquire(RequestInfo(body={"prompt": "x", "max_tokens": 0}))  # the burst is spent
    assert not d.admitted and d.reason == "rate"
