"""`gpuscope guard proxy`: an aiohttp reverse proxy with the guard in front of any HTTP service.

Every request (any method, any path) is decided; admitted ones are forwarded to the upstream with their
body and headers (hop-by-hop headers dropped) and the answer is streamed back chunk by chunk as it comes,
so server-sent events reach the client token by token. Latency is measured to the last byte, TTFT to
the first. An upstream that does not send its response headers within `breaker.timeout_s` gives 504, one
that cannot be reached 502; both count for the circuit breaker. Once the answer streams, only the gap
between two chunks is timed (`breaker.idle_timeout_s`), so a long generation is never cut off for its
length; a stalled one is cut (the client sees a truncated answer) and counts as a timeout. A client that
stops reading is cut once one write to it has waited `breaker.client_stall_s`, so it cannot hold its
concurrency slot for ever; that is not the upstream's fault and does not count for the breaker. The guard's
metrics are at /guard/metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from ._classify import OVERSIZE, RequestInfo
from ._core import Guard
from ._http import GUARD_HEADER, cache_key, needs_body, parse_json, refusal, rewrite_model
from ._metrics import CONTENT_TYPE, render
from ._signals import SignalPoller

__all__ = ["error_body", "make_app"]

log = logging.getLogger("gpuscope.guard")

_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "trailers", "transfer-encoding", "upgrade", "host", "content-length"})


def error_body(status: int, message: str) -> bytes:
    """The proxy's own errors in the OpenAI form: {"error": {"message": sentence, "type": "proxy_error"}}
    (also the kit's 408, 414, 431 and 503 answers: gpuscope.http.serve)."""
    return json.dumps({"error": {"message": message, "type": "proxy_error", "code": status}}).encode()


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=error_body(status, message), content_type="application/json",
                        headers={GUARD_HEADER: "proxy_error"})


