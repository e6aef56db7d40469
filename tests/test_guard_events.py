"""The guard's state changes in the agent's event stream: a real agent process on loopback receives them from a real
guard, and the emitter never raises when the agent is away."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from redis_server import redis_server  # noqa: F401 - fixture
from test_agent import AgentProc, free_port, http

from gpuscope.guard import Guard, RequestInfo
from gpuscope.guard._config import GuardConfigError, parse
from gpuscope.guard._events import EventEmitter
from gpuscope.guard._limit import GpuSignal
from gpuscope.guard._signals import SignalPoller

REQ = RequestInfo(path="/v1/completions")


@pytest.fixture
def agent(tmp_path):
    a = AgentProc(tmp_path, "--simulate", "healthy", "--gpus", "1")
    a.wait_ready()
    yield a
    a.stop()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def config(agent_url: str, token_file: str = "", **sections: dict) -> object:
    raw: dict = {"classes": [{"name": "interactive", "share": 0.5}, {"name": "batch", "share": 0.5}],
                 "signals": {"agent": agent_url, "agent_token_file": token_file, **sections.pop("signals", {})},
                 "breaker": {"min_requests": 4, "failure_rate": 0.5, "open_s": 60, "probes": 1,
                             "success_threshold": 2}}
    raw.update(sections)
    return parse(raw)


def stored_guard_events(agent: AgentProc, types: list[str]) -> list[dict]:
    """The agent's guard events, once those of every wanted type are there (next tick and flush: about a second)."""
    deadline = time.monotonic() + 30
    while True:
        code, body = http(agent.port, "/api/v1/events?kind=guard&start=-1h")
        assert code == 200
        evs = json.loads(body)["events"]
        if {t for t in types} <= {e["data"]["type"] for e in evs} or time.monotonic() > deadline:
            return evs
        time.sleep(0.2)


def fail(guard: Guard, n: int, status: int = 500) -> None:
    for _ in range(n):
        d = guard.acquire(REQ)
        assert d.admitted
        guard.release(d, status=status, latency_s=0.01)


def test_a_real_guard_s_breaker_cycle_reaches_the_agent_through_the_signal_poller(agent):
    clock = Clock()
    guard = Guard(config(f"http://127.0.0.1:{agent.port}", str(agent.data / "token")), clock=clock)

    async def run() -> None:
        poller = SignalPoller(guard)
        poller.start()  # as the proxy, the ASGI and the aiohttp middleware do: it starts the emitter too
        assert poller.emitter is not None
        fail(guard, 4)
        assert guard.breaker.state == "open"
        clock.t = 61.0  # past open_s: the next request is a probe
        for _ in range(2):
            d = guard.acquire(REQ)
            assert d.admitted and d.probe == "probe"
            guard.release(d, status=200, latency_s=0.01)
        assert guard.breaker.state == "closed"
        await asyncio.to_thread(stored_guard_events, agent, ["breaker_open", "breaker_half_open", "breaker_closed"])
        emitter = poller.emitter
        await poller.stop()
        assert emitter.sent_total >= 3 and emitter.failed_posts_total == 0

    asyncio.run(run())
    evs = stored_guard_events(agent, [])
    breaker = [e for e in evs if e["data"]["type"].startswith("breaker_")]
    assert [e["data"]["type"] for e in breaker] == ["breaker_open", "breaker_half_open", "breaker_closed"]
    opened = breaker[0]
    assert opened["kind"] == "guard" and opened["data"]["severity"] == "critical"
    assert opened["data"]["labels"] == {"from": "closed", "to": "open"}
    assert opened["data"]["source"].startswith("gpuscope-guard@")
    assert "closed -> open" in opened["message"]
    assert abs(opened["time_ns"] / 1e9 - time.time()) < 120
    assert [e["data"]["severity"] for e in breaker[1:]] == ["warning", "info"]


def test_a_refused_batch_is_dropped_and_counted_not_retried(agent):
    guard = Guard(config(f"http://127.0.0.1:{agent.port}"))
    em = EventEmitter(guard, token="not-the-token")
    fail(guard, 4)
    assert len(em.queue) == 1
    assert em.flush() is False
    assert (em.dropped_total, em.sent_total, len(em.queue)) == (1, 0, 0)


def test_the_emitter_never_raises_when_the_agent_is_down(caplog):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    guard = Guard(config(url))
    em = EventEmitter(guard, token="t", max_queue=5)
    with caplog.at_level(logging.WARNING, logger="gpuscope.guard"):
        fail(guard, 4)  # the breaker opens: its hook queues an event, the decision path is untouched
        assert guard.breaker.state == "open"
        for i in range(7):
            em.emit("custom", "info", f"event {i}")
        assert em.flush() is False
        assert em.flush() is False
    # a queue of 5: the oldest (the breaker's and two more) were dropped, the newest wait for the agent
    assert [e["message"] for e in em.queue] == [f"event {i}" for i in range(2, 7)]
    assert em.dropped_total == 3 and em.failed_posts_total == 2
    assert sum("cannot post events" in r.getMessage() for r in caplog.records) == 1  # once per outage
    em.start()  # the thread too: it checks, fails to send, and stops without raising
    em.stop()
    assert len(em.queue) == 5


