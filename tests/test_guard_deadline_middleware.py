"""The ASGI and aiohttp middlewares stop a request at its class's deadline_s as the proxy does (the decision is
the guard's, `_deadline.stop`): a handler still running is cancelled and answered 504; a streamed answer ends
there (its last chunk, the connection still usable), one framed by its length is cut; a request that resumes
from the queue past its deadline is answered 503 without calling the app. Real servers on loopback (uvicorn for
the ASGI app, aiohttp's own), a raw socket as the client. Asserted is what was recorded: the bytes the client
got, whether the handler saw its cancellation, the guard's counters and /guard/metrics; the handlers' delays
only decide what happens when the middleware fails to act, and no assertion is on how long anything took.

The queued case needs the deadline to pass between the admission from the queue and the request's resumption
(on a starved event loop): the guard's clock is injected, and the request holding the only slot moves it past
the deadline just after its release dispatched the waiter, before the waiter runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import StreamingResponse

from gpuscope.guard import Guard, parse_config
from gpuscope.guard.aio import attach
from gpuscope.guard.asgi import GuardMiddleware

LATE_S = 3.0  # how long a slow handler takes when nobody stops it
BOUND_S = 20.0  # a bound against a hung test, never a timing assertion
CFG: dict[str, Any] = {
    "classes": [{"name": "interactive", "share": 0.8, "deadline_s": 0.5, "queue_timeout_s": 30},
                {"name": "batch", "share": 0.2, "queue_timeout_s": 30}],
    "classify": {"header": "x-priority", "default": "interactive"},
    "controller": {"mode": "aimd", "min_limit": 1, "initial_limit": 10, "max_limit": 10, "backoff_ratio": 0.5},
    "breaker": {"min_requests": 1000}}
# one slot, so that a request waits in the queue behind the one holding it
ONE_SLOT = {**CFG, "controller": {"mode": "fixed", "min_limit": 1, "initial_limit": 1, "max_limit": 1}}
NONE = {"not_sent": 0, "no_answer": 0, "mid_answer": 0}


class Clock:
    """The guard's clock: monotonic, plus what `jump` added."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def jump(self) -> None:
        self.offset += 10.0


class Handlers:
    """What the apps' handlers saw: the paths whose handler was cancelled; `hold` releases /hold."""

    def __init__(self, clock: Clock) -> None:
        self.cancelled: list[str] = []
        self.hold = threading.Event()
        self.clock = clock

    async def late(self, path: str) -> None:
        try:
            await asyncio.sleep(LATE_S)
        except asyncio.CancelledError:
            self.cancelled.append(path)
            raise

    async def held(self) -> None:
        while not self.hold.is_set():
            await asyncio.sleep(0.01)

    def after_release(self) -> None:
        # runs after this request's release has dispatched the waiter and before the waiter resumes
        asyncio.get_running_loop().call_soon(self.clock.jump)


# ---- the ASGI app under uvicorn ------------------------------------------------------------------------------
def _asgi_app(h: Handlers):
    async def app(scope, receive, send) -> None:
        path = scope["path"]
        if path == "/chunked":  # a Starlette StreamingResponse, as FastAPI and vLLM stream
            async def chunks():
                yield b"data: first\n\n"
                await h.late(path)
                yield b"data: second\n\n"
            await StreamingResponse(chunks(), media_type="text/event-stream")(scope, receive, send)
            return
        if path == "/framed":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain"), (b"content-length", b"100")]})
            await send({"type": "http.response.body", "body": b"first-bytes", "more_body": True})
            await h.late(path)
            await send({"type": "http.response.body", "body": b"x" * 89})
            return
        if path.startswith("/slow"):
            await h.late(path)
        elif path == "/hold":
            await h.held()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        if path == "/hold":
            h.after_release()
    return app


@contextlib.contextmanager
def _uvicorn(app) -> Iterator[int]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    end = time.monotonic() + BOUND_S
    while not server.started:
        assert time.monotonic() < end, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        t.join(10)


def _asgi(cfg: dict) -> tuple[Guard, Handlers, Any]:
    clock = Clock()
    guard = Guard(parse_config(cfg), clock=clock)
    h = Handlers(clock)
    return guard, h, GuardMiddleware(_asgi_app(h), guard=guard)


# ---- the aiohttp app -----------------------------------------------------------------------------------------
def _aiohttp_app(h: Handlers, guard: Guard) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        path = request.path
        if path in ("/chunked", "/framed"):
            resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
            if path == "/chunked":
                resp.enable_chunked_encoding()
            else:
                resp.content_length = 100
            await resp.prepare(request)
            await resp.write(b"data: first\n\n" if path == "/chunked" else b"first-bytes")
            await h.late(path)
            await resp.write(b"x" * 89)
            return resp
        if path.startswith("/slow"):
            await h.late(path)
        elif path == "/hold":
            await h.held()
            h.after_release()
        return web.Response(text="ok")

    app = web.Application()
    for p in ("/chunked", "/framed", "/slow", "/slow0", "/slow1", "/slow2", "/hold", "/fast", "/queued"):
        app.router.add_get(p, handle)
    attach(app, guard)
    return app


