"""ASGI middleware (Starlette, FastAPI, vLLM's OpenAI server): the guard in front of an ASGI app.

    from starlette.applications import Starlette
    from gpuscope.guard import Guard, load_config
    from gpuscope.guard.asgi import GuardMiddleware

    app = Starlette(routes=...)
    app.add_middleware(GuardMiddleware, guard=Guard(load_config("guard.yaml")))

Refused requests get 429 (503 when the upstream's circuit is open) with Retry-After and a JSON error.
`fallback` is an ASGI app that serves requests while the circuit is open; with `breaker.fallback: cached`
the last good answer for the same method, path and model is replayed; with `model:NAME` the body's model
field is rewritten. The guard's metrics are served at `metrics_path`. Latency is measured to the last
body byte, TTFT to the first; an exception in the app releases the slot as a 500 and goes on up. A client
that stops reading (one body write waits `breaker.client_stall_s`) gives its slot back as a 499: the app's
send raises ClientStalled (an OSError, which Starlette takes for a disconnect). The connection itself is
the server's: uvicorn closes it once its buffered answer is sent, which a client that never reads may
hold off (ASGI gives the middleware no way to abort it; the proxy does abort it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ._classify import OVERSIZE, RequestInfo
from ._core import Guard
from ._deadline import Stop, stop
from ._http import GUARD_HEADER, cache_key, needs_body, parse_json, refusal, rewrite_model
from ._metrics import CONTENT_TYPE, render
from ._signals import SignalPoller

__all__ = ["ClientStalled", "GuardMiddleware"]

_INF = math.inf

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ClientStalled(ConnectionError):
    """Raised from send() to the app when the client has read nothing for breaker.client_stall_s."""


class GuardMiddleware:
    def __init__(self, app: ASGIApp, guard: Guard, fallback: ASGIApp | None = None,
                 metrics_path: str | None = "/guard/metrics") -> None:
        self.app = app
        self.guard = guard
        self.fallback = fallback
        self.metrics_path = metrics_path
        self._poller = SignalPoller(guard)
        self._needs_body = needs_body(guard)
        self._max_body = guard.cfg.classify.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self._poller.start()
        path = scope.get("path", "/")
        if path == self.metrics_path:
            await _answer(send, 200, {"Content-Type": CONTENT_TYPE}, render(self.guard))
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        body: bytes | None = None
        if self._needs_body and scope.get("method") in ("POST", "PUT", "PATCH"):
            body, receive = await _buffer(receive, self._max_body)
            parsed = OVERSIZE if body is None else parse_json(body) if body else None  # None: past the cap
        else:
            parsed = None
        d = await self.guard.acquire_async(RequestInfo(path=path, headers=headers, body=parsed,
                                                       method=scope.get("method", "GET")))
        key = cache_key(scope.get("method", "GET"), path, parsed)
        if not d.admitted:
            if d.reason == "breaker_open" and self.fallback is not None:
                await self.fallback(scope, receive, send)
                return
            cached = self.guard.cache_get(key) if d.degrade == "cached" else None
            if cached is not None:
                await _answer(send, 200, {"Content-Type": cached[1], GUARD_HEADER: "cached"}, cached[0])
                return
            status, h, b = refusal(d)
            await _answer(send, status, h, b)
            return
        if d.degrade == "model" and body is not None:
            body = rewrite_model(body, d.target)
            receive = _replay(body)
        left = d.deadline_s - self.guard.now() if d.deadline_s != _INF else _INF
        if left <= 0 or d.expired:  # resumed from the queue past its deadline (a starved loop): never started
            st = stop(self.guard, d, sent=False, started=False, what=_what(scope))
            await _answer(send, st.status, st.headers, st.body())
            return
        t0 = time.monotonic()
        state: dict[str, Any] = {"status": 500, "ttft": None, "ctype": "", "chunks": [], "size": 0, "started": False,
                                 "framed": False, "ended": False}
        keep = d.degrade == "" and self.guard.cfg.breaker.fallback == "cached"
        cache_bytes = self.guard.cfg.breaker.cache_bytes
        stall_s = self.guard.cfg.breaker.client_stall_s
        # A client that stops reading blocks a body write in the server's flow control. One watchdog timer per
        # request (not an asyncio.timeout per chunk: 4.5 us each) cancels a write pending for stall_s.
        loop = asyncio.get_running_loop()
        clock = loop.time
        since = 0.0  # when the pending body write began (0.0: none pending)
        writer: asyncio.Task | None = None  # the task that writes
        stalled = False
        timer: asyncio.TimerHandle | None = None
        # the class's deadline_s: one timer per request that has one; past it the app is cancelled (_deadline.stop)
        task = asyncio.current_task()
        stopped: Stop | None = None
        end_timer: asyncio.TimerHandle | None = None

        def past_deadline() -> None:
            nonlocal stopped
            if state["ended"]:  # the answer is whole; the app has yet to return
                return
            stopped = stop(self.guard, d, sent=True, started=state["started"], what=_what(scope))
            if task is not None:
                task.cancel()

        def watchdog() -> None:
            nonlocal stalled, timer
            now = clock()
            if since and now - since >= stall_s and writer is not None:
                stalled = True
                writer.cancel()
                return
            timer = loop.call_at((since or now) + stall_s, watchdog)

        async def watched_send(message: Message) -> None:
            nonlocal since, writer, timer
            if message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if state["ttft"] is None and chunk:
                    state["ttft"] = time.monotonic() - t0
                    writer = asyncio.current_task()
                    timer = loop.call_later(stall_s, watchdog)
                if keep and state["size"] <= cache_bytes:
                    state["chunks"].append(chunk)
                    state["size"] += len(chunk)
                if stalled:
                    raise ClientStalled("the client stopped reading")
                if not message.get("more_body", False):
                    state["ended"] = True
                since = clock()
                try:
                    await send(message)
                except asyncio.CancelledError:
                    if stalled and writer is not None:  # the watchdog's cancel: the app sees an OSError
                        writer.uncancel()
                        raise ClientStalled(f"the client read nothing for {stall_s:g} s") from None
                    raise
                finally:
                    since = 0.0
                return
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                state["started"] = True
                for k, v in message.get("headers", []):
                    k = k.lower()
                    if k == b"content-type":
                        state["ctype"] = v.decode("latin-1")
                    elif k == b"content-length":
                        state["framed"] = True
            await send(message)

        if left != _INF:
            end_timer = loop.call_later(left, past_deadline)
        try:
            await self.app(scope, receive, watched_send)
        except BaseException as e:
            if stopped is not None and isinstance(e, asyncio.CancelledError):
                await _end_at_deadline(stopped, state, send, task)
                return
            if stalled:  # the app gave up on the client: the slot is free
                self.guard.release(d, 499, time.monotonic() - t0, ttft_s=state["ttft"])
                return
            self.guard.release(d, 500, time.monotonic() - t0, ttft_s=state["ttft"])
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if end_timer is not None:
                end_timer.cancel()
        if stopped is not None:  # the app caught the cancel and returned: the answer still ends at the deadline
            await _end_at_deadline(stopped, state, send, task)
            return
        # An app that caught ClientStalled and returned: still the client's doing, not a 200 of 30 s
        status = 499 if stalled else state["status"]
        self.guard.release(d, status, time.monotonic() - t0, ttft_s=state["ttft"])
        if keep and state["status"] == 200 and state["size"] <= cache_bytes:
            self.guard.cache_put(key, b"".join(state["chunks"]), state["ctype"] or "application/json")


def _what(scope: Scope) -> str:
    return f"{scope.get('method', 'GET')} {scope.get('path', '/')}"


async def _end_at_deadline(st: Stop, state: dict[str, Any], send: Send, task: asyncio.Task | None) -> None:
    """The app was cancelled at the request's deadline: a 504 if no answer began (never a second head), else the
    answer ends: cleanly when the server frames it itself (chunked, or to the close for HTTP/1.0); one framed by
    its Content-Length is left incomplete, which the server ends by closing the connection (uvicorn logs that
    the app returned without completing its answer): a clean end would say it is whole."""
    if task is not None and task.cancelling():
        task.uncancel()
    if state["ended"]:
        return
    if not state["started"]:
        await _answer(send, st.status or 504, st.headers, st.body())
    elif not state["framed"]:
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _buffer(receive: Receive, max_bytes: int) -> tuple[bytes | None, Receive]:
    """Read the request body and return it with a receive that replays it. Past max_bytes the guard gives
    up on reading it (None: no token estimate) and the app gets what was read, then the rest as it comes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return b"".join(chunks), _replay(b"".join(chunks), [msg], receive)
        chunks.append(msg.get("body", b""))
        size += len(chunks[-1])
        if not msg.get("more_body", False):
            return b"".join(chunks), _replay(b"".join(chunks), [], receive)
        if size > max_bytes:
            return None, _replay(b"".join(chunks), [], receive, more_body=True)


def _replay(body: bytes, pending: list[Message] | None = None, receive: Receive | None = None,
            more_body: bool = False) -> Receive:
    sent = False
    queue = list(pending or [])

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more_body}
        if queue:
            return queue.pop(0)
        if receive is not None:
            return await receive()
        return {"type": "http.disconnect"}
    return replay


async def _answer(send: Send, status: int, headers: dict[str, str], body: bytes) -> None:
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
