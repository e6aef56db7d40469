"""The adaptive limit end to end: the aiohttp middleware in front of a real upstream of fixed capacity.

tests/capped_upstream.py runs in its own process on 127.0.0.1 and serves 8 requests at a time, 50 ms each,
queueing the rest inside itself. An aiohttp app in this process, with the guard attached, forwards every
request to it; `gpuscope loadtest` in a third process offers 3x its capacity (480 req/s, Poisson, 20 % high
priority) for 8 s. What is asserted is what the code recorded: the guard's limit history, each class's
outcomes in the load tester's records, the upstream's own count of what it ran and how long requests waited
inside it. Latency bounds come from this run's own unloaded measurement and its measured delays (the load
tester's send lag, this event loop's lag), not from the wall clock of a quiet machine; when this process was
starved of CPU (its loop's p99 lag over 15 ms, as beside stress-ng), the lower bound of the limit and the
latency bound are not checked: the rest (no runaway, no queue inside the upstream, priorities) still is.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from capped_upstream import CappedUpstream

from gpuscope.guard import Guard, parse_config
from gpuscope.guard.aio import DECISION_KEY, attach

C, SERVICE_S, RATE, SECONDS = 8, 0.05, 480, 8
STEADY_S = 5.0  # from the first request on: the limit settled and the queue built while it did served
STARVED_LAG_S = 0.015  # this process's event-loop lag p99 over which the run measured the machine, not the guard
GPUSCOPE = [sys.executable, "-m", "gpuscope"]

CFG = {"classes": [{"name": "high", "share": 0.8, "queue_timeout_s": 1.0},
                   {"name": "low", "share": 0.2, "queue_timeout_s": 1.0}],
       "classify": {"header": "x-priority", "default": "low"}, "queue_max": 256}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]


async def _scenario(upstream: CappedUpstream, tmp: Path) -> dict:
    guard = Guard(parse_config(CFG))
    app = web.Application()
    client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    served: dict[str, list[tuple[float, float]]] = {"high": [], "low": []}  # (at, queue wait + upstream time)

    async def forward(request: web.Request) -> web.Response:
        t0 = time.monotonic()
        klass = request.headers.get("x-priority", "low")
        async with client.get(upstream.url("/work"), headers={"x-priority": klass}) as r:
            body = await r.read()
        served[klass].append((t0, request[DECISION_KEY].queued_s + time.monotonic() - t0))
        return web.Response(status=r.status, body=body)

    lags: list[tuple[float, float]] = []  # this event loop's own delay: how late a 10 ms sleep wakes

    async def lag_monitor() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append((t, time.monotonic() - t - 0.01))

    app.router.add_get("/work", forward)
    attach(app, guard)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/work"
    out: dict = {"guard": guard}
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(40):  # one high request at a time: this run's own no-load figure, as the guard sees it
                async with s.get(url, headers={"x-priority": "high"}) as r:
                    await r.read()
        out["unloaded_p50_s"] = statistics.median(lat for _, lat in served["high"])
        served["high"].clear()
        upstream.reset()
        reqs = tmp / "requests.jsonl"
        reqs.write_text("".join(json.dumps({"method": "GET", "path": "/work", "headers": {"x-priority": k}, "tag": k})
                                + "\n" for k in ("high", "low", "low", "low", "low")))
        monitor = asyncio.ensure_future(lag_monitor())
        out["start"] = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *GPUSCOPE, "loadtest", url, "--rate", str(RATE), "--duration", f"{SECONDS}s", "--arrival", "poisson",
            "--seed", "7", "--request-file", str(reqs), "--timeout", "10s", "--workers", "1", "--out",
            str(tmp / "run"), "--no-html", "--no-gpu", "--quiet",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            _, err = await asyncio.wait_for(proc.communicate(), SECONDS + 60)
        except TimeoutError:
            proc.kill()
            raise
        monitor.cancel()
        out["upstream"] = upstream.stats()
        out["served"] = {k: [(t - out["start"], lat) for t, lat in v] for k, v in served.items()}
        out["lag"] = [(t - out["start"], lag) for t, lag in lags]
        with open(tmp / "run" / "records.jsonl") as f:
            out["records"] = [json.loads(line) for line in f if line.strip()]
        assert out["records"], err.decode(errors="replace")[-500:]
    finally:
        await runner.cleanup()
        await client.close()
    return out


def test_the_limit_finds_the_upstreams_capacity_and_keeps_high_priority_fast(tmp_path):
    with CappedUpstream(concurrency=C, service_ms=SERVICE_S * 1000) as up:
        res = asyncio.run(_scenario(up, tmp_path))
    g: Guard = res["guard"]
    recs = [r for r in res["records"] if not r.get("warmup")]
    t0 = min(r["t_intended"] for r in recs)  # in the load tester's clock
    first = min(at for v in res["served"].values() for at, _ in v)  # the load's start in ours (from res["start"])
    # the limit, as recorded: near the upstream's real concurrency, which the upstream itself reports (it never
    # ran more than C at once); Gradient2 climbed to its max_limit (200) here
    assert res["upstream"]["max_in_service"] == C
    hist = [(t - res["start"] - first, lim, ev) for t, lim, _, _, ev in g.limiter.history]
    late = [lim for t, lim, ev in hist if t >= STEADY_S and ev != "probe"]
    assert late, hist
    assert all(lim <= 2 * C for lim in late), hist
    # Was this process starved of CPU during the load (its event loop's p99 lag: 4-5 ms at load 3-4.5 on the
    # 2-core dev machine, 49 ms beside stress-ng --cpu 2)? A starved guard process completes fewer requests,
    # which the limiter rightly reads as less capacity and then climbs back from: the figures below then
    # measure the machine, not the guard, and are checked only when it was not.
    starved = _pct([lag for _, lag in res["lag"]], 0.99) > STARVED_LAG_S
    # ... or the load tester (its own process): sent late, its requests arrive in bursts, and a burst of high
    # priority can fill high's own queue (queue_full) however well the guard did
    starved = starved or _pct([r["t_sent"] - r["t_intended"] for r in recs if r.get("t_sent") is not None],
                              0.99) > STARVED_LAG_S
    if not starved:
        assert all(C / 2 <= lim for lim in late), hist
    # the queue stayed out of the upstream: inside it a request waited, at the median, under one service time
    waits = res["upstream"]["queue_wait_s"]
    assert statistics.median(waits) <= SERVICE_S, statistics.median(waits)
    # priorities, from the load tester's records: high priority served, low priority shed first
    by = {k: [r for r in recs if r.get("tag") == k] for k in ("high", "low")}
    assert len(by["high"]) > 0.1 * RATE * SECONDS and len(by["low"]) > 0.5 * RATE * SECONDS
    ok = {k: sum(1 for r in v if r.get("status") == 200) / len(v) for k, v in by.items()}
    shed = {k: sum(1 for r in v if r.get("status") == 429) / len(v) for k, v in by.items()}
    # Always: high priority is served before low. Unstarved: nearly all of it. (A starved process completes fewer
    # requests, the limit follows them down, and high priority, never let past the limit, times out in its queue
    # too: 56 % of high served against 4 % of low at load 7 beside other test runs, 11 % against 2 % beside
    # stress-ng and a whole suite.)
    # A starved guard (a whole suite beside it on 2 cores) may shed nearly all of both (96 % of high, 99 % of low
    # seen): then only the order holds.
    assert ok["high"] >= ok["low"] and shed["low"] >= shed["high"], (ok, shed)
    if not starved:
        assert ok["high"] >= 0.9 and ok["high"] >= ok["low"] + 0.3, ok
        assert shed["low"] > 0.4 and shed["low"] > shed["high"] + 0.3, shed
    if not starved:
        assert sum(g.shed_total.get((0, r), 0) for r in ("queue_full", "evicted")) == 0  # high is never pushed out
    assert g.shed_total.get((0, "evicted"), 0) == 0  # nor ever evicted to make room for a lower class
    # high priority's median within 2x of its unloaded one, both as the guard's side saw them (its queue wait
    # and the upstream's answer), plus what this run's own delays add: the load tester sending late (a burst
    # that should have been spread), and this event loop lagging (about four hops per request; its p99, as a
    # process starved of CPU stalls in bursts, and a stall thins the completions the limiter counts, so that
    # it lowers the limit and climbs back). Gradient2 gave 25x here.
    since = first + STEADY_S
    steady = [lat for at, lat in res["served"]["high"] if at >= since]
    send_lag = _pct([r["t_sent"] - r["t_intended"] for r in recs if r["t_intended"] - t0 >= STEADY_S], 0.9)
    loop_lag = _pct([lag for at, lag in res["lag"] if at >= since], 0.99)
    bound = 2 * res["unloaded_p50_s"] + send_lag + 4 * loop_lag
    if not starved:
        assert statistics.median(steady) <= bound, (statistics.median(steady), res["unloaded_p50_s"], send_lag,
                                                    loop_lag)
    assert g.inflight_total == 0 and g.queued_total == 0
