"""A deterministic simulation of the guard in front of an upstream of fixed capacity, on virtual time.

`VirtualLoop` is an asyncio event loop whose clock only moves when nothing is ready to run: it jumps to the
next timer. The guard runs on it unchanged (its clock is the loop's, its queue waits on the loop's timers),
in front of a simulated upstream that serves `capacity` requests at a time for `service_s` each and queues
the rest FIFO inside itself, where priority cannot act. Open-loop Poisson arrivals from a seeded RNG, so a
run is the same every time, on any machine, however loaded: nothing here reads the wall clock.

    res = run(guard_cfg, capacity=8, service_s=0.05, rate=480, seconds=15)
    res.limit_at(10.0), res.high.p50(), res.settled_s(4, 16), res.high.between(5, 15).success
"""

from __future__ import annotations

import asyncio
import random
import selectors
from dataclasses import dataclass, field
from typing import Any

from gpuscope.guard import Guard, RequestInfo, parse_config


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t


class _VirtualSelector(selectors.BaseSelector):
    """Real readiness for the loop's own wake-up pipe; a wait for a timer advances the virtual clock instead."""

    def __init__(self, clock: _Clock) -> None:
        self._real = selectors.DefaultSelector()
        self._clock = clock

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout is None:
            raise RuntimeError("the simulation waits for something that never comes")
        self._clock.t += timeout
        return []

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, start_s: float = 1000.0) -> None:
        self._vclock = _Clock(start_s)
        super().__init__(selector=_VirtualSelector(self._vclock))

    def time(self) -> float:
        return self._vclock.t


@dataclass
class ClassOutcome:
    sent: int = 0
    ok: int = 0
    shed: dict[str, int] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)  # of the successes, from arrival to answer
    events: list[tuple[float, bool, float]] = field(default_factory=list)  # (arrival s from start, ok, latency)

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies_s)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")

    def p50(self) -> float:
        return self.pct(0.5)

    def p99(self) -> float:
        return self.pct(0.99)

    @property
    def success(self) -> float:
        return self.ok / self.sent if self.sent else float("nan")

    def between(self, t0: float, t1: float) -> ClassOutcome:
        """The requests that arrived in [t0, t1) seconds from the start."""
        out = ClassOutcome()
        for t, ok, lat in self.events:
            if t0 <= t < t1:
                out.sent += 1
                out.events.append((t, ok, lat))
                if ok:
                    out.ok += 1
                    out.latencies_s.append(lat)
        return out


@dataclass
class SimResult:
    guard: Guard
    start_s: float
    trajectory: list[tuple[float, float, bool]]  # (seconds from the start, limit, probing) every 0.1 s
    classes: dict[str, ClassOutcome]
    upstream_max_waiting: int
    upstream_max_in_service: int
    stuck_at_end: int  # the guard's in-flight count once every arrival has been answered
    waiting: list[tuple[float, int]]  # (seconds from the start, requests queued inside the upstream) every 0.1 s

    def max_waiting_after(self, t: float) -> int:
        return max(w for s, w in self.waiting if s >= t)

    @property
    def high(self) -> ClassOutcome:
        return self.classes["high"]

    @property
    def low(self) -> ClassOutcome:
        return self.classes["low"]

    def limit_at(self, t: float) -> float:
        return [lim for s, lim, _ in self.trajectory if s <= t][-1]

    def settled_s(self, lo: float, hi: float, after: float = 0.0) -> float | None:
        """Seconds (from the start) after which the limit stayed within [lo, hi] but while a probe had it
        lowered on purpose; None if it ended outside."""
        last = after
        for t, lim, probing in self.trajectory:
            if t >= after and not probing and not lo <= lim <= hi:
                last = t
        return None if not lo <= self.trajectory[-1][1] <= hi else last

    def probing_share(self) -> float:
        return sum(1 for *_, p in self.trajectory if p) / len(self.trajectory)


def default_config(**controller: Any) -> dict[str, Any]:
    return {"classes": [{"name": "high", "share": 0.8, "queue_timeout_s": 1.0},
                        {"name": "low", "share": 0.2, "queue_timeout_s": 1.0}],
            "classify": {"header": "x-priority", "default": "low"}, "queue_max": 256,
            "controller": {"mode": "gradient", **controller}}


