"""aiohttp middleware: the guard in front of an aiohttp application's handlers.

    from aiohttp import web
    from gpuscope.guard import Guard, load_config
    from gpuscope.guard.aio import attach

    app = web.Application()
    attach(app, Guard(load_config("guard.yaml")))   # middleware, /guard/metrics, the signal poller

The decision is in `request[DECISION_KEY]` (aiohttp's typed request key, so aiohttp raises no
NotAppKeyWarning and a type checker knows it is a Decision); with `breaker.fallback: model:NAME` a handler reads the
cheaper model from `decision.target` when `decision.degrade == "model"`. `fallback` is a handler that
serves requests while the upstream's circuit is open. Latency is measured to the handler's return (for a
StreamResponse, that is after its last write); a handler exception releases the slot as a 500.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ._classify import OVERSIZE, RequestInfo
from ._core import Decision, Guard
from ._http import GUARD_HEADER, cache_key, needs_body, parse_json, refusal
from ._metrics import CONTENT_TYPE, render
from ._signals import SignalPoller

__all__ = ["DECISION_KEY", "attach", "guard_middleware"]

DECISION_KEY = web.RequestKey("gpuscope_decision", Decision)  # request[DECISION_KEY]: the admitted Decision

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def guard_middleware(guard: Guard, fallback: Handler | None = None, exempt: tuple[str, ...] = ()) -> Any:
    body_needed = needs_body(guard)
    max_body = guard.cfg.classify.max_body_bytes
    keep = guard.cfg.breaker.fallback == "cached"

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in exempt:
            return await handler(request)
        parsed = None
        if body_needed and request.can_read_body and (request.content_length or 0) <= max_body:
            parsed = parse_json(await request.read())  # aiohttp keeps it: the handler can read it again
        elif body_needed and request.can_read_body:
            parsed = OVERSIZE  # too large to read for an estimate: charged as the burst
        headers = {k.lower(): v for k, v in request.headers.items()}
        d = await guard.acquire_async(RequestInfo(path=request.path, headers=headers, body=parsed,
                                                  method=request.method))
        key = cache_key(request.method, request.path, parsed)
        if not d.admitted:
            if d.reason == "breaker_open" and fallback is not None:
                return await fallback(request)
            cached = guard.cache_get(key) if d.degrade == "cached" else None
            if cached is not None:
                return web.Response(body=cached[0], headers={"Content-Type": cached[1], GUARD_HEADER: "cached"})
            status, h, b = refusal(d)
            return web.Response(status=status, body=b, headers=h)
        request[DECISION_KEY] = d
        t0 = time.monotonic()
        try:
            resp = await handler(request)
        except web.HTTPException as e:
            guard.release(d, e.status, time.monotonic() - t0)
            raise
        except BaseException:
            guard.release(d, 500, time.monotonic() - t0)
            raise
        guard.release(d, resp.status, time.monotonic() - t0)
        if keep and d.degrade == "" and resp.status == 200 and isinstance(resp, web.Response) and resp.body \
                and isinstance(resp.body, bytes):
            guard.cache_put(key, resp.body, resp.content_type)
        return resp

    return middleware


def attach(app: web.Application, guard: Guard, fallback: Handler | None = None,
           metrics_path: str | None = "/guard/metrics") -> None:
    """Add the guard's middleware, its metrics route and its signal poller to an app not yet started."""
    app.middlewares.append(guard_middleware(guard, fallback, exempt=(metrics_path,) if metrics_path else ()))
    if metrics_path:
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=render(guard), headers={"Content-Type": CONTENT_TYPE})
        app.router.add_get(metrics_path, metrics)
    poller = SignalPoller(guard)

    async def start(app: web.Application) -> None:
        poller.start()

    async def stop(app: web.Application) -> None:
        await poller.stop()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