def test_shedding_started_and_stopped_with_counts():
    guard = Guard(parse({"classes": [{"name": "interactive", "share": 0.5},
                                     {"name": "batch", "share": 0.5, "rate": 1, "burst": 1}]}),
                  clock=Clock())  # time stands still: the bucket never refills, every later request is shed
    em = EventEmitter(guard, url="http://127.0.0.1:1", token="t")
    batch = RequestInfo(path="/", headers={"x-priority": "batch"})
    shed = [guard.acquire(batch) for _ in range(6)]
    assert sum(not d.admitted for d in shed) == 5
    em.check()
    (started,) = list(em.queue)
    assert started["type"] == "shedding_started" and started["severity"] == "warning"
    assert started["labels"] == {"class": "batch", "shed": "5", "rate": "5"}
    for _ in range(3):
        guard.acquire(batch)  # still shedding: no new event, the count grows
        em.check()
    assert len(em.queue) == 1
    for _ in range(5):
        em.check()
    stopped = em.queue[-1]
    assert stopped["type"] == "shedding_stopped" and stopped["labels"] == {"class": "batch", "shed": "8"}
    em.check()
    assert len(em.queue) == 2


def test_limit_moves_and_its_minimum():
    guard = Guard(parse({"classes": [{"name": "all", "share": 1.0}], "breaker": {"enabled": False},
                         "controller": {"mode": "aimd", "initial_limit": 20, "min_limit": 2}}))
    em = EventEmitter(guard, url="http://127.0.0.1:1", token="t")
    fail(guard, 1, status=503)  # a drop: x0.9, 18 is within 20 % of 20
    em.check()
    assert not em.queue
    fail(guard, 2, status=503)  # 14.6: more than 20 % down
    em.check()
    (moved,) = list(em.queue)
    assert moved["type"] == "limit_changed" and moved["labels"] == {"from": "20.0", "to": "14.6"}
    fail(guard, 40, status=503)
    em.check()
    types = [e["type"] for e in em.queue]
    assert types == ["limit_changed", "limit_changed", "limit_at_min"]
    fail(guard, 3, status=503)
    em.check()
    assert len(em.queue) == 3  # at the minimum it is not reported again


def test_gpu_signal_stale_and_fresh():
    clock = Clock()
    guard = Guard(config("http://127.0.0.1:1"), clock=clock)
    em = EventEmitter(guard, token="t")
    em.check()
    assert not em.queue  # no signal yet: nothing went stale
    guard.observe_gpu(GpuSignal(clock.t, sm_active_ratio=0.5))
    em.check()
    clock.t = 5.0  # two intervals without a reading
    em.check()
    guard.observe_gpu(GpuSignal(clock.t, sm_active_ratio=0.5))
    em.check()
    assert [(e["type"], e["labels"]["state"]) for e in em.queue] == [("gpu_signal_stale", "stale_hold"),
                                                                      ("gpu_signal_fresh", "fresh")]


def test_redis_fallback_entered_and_left(redis_server):  # noqa: F811
    from gpuscope.guard._redis import RedisBuckets

    clock = Clock()
    cfg = parse({"classes": [{"name": "all", "share": 1.0, "rate": 1000}],
                 "redis": {"url": redis_server.url, "retry_s": 1.0}})
    guard = Guard(cfg, clock=clock, buckets=RedisBuckets(cfg))
    em = EventEmitter(guard, url="http://127.0.0.1:1", token="t")
    assert guard.acquire(REQ).admitted
    em.check()
    assert not em.queue
    redis_server.stop()
    guard.acquire(REQ)
    em.check()
    redis_server.start()
    clock.t = 2.0  # past retry_s: the next decision tries Redis again
    guard.acquire(REQ)
    em.check()
    assert [e["type"] for e in em.queue] == ["redis_fallback_entered", "redis_fallback_left"]
    assert em.queue[0]["severity"] == "warning"


def test_events_are_off_without_an_agent_or_when_turned_off():
    assert not EventEmitter.wanted(Guard(parse({"classes": [{"name": "a"}]})))
    off = Guard(config("http://127.0.0.1:1", signals={"events": False}))
    assert not EventEmitter.wanted(off)

    async def run() -> object:
        poller = SignalPoller(off)
        poller.start()
        emitter = poller.emitter
        await poller.stop()
        return emitter

    assert asyncio.run(run()) is None
    with pytest.raises(GuardConfigError, match="signals.events must be true or false"):
        config("http://127.0.0.1:1", signals={"events": "yes"})
