"""aiohttp middleware: the guard in front of an aiohttp application's handlers.

    from aiohttp import web
    from gpuscope.guard import Guard, load_config
    from gpuscope.guard.aio import attach

    app = web.Application()
    attach(app, Guard(load_config("guard.yaml")))   # middleware, /guard/metrics, the signal poller

A class's `deadline_s` stops its requests there, as the proxy does (`_deadline.stop` decides, counts and logs):
one resumed from the queue past it is answered 503 without calling the handler; a handler still running is
cancelled and, with no answer begun, answered 504; an answer already streaming ends there (`write_eof`: the last
chunk), or, framed by its Content-Length, is cut with the connection. That a streamed answer has begun is known
from the app's `on_response_prepare` signal, which `attach` hooks; with `guard_middleware` alone, add
`app.on_response_prepare.append(mark_prepared)` for the same (without it such an answer is cut).

The decision is in `request[DECISION_KEY]` (aiohttp's typed request key, so aiohttp raises no
NotAppKeyWarning and a type checker knows it is a Decision); with `breaker.fallback: model:NAME` a handler reads the
cheaper model from `decision.target` when `decision.degrade == "model"`. `fallback` is a handler that
serves requests while the upstream's circuit is open. Latency is measured to the handler's return (for a
StreamResponse, that is after its last write); a handler exception releases the slot as a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ._classify import OVERSIZE, RequestInfo
from ._core import Decision, Guard
from ._deadline import Stop, stop
from ._http import GUARD_HEADER, cache_key, needs_body, parse_json, refusal
from ._metrics import CONTENT_TYPE, render
from ._signals import SignalPoller

__all__ = ["DECISION_KEY", "attach", "guard_middleware", "mark_prepared"]

DECISION_KEY = web.RequestKey("gpuscope_decision", Decision)  # request[DECISION_KEY]: the admitted Decision
_PREPARED_KEY = web.RequestKey("gpuscope_prepared", web.StreamResponse)  # the answer begun (mark_prepared)
_INF = math.inf

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
        timer = stopped = None
        if d.deadline_s != _INF:
            left = d.deadline_s - guard.now()
            if left <= 0 or d.expired:  # resumed from the queue past its deadline (a starved loop): never started
                st = stop(guard, d, sent=False, started=False, what=f"{request.method} {request.path}")
                return web.Response(status=st.status, body=st.body(), headers=st.headers)
            task = asyncio.current_task()

            def past_deadline() -> None:
                nonlocal stopped
                prepared = request.get(_PREPARED_KEY)
                stopped = stop(guard, d, sent=True, started=prepared is not None or not hooked[0],
                               what=f"{request.method} {request.path}")
                if task is not None:
                    task.cancel()
            timer = asyncio.get_running_loop().call_later(left, past_deadline)
        t0 = time.monotonic()
        try:
            resp = await handler(request)
        except web.HTTPException as e:
            guard.release(d, e.status, time.monotonic() - t0)
            raise
        except asyncio.CancelledError:
            if stopped is None:
                guard.release(d, 500, time.monotonic() - t0)
                raise
            return await _end_at_deadline(request, stopped)
        except BaseException:
            guard.release(d, 500, time.monotonic() - t0)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if stopped is not None:  # the handler caught the cancel and returned: its answer still ends here
            return await _end_at_deadline(request, stopped, resp)
        guard.release(d, resp.status, time.monotonic() - t0)
        if keep and d.degrade == "" and resp.status == 200 and isinstance(resp, web.Response) and resp.body \
                and isinstance(resp.body, bytes):
            guard.cache_put(key, resp.body, resp.content_type)
        return resp

    hooked = [False]  # whether mark_prepared is on the app's on_response_prepare (attach does it)
    middleware.gpuscope_hooked = hooked
    return middleware


async def mark_prepared(request: web.Request, response: web.StreamResponse) -> None:
    """An `on_response_prepare` handler: notes that the request's answer has begun (so that the guard ends a
    streamed answer at its deadline instead of cutting it)."""
    if DECISION_KEY in request:
        request[_PREPARED_KEY] = response


async def _end_at_deadline(request: web.Request, st: Stop, resp: web.StreamResponse | None = None
                           ) -> web.StreamResponse:
    """The handler was cancelled at the request's deadline: a 504 if no answer began; else the answer ends there,
    with its last chunk (or the close of an HTTP/1.0 one), or, framed by its length, by a cut connection."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        task.uncancel()
    prepared = request.get(_PREPARED_KEY)
    if st.status and prepared is None:
        return web.Response(status=st.status, body=st.body(), headers=st.headers)
    began = prepared or resp
    if began is not None and began.prepared and (began.chunked or began.content_length is None):
        with contextlib.suppress(ConnectionError):
            await began.write_eof()
        return began
    # framed by its length (or not known to have begun, without mark_prepared): only a cut ends it
    if request.transport is not None:
        request.transport.abort()
    return began if began is not None and began.prepared else web.Response(status=504)  # never written


def attach(app: web.Application, guard: Guard, fallback: Handler | None = None,
           metrics_path: str | None = "/guard/metrics") -> None:
    """Add the guard's middleware, its metrics route and its signal poller to an app not yet started."""
    mw = guard_middleware(guard, fallback, exempt=(metrics_path,) if metrics_path else ())
    mw.gpuscope_hooked[0] = True
    app.middlewares.append(mw)
    app.on_response_prepare.append(mark_prepared)
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