@contextlib.asynccontextmanager
async def _aiohttp(cfg: dict):
    clock = Clock()
    guard = Guard(parse_config(cfg), clock=clock)
    h = Handlers(clock)
    runner = web.AppRunner(_aiohttp_app(h, guard), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield guard, h, runner.addresses[0][1]
    finally:
        await runner.cleanup()


# ---- the client ----------------------------------------------------------------------------------------------
def _get(path: str, extra: str = "Connection: close\r\n") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: guard\r\n{extra}\r\n".encode()


async def _send(port: int, raw: bytes) -> bytes:
    """One request; everything until the server closes the connection."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(raw)
        await w.drain()
        return await asyncio.wait_for(r.read(), BOUND_S)
    finally:
        w.close()


async def _chunked_then_next(port: int) -> tuple[bytes, bytes, bytes]:
    """/chunked on a kept-alive connection, read to its last chunk, then /fast on the same connection."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(_get("/chunked", ""))
        await w.drain()
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), BOUND_S)
        body = b""
        while not body.endswith(b"0\r\n\r\n"):
            chunk = await asyncio.wait_for(r.read(65536), BOUND_S)
            assert chunk, f"the connection closed instead of the answer ending: {body!r}"
            body += chunk
        w.write(_get("/fast"))
        await w.drain()
        return head, body, await asyncio.wait_for(r.read(), BOUND_S)
    finally:
        w.close()


async def _queued(port: int, guard: Guard, h: Handlers) -> tuple[bytes, bytes]:
    """/hold (batch, no deadline) takes the only slot; /queued (interactive) waits in the queue behind it."""
    hold = asyncio.ensure_future(_send(port, _get("/hold", "Connection: close\r\nx-priority: batch\r\n")))
    end = time.monotonic() + BOUND_S
    while guard.inflight_total < 1:
        assert time.monotonic() < end
        await asyncio.sleep(0.01)
    queued = asyncio.ensure_future(_send(port, _get("/queued")))
    while guard.queued_total < 1:
        assert time.monotonic() < end
        await asyncio.sleep(0.01)
    h.hold.set()
    return await hold, await queued


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def _head(raw: bytes) -> bytes:
    return raw.partition(b"\r\n\r\n")[0].lower()


def _body_json(raw: bytes) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        size, _, rest = body.partition(b"\r\n")
        body = rest[:int(size, 16)]
    return json.loads(body)


def _shown(port: int, reason: str) -> float:
    raw = asyncio.run(_send(port, _get("/guard/metrics")))
    text = raw.partition(b"\r\n\r\n")[2].decode()
    for f in text_string_to_metric_families(text):
        if f.name == "gpuscope_guard_proxy_deadline":
            return next(s.value for s in f.samples if s.labels.get("reason") == reason)
    raise AssertionError("no gpuscope_guard_proxy_deadline_total on /guard/metrics")


def _check_504(raw: bytes) -> None:
    assert _status(raw) == 504 and b"x-gpuscope-guard: deadline" in _head(raw)
    err = _body_json(raw)["error"]
    assert err["code"] == 504 and err["type"] == "deadline"
    assert "did not answer within the interactive class's deadline_s of 0.5 s" in err["message"]


def _check_503(raw: bytes) -> None:
    assert _status(raw) == 503 and b"x-gpuscope-guard: deadline" in _head(raw) and b"retry-after: " in _head(raw)
    msg = _body_json(raw)["error"]["message"]
    assert "waited its interactive class's deadline_s of 0.5 s" in msg and "was not sent" in msg


# ---- ASGI ----------------------------------------------------------------------------------------------------
def test_asgi_a_handler_running_at_the_deadline_is_cancelled_and_answered_504():
    guard, h, app = _asgi(CFG)
    with _uvicorn(app) as port:
        async def scenario():
            return await asyncio.gather(*(_send(port, _get(f"/slow{i}")) for i in range(3)))
        got = asyncio.run(scenario())
        shown = _shown(port, "no_answer")
        after = asyncio.run(_send(port, _get("/fast")))
    for raw in got:
        _check_504(raw)
    assert sorted(h.cancelled) == ["/slow0", "/slow1", "/slow2"]  # the handlers were stopped, not left running
    assert guard.deadline_total == {**NONE, "no_answer": 3} and shown == 3
    assert guard.expired_total == [3, 0] and guard.inflight_total == 0
    assert guard.limiter.limit < 10  # each a drop for the limiter (AIMD: x0.5 a drop)
    assert _status(after) == 200