async def _read_at_most(content: aiohttp.StreamReader, max_bytes: int) -> bytes:
    """The body if it is at most max_bytes long, else its first max_bytes + 1 bytes (the rest stays unread)."""
    buf = bytearray()
    while len(buf) <= max_bytes:
        chunk = await content.read(max_bytes + 1 - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


async def _chain(prefix: bytes, content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    yield prefix
    async for chunk in content.iter_any():
        yield chunk


def _cut(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """End a half-sent answer by closing the client's connection: a clean end of the body would tell the
    client that a truncated answer is whole."""
    if request.transport is not None:
        request.transport.close()
    return resp


class _Proxy:
    def __init__(self, guard: Guard, upstream: str) -> None:
        self.guard = guard
        self.upstream = upstream.rstrip("/")
        self.session: aiohttp.ClientSession | None = None
        self.poller = SignalPoller(guard)
        self._needs_body = needs_body(guard)
        self._max_body = guard.cfg.classify.max_body_bytes
        self._keep = guard.cfg.breaker.fallback == "cached"

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=10))
        self.poller.start()

    async def stop(self, app: web.Application) -> None:
        await self.poller.stop()
        if self.session is not None:
            await self.session.close()
        aclose = getattr(self.guard.buckets, "aclose", None)
        if aclose is not None:
            await aclose()

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=render(self.guard), headers={"Content-Type": CONTENT_TYPE})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        g = self.guard
        # The body is read before the decision only when the decision needs it, and only up to
        # classify.max_body_bytes (as the ASGI middleware does); any other body streams to the upstream as it comes,
        # so a flood of large uploads holds no more than the socket buffers per client.
        body: bytes | None = None
        parsed = None
        prefix = b""  # what was read of a body found too large: sent ahead of the rest
        if self._needs_body and request.body_exists and (request.content_length or 0) <= self._max_body:
            prefix = await _read_at_most(request.content, self._max_body)
            if len(prefix) <= self._max_body:  # the whole body (a chunked one may be any size until read)
                body, prefix = prefix, b""
                parsed = parse_json(body)
            else:
                parsed = OVERSIZE
        elif self._needs_body and request.body_exists:
            parsed = OVERSIZE  # declared too large to read: charged as the burst, streamed unread
        headers = {k.lower(): v for k, v in request.headers.items()}
        d = await g.acquire_async(RequestInfo(path=request.path, headers=headers, body=parsed, method=request.method))
        key = cache_key(request.method, request.path, parsed)
        if not d.admitted:
            cached = g.cache_get(key) if d.degrade == "cached" else None
            if cached is not None:
                return web.Response(body=cached[0], headers={"Content-Type": cached[1], GUARD_HEADER: "cached"})
            status, h, b = refusal(d)
            return web.Response(status=status, body=b, headers=h)
        upstream = d.target.rstrip("/") if d.degrade == "upstream" else self.upstream
        fwd = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        data: Any = body or None
        if body is None and request.body_exists:
            # unread or read in part: streamed through (a body too large to read is not rewritten)
            data = _chain(prefix, request.content) if prefix else request.content
            if request.content_length is not None:
                fwd["Content-Length"] = str(request.content_length)
        elif body is not None and d.degrade == "model":
            data = rewrite_model(body, d.target)
        assert self.session is not None
        t0 = time.monotonic()
        ttft = None
        resp: web.StreamResponse | None = None
        status = 502
        timed_out = False
        writing = False
        kept: list[bytes] = []
        size = 0
        br = g.cfg.breaker
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(br.timeout_s) as deadline:
                async with self.session.request(request.method, upstream + request.path_qs, data=data,
                                                headers=fwd, allow_redirects=False) as r:
                    deadline.reschedule(None)  # the headers are in; from here only upstream reads are timed
                    status = r.status
                    resp = web.StreamResponse(status=r.status, reason=r.reason, headers={
                        k: v for k, v in r.headers.items() if k.lower() not in _HOP})
                    if r.content_length is not None and "Content-Encoding" not in r.headers:
                        resp.content_length = r.content_length
                    await resp.prepare(request)
                    chunks = r.content.iter_any().__aiter__()
                    while True:
                        deadline.reschedule(loop.time() + br.idle_timeout_s)
                        try:
                            chunk = await anext(chunks)
                        except StopAsyncIteration:
                            break
                        if ttft is None:
                            ttft = time.monotonic() - t0
                        # A slow client is not the upstream's fault, but one that stops reading must not
                        # hold its slot for ever: each write to it has client_stall_s.
                        deadline.reschedule(loop.time() + br.client_stall_s)
                        writing = True
                        await resp.write(chunk)
                        writing = False
                        if self._keep and size <= br.cache_bytes:
                            kept.append(chunk)
                            size += len(chunk)
                    deadline.reschedule(loop.time() + br.client_stall_s)  # write_eof drains to the client too
                    writing = True
                    await resp.write_eof()
                    writing = False
            if self._keep and status == 200 and size <= br.cache_bytes and d.degrade == "":
                g.cache_put(key, b"".join(kept), r.headers.get("Content-Type", "application/json"))
            return resp
        except TimeoutError:
            if writing:
                status = 499  # the client stopped reading: its slot is freed, and the upstream is not to blame
                log.warning("gpuscope guard: a client read nothing for %g s; cut off %s %s and freed its slot",
                            br.client_stall_s, request.method, request.path)
                # abort, not close: close() waits to flush what the client will never read
                if request.transport is not None:
                    request.transport.abort()
                return resp if resp is not None else _error(499, "The client stopped reading.")
            status, timed_out = 504, True
            if resp is None:
                return _error(504, f"The upstream {upstream} did not answer within {br.timeout_s:g} s.")
            log.warning("gpuscope guard: the upstream %s sent nothing for %g s mid-answer; cut off %s %s",
                        upstream, br.idle_timeout_s, request.method, request.path)
            return _cut(request, resp)
        except aiohttp.ClientError as e:
            status = 502
            if resp is None:
                return _error(502, f"The upstream {upstream} cannot be reached: {type(e).__name__}.")
            return _cut(request, resp)  # the upstream broke off mid-stream
        except ConnectionResetError:
            status = 499  # the client went away; not the upstream's fault
            return resp if resp is not None else _error(499, "The client went away.")
        finally:
            g.release(d, status, time.monotonic() - t0, timed_out=timed_out, ttft_s=ttft)


def make_app(guard: Guard, upstream: str) -> web.Application:
    """The proxy as an aiohttp application (serve it with web.run_app or an AppRunner)."""
    p = _Proxy(guard, upstream)
    app = web.Application(client_max_size=guard.cfg.classify.max_body_bytes)  # only what is read is capped
    app.router.add_get("/guard/metrics", p.metrics)
    app.router.add_route("*", "/{tail:.*}", p.handle)
    app.on_startup.append(p.start)
    app.on_cleanup.append(p.stop)
    return app
