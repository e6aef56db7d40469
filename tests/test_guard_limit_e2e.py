"""The adaptive limit end to end: the aiohttp middleware in front of a real upstream of fixed capacity.

tests/capped_upstream.py runs in its own process on 127.0.0.1 and serves 8 requests at a time, 50 ms each,
queueing the rest inside itself. An aiohttp app with the guard attached forwards every request to it; an
open-loop client offers 3x its capacity (480 req/s, Poisson, 20 % high priority) for a bounded time. What is
asserted is what the code recorded: the guard's limit history, each class's outcomes, the upstream's own
count of what it was given and how long requests waited inside it. Latency bounds come from this run's own
unloaded measurement and the upstream's service time, not from the wall clock of a quiet machine.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import aiohttp
from aiohttp import web
from capped_upstream import CappedUpstream

from gpuscope.guard import Guard, parse_config
from gpuscope.guard.aio import attach

C, SERVICE_S, RATE, SECONDS = 8, 0.05, 480.0, 6.0

CFG = {"classes": [{"name": "high", "share": 0.8, "queue_timeout_s": 1.0},
                   {"name": "low", "share": 0.2, "queue_timeout_s": 1.0}],
       "classify": {"header": "x-priority", "default": "low"}, "queue_max": 256}


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _scenario(upstream: CappedUpstream) -> dict:
    guard = Guard(parse_config(CFG))
    app = web.Application()
    client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def forward(request: web.Request) -> web.Response:
        async with client.get(upstream.url("/work"), headers={"x-priority": request.headers["x-priority"]}) as r:
            return web.Response(status=r.status, body=await r.read())

    app.router.add_get("/work", forward)
    attach(app, guard)
    runner, url = await _serve(app)
    out: dict = {"guard": guard, "high": [], "low": []}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=10)) as s:
            async def one(klass: str) -> tuple[int, float]:
                t0 = time.monotonic()
                async with s.get(url + "/work", headers={"x-priority": klass}) as r:
                    await r.read()
                    return r.status, time.monotonic() - t0

            unloaded = [(await one("high"))[1] for _ in range(40)]  # one at a time: this run's own no-load figure
            out["unloaded_p50_s"] = statistics.median(unloaded)
            upstream.reset()
            rng = random.Random(7)
            tasks: list[tuple[str, float, asyncio.Task]] = []
            start = time.monotonic()
            t = 0.0
            while True:
                t += rng.expovariate(RATE)
                if t >= SECONDS:
                    break
                await asyncio.sleep(max(0.0, start + t - time.monotonic()))
                klass = "high" if rng.random() < 0.2 else "low"
                tasks.append((klass, time.monotonic() - start, asyncio.ensure_future(one(klass))))
                if time.monotonic() - start >= SECONDS + 5:  # a starved loop: stop sending, the run is bounded
                    break
            for klass, sent_at, task in tasks:
                status, latency = await task
                out[klass].append((sent_at, status, latency))
            out["upstream"] = upstream.stats()
            out["start"] = start
    finally:
        await runner.cleanup()
        await client.close()
    return out


def test_the_limit_finds_the_upstreams_capacity_and_keeps_high_priority_fast():
    with CappedUpstream(concurrency=C, service_ms=SERVICE_S * 1000) as up:
        res = asyncio.run(_scenario(up))
    g: Guard = res["guard"]
    # the limit, as recorded: from Gradient2's 200 to near the upstream's real concurrency, which the upstream
    # itself reports (it never ran more than C at once)
    assert res["upstream"]["max_in_service"] == C
    hist = [(t - res["start"], lim, ev) for t, lim, _, _, ev in g.limiter.history]
    late = [lim for t, lim, ev in hist if t >= SECONDS / 2 and ev not in ("probe",)]
    assert late, hist
    assert all(C / 2 <= lim <= 2 * C for lim in late), hist
    assert g.limiter.base_s <= 2 * SERVICE_S + res["unloaded_p50_s"]  # the no-load latency it measured
    # the queue stayed out of the upstream: inside it a request waited, at the median, under one service time
    waits = res["upstream"]["queue_wait_s"]
    assert statistics.median(waits) <= SERVICE_S, statistics.median(waits)
    # priorities: high priority served, low priority shed first
    high, low = res["high"], res["low"]
    high_ok = [lat for _, st, lat in high if st == 200]
    assert len(high_ok) >= 0.9 * len(high)
    shed = {k: sum(1 for _, st, _ in v if st == 429) / len(v) for k, v in (("high", high), ("low", low))}
    assert shed["low"] > 0.4 and shed["low"] > shed["high"] + 0.3, shed
    assert sum(g.shed_total.get((0, r), 0) for r in ("queue_full", "evicted")) == 0  # high is never pushed out
    # high priority's median within 2x of its unloaded one, measured in this run (plus one service time of
    # slack for a loaded machine's event loop: Gradient2 gave 25x here)
    steady = [lat for sent, st, lat in high if st == 200 and sent >= SECONDS / 2]
    assert statistics.median(steady) <= 2 * res["unloaded_p50_s"] + SERVICE_S, (statistics.median(steady),
                                                                                 res["unloaded_p50_s"])
    assert g.inflight_total == 0 and g.queued_total == 0