def run(cfg: dict[str, Any], *, capacity: int = 8, service_s: float = 0.05, rate: float = 480.0,
        high_ratio: float = 0.2, seconds: float = 15.0, seed: int = 1, backlog_jobs: int = 0,
        jitter: float = 0.0, service_at: list[tuple[float, float]] | None = None, hang_ratio: float = 0.0
        ) -> SimResult:
    """One run: `rate` arrivals/s for `seconds`, then until every one is answered (bounded by the guard's own
    queue timeouts). `backlog_jobs` jobs of `service_s` wait in the upstream at the start (an earlier run's
    work); `jitter` spreads each service time uniformly by +-jitter (a ratio); `service_at` [(from_s, service_s)]
    changes the service time from those times on (a slower or faster upstream); a `hang_ratio` share of the
    requests are lost on the way (no answer for an hour, the upstream's slot not taken)."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(_run(cfg, capacity, service_s, rate, high_ratio, seconds, seed, backlog_jobs,
                                            jitter, service_at or [], hang_ratio))
    finally:
        loop.close()


async def _run(cfg: dict[str, Any], capacity: int, service_s: float, rate: float, high_ratio: float, seconds: float,
               seed: int, backlog_jobs: int, jitter: float, service_at: list[tuple[float, float]], hang_ratio: float
               ) -> SimResult:
    loop = asyncio.get_running_loop()
    guard = Guard(parse_config(cfg), clock=loop.time)
    rng = random.Random(seed)
    t0 = loop.time()
    sem = asyncio.Semaphore(capacity)
    state = {"waiting": 0, "in_service": 0, "max_waiting": 0, "max_in_service": 0}
    classes = {"high": ClassOutcome(), "low": ClassOutcome()}

    def service_time() -> float:
        s = service_s
        for since, value in service_at:
            if loop.time() - t0 >= since:
                s = value
        return s * (1 + rng.uniform(-jitter, jitter)) if jitter else s

    async def upstream() -> None:
        state["waiting"] += 1
        state["max_waiting"] = max(state["max_waiting"], state["waiting"])
        async with sem:
            state["waiting"] -= 1
            state["in_service"] += 1
            state["max_in_service"] = max(state["max_in_service"], state["in_service"])
            await asyncio.sleep(service_time())
            state["in_service"] -= 1

    async def request(klass: str) -> None:
        out = classes[klass]
        out.sent += 1
        arrived = loop.time()
        d = await guard.acquire_async(RequestInfo(path="/v1/completions", headers={"x-priority": klass}))
        if not d.admitted:
            out.shed[d.reason] = out.shed.get(d.reason, 0) + 1
            out.events.append((arrived - t0, False, loop.time() - arrived))
            return
        sent = loop.time()
        if hang_ratio and rng.random() < hang_ratio:
            await asyncio.sleep(3600.0)
            guard.release(d, 504, loop.time() - sent, timed_out=True)
            out.events.append((arrived - t0, False, loop.time() - arrived))
            return
        await upstream()
        guard.release(d, 200, loop.time() - sent)
        out.ok += 1
        out.latencies_s.append(loop.time() - arrived)
        out.events.append((arrived - t0, True, loop.time() - arrived))

    trajectory: list[tuple[float, float, bool]] = []
    waiting: list[tuple[float, int]] = []

    async def sampler() -> None:
        while loop.time() - t0 <= seconds:
            trajectory.append((loop.time() - t0, guard.limiter.limit, bool(guard.limiter.probing)))
            waiting.append((loop.time() - t0, state["waiting"]))
            await asyncio.sleep(0.1)

    backlog = [asyncio.ensure_future(upstream()) for _ in range(backlog_jobs)]
    tasks = [asyncio.ensure_future(sampler())]
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        await asyncio.sleep(max(0.0, t0 + t - loop.time()))
        klass = "high" if rng.random() < high_ratio else "low"
        tasks.append(asyncio.ensure_future(request(klass)))
    await asyncio.gather(*tasks, *backlog)
    return SimResult(guard, t0, trajectory, classes, state["max_waiting"], state["max_in_service"],
                     guard.inflight_total, waiting)