def test_asgi_a_streamed_answer_at_the_deadline_ends_cleanly_there():
    guard, h, app = _asgi(CFG)
    with _uvicorn(app) as port:
        head, body, again = asyncio.run(_chunked_then_next(port))
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    assert body == b"d\r\ndata: first\n\n\r\n0\r\n\r\n"  # what came before the deadline, then the last chunk
    assert _status(again) == 200 and again.endswith(b"ok")  # the same connection serves the next request
    assert h.cancelled == ["/chunked"]
    assert guard.deadline_total == {**NONE, "mid_answer": 1} and guard.inflight_total == 0


def test_asgi_an_answer_framed_by_its_length_at_the_deadline_is_cut():
    guard, h, app = _asgi(CFG)
    with _uvicorn(app) as port:
        got = asyncio.run(_send(port, _get("/framed", "")))  # keep-alive: only a cut ends this read
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"first-bytes")  # 11 of 100 bytes, then the close
    assert h.cancelled == ["/framed"] and guard.deadline_total == {**NONE, "mid_answer": 1}


def test_asgi_a_request_resumed_from_the_queue_past_its_deadline_is_answered_503_unsent():
    guard, h, app = _asgi(ONE_SLOT)
    with _uvicorn(app) as port:
        hold, queued = asyncio.run(_queued(port, guard, h))
    assert _status(hold) == 200
    _check_503(queued)
    assert guard.deadline_total == {**NONE, "not_sent": 1}
    assert guard.queued_count_total == [1, 0] and guard.expired_total == [1, 0] and guard.inflight_total == 0


def test_asgi_a_class_without_a_deadline_is_not_stopped():
    guard, h, app = _asgi(CFG)
    with _uvicorn(app) as port:
        got = asyncio.run(_send(port, _get("/slow", "Connection: close\r\nx-priority: batch\r\n")))
    assert _status(got) == 200 and h.cancelled == [] and guard.deadline_total == NONE


# ---- aiohttp -------------------------------------------------------------------------------------------------
def test_aiohttp_a_handler_running_at_the_deadline_is_cancelled_and_answered_504():
    async def scenario():
        async with _aiohttp(CFG) as (guard, h, port):
            got = await asyncio.gather(*(_send(port, _get(f"/slow{i}")) for i in range(3)))
            after = await _send(port, _get("/fast"))
            metrics = (await _send(port, _get("/guard/metrics"))).partition(b"\r\n\r\n")[2].decode()
            return guard, h, got, after, metrics

    guard, h, got, after, metrics = asyncio.run(scenario())
    for raw in got:
        _check_504(raw)
    assert sorted(h.cancelled) == ["/slow0", "/slow1", "/slow2"]
    assert guard.deadline_total == {**NONE, "no_answer": 3}
    assert 'gpuscope_guard_proxy_deadline_total{reason="no_answer"} 3' in metrics
    assert guard.expired_total == [3, 0] and guard.inflight_total == 0 and guard.limiter.limit < 10
    assert _status(after) == 200


def test_aiohttp_a_streamed_answer_at_the_deadline_ends_cleanly_there():
    async def scenario():
        async with _aiohttp(CFG) as (guard, h, port):
            return guard, h, await _chunked_then_next(port)

    guard, h, (head, body, again) = asyncio.run(scenario())
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    assert body == b"d\r\ndata: first\n\n\r\n0\r\n\r\n"
    assert _status(again) == 200 and again.endswith(b"ok")
    assert h.cancelled == ["/chunked"]
    assert guard.deadline_total == {**NONE, "mid_answer": 1} and guard.inflight_total == 0


def test_aiohttp_an_answer_framed_by_its_length_at_the_deadline_is_cut():
    async def scenario():
        async with _aiohttp(CFG) as (guard, h, port):
            return guard, h, await _send(port, _get("/framed", ""))

    guard, h, got = asyncio.run(scenario())
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"first-bytes")
    assert h.cancelled == ["/framed"] and guard.deadline_total == {**NONE, "mid_answer": 1}


def test_aiohttp_a_request_resumed_from_the_queue_past_its_deadline_is_answered_503_unsent():
    async def scenario():
        async with _aiohttp(ONE_SLOT) as (guard, h, port):
            return guard, await _queued(port, guard, h)

    guard, (hold, queued) = asyncio.run(scenario())
    assert _status(hold) == 200
    _check_503(queued)
    assert guard.deadline_total == {**NONE, "not_sent": 1}
    assert guard.queued_count_total == [1, 0] and guard.expired_total == [1, 0] and guard.inflight_total == 0
