"""A real upstream of fixed capacity for the guard's tests and benchmarks, run as a subprocess (its own core and GIL).

`python tests/capped_upstream.py --port 0 --concurrency 8 --service-ms 50` prints "ready PORT" and serves
until killed, as an inference server with a fixed batch does:
- any path but the ones below: waits for one of `--concurrency` slots (FIFO, no bound on the wait, as an
  engine's own queue), holds it `--service-ms`, answers 200 "ok". A request whose client went away still
  holds its turn and its slot (aiohttp does not cancel the handler), as an engine keeps generating.
- POST /_backlog?n=N: N jobs of the same size join the queue at once, as if left by an earlier run's
  clients; answers at once.
- GET /_stats: {"served", "max_in_service", "max_waiting", "waiting", "in_service", "by_priority":
  {x-priority value: served}, "queue_wait_s": [per request, in order served]}.
- GET /_reset: forgets the statistics (not the jobs under way).
The server's own statistics are what a test checks the guard against: the concurrency it was really
given and how long requests waited inside it, where priority cannot act.

    with CappedUpstream(concurrency=8, service_ms=50) as up: up.url("/work"); up.stats()
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


class CappedUpstream:
    """Starts this module as a subprocess; `url(path)`, `stats()`, `backlog(n)`, `reset()`."""

    def __init__(self, concurrency: int = 8, service_ms: float = 50.0) -> None:
        self.args = [sys.executable, str(Path(__file__)), "--port", "0", "--concurrency", str(concurrency),
                     "--service-ms", str(service_ms)]

    def __enter__(self) -> CappedUpstream:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()  # type: ignore[union-attr]
        if not line or line[0] != "ready":
            self.proc.kill()
            raise RuntimeError("the capped upstream did not start")
        self.port = int(line[1])
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def url(self, path: str = "/work") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _call(self, path: str, method: str = "GET") -> Any:
        req = urllib.request.Request(self.url(path), method=method)
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def stats(self) -> dict[str, Any]:
        return self._call("/_stats")  # type: ignore[no-any-return]

    def backlog(self, n: int) -> None:
        self._call(f"/_backlog?n={n}", "POST")

    def reset(self) -> None:
        self._call("/_reset")


def main() -> None:
    from aiohttp import web

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--service-ms", type=float, default=50.0)
    a = ap.parse_args()
    service_s = a.service_ms / 1000.0
    st: dict[str, Any] = {}
    live = {"in_service": 0, "waiting": 0}

    def reset() -> None:
        st.clear()
        st.update(served=0, max_in_service=0, max_waiting=0, by_priority={}, queue_wait_s=[])

    reset()
    sem: asyncio.Semaphore | None = None

    async def job(priority: str) -> None:
        assert sem is not None
        t0 = time.monotonic()
        live["waiting"] += 1
        st["max_waiting"] = max(st["max_waiting"], live["waiting"])
        waiting = True
        try:
            async with sem:
                live["waiting"] -= 1
                waiting = False
                live["in_service"] += 1
                st["max_in_service"] = max(st["max_in_service"], live["in_service"])
                try:
                    await asyncio.sleep(service_s)
                finally:
                    live["in_service"] -= 1
        finally:
            if waiting:
                live["waiting"] -= 1
        st["served"] += 1
        st["by_priority"][priority] = st["by_priority"].get(priority, 0) + 1
        if len(st["queue_wait_s"]) < 200_000:
            st["queue_wait_s"].append(round(time.monotonic() - t0 - service_s, 6))

    async def work(request: web.Request) -> web.Response:
        await job(request.headers.get("x-priority", ""))
        return web.Response(text="ok")

    tasks: set[asyncio.Task] = set()

    async def backlog(request: web.Request) -> web.Response:
        n = min(100_000, int(request.query.get("n", "0")))
        for _ in range(n):
            t = asyncio.ensure_future(job("backlog"))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        return web.json_response({"queued": n})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(dict(st, **live))

    async def do_reset(request: web.Request) -> web.Response:
        reset()
        return web.json_response({})

    async def run() -> None:
        nonlocal sem
        sem = asyncio.Semaphore(a.concurrency)
        app = web.Application()
        app.router.add_post("/_backlog", backlog)
        app.router.add_get("/_stats", stats)
        app.router.add_get("/_reset", do_reset)
        app.router.add_route("*", "/{tail:.*}", work)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", a.port, backlog=4096)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print("ready", port, flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
