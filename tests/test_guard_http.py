"""The guard in real HTTP servers on loopback: ASGI middleware in a Starlette app served by uvicorn, the
aiohttp middleware in an aiohttp app, and the proxy in front of a real aiohttp upstream (SSE streamed)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import aiohttp
import pytest
import uvicorn
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from gpuscope.guard import Guard, parse_config
from gpuscope.guard.aio import DECISION_KEY, attach
from gpuscope.guard.asgi import GuardMiddleware
from gpuscope.guard.proxy import ProxyServer, serve

CFG = {"classes": [{"name": "interactive", "share": 0.9}, {"name": "batch", "share": 0.1, "rate": 0.5, "burst": 2}],
       "classify": {"cost": "request", "routes": {"/v1/embeddings": "batch"}, "default": "interactive"},
       "breaker": {"min_requests": 3, "failure_rate": 0.5, "open_s": 60, "fallback": "model:small"}}


def _samples(text: str, family: str) -> dict:
    for f in text_string_to_metric_families(text):
        if f.name == family:
            return {tuple(sorted(s.labels.items())): s.value for s in f.samples}
    return {}


# ---- Starlette + uvicorn --------------------------------------------------------------------------------
async def _echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"path": request.url.path, "body": json.loads(body) if body else None})


async def _length(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"bytes": len(body), "tail": body[-8:].decode()})


async def _boom(request: Request) -> JSONResponse:
    return JSONResponse({"error": "upstream broke"}, status_code=500)


@contextlib.contextmanager
def _uvicorn(app: Starlette) -> Iterator[str]:
    """The app served by a real uvicorn on a loopback port, in a thread; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(10)


@pytest.fixture
def starlette_url() -> Iterator[tuple[str, Guard]]:
    guard = Guard(parse_config(CFG))
    app = Starlette(routes=[Route("/v1/chat/completions", _echo, methods=["POST"]),
                            Route("/v1/embeddings", _echo, methods=["POST"]),
                            Route("/v1/length", _length, methods=["POST"]),
                            Route("/boom", _boom, methods=["GET", "POST"])])
    app.add_middleware(GuardMiddleware, guard=guard)
    with _uvicorn(app) as url:
        yield url, guard


# ---- a client that stops reading ------------------------------------------------------------------------
# One failure opens the breaker, and a 200 slower than 0.2 s would be one (slo): a stalled client must be neither.
STALL_CFG = {**CFG, "breaker": {"client_stall_s": 0.3, "min_requests": 1, "failure_rate": 0.1,
                                "failures": ["5xx", "timeout", "slo"], "slo_s": 0.2}}


def _stalled_client(url: str, path: str) -> socket.socket:
    """A client that sends one GET and then reads nothing (a small receive buffer, so the server's fills)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return s


def _closed_by_server(s: socket.socket) -> bool:
    """Read what the server had sent; True when it then closed the connection (not left it open)."""
    s.settimeout(10)
    deadline = time.monotonic() + 10  # a bound against an endless answer, not a timing assertion
    try:
        while time.monotonic() < deadline:
            if not s.recv(1 << 16):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


async def _until(cond: Callable[[], bool], limit_s: float = 20.0) -> bool:
    deadline = time.monotonic() + limit_s  # a bound against hanging, not a timing assertion
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def _endless_starlette(request: Request) -> StreamingResponse:
    async def chunks():
        while True:
            yield b"x" * 65536
            await asyncio.sleep(0)  # as a real generator does: uvicorn's send after a disconnect never blocks

    return StreamingResponse(chunks(), media_type="application/octet-stream")


async def _swallowing_app(scope, receive, send) -> None:
    """A hand-written streaming app that takes a failed send for a gone client and returns normally."""
    if scope["type"] != "http":
        return
    if scope["path"] != "/endless":
        await _echo_app(scope, receive, send)
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    try:
        while True:
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            await asyncio.sleep(0)
    except OSError:
        return


_echo_app = Starlette(routes=[Route("/v1/embeddings", _echo, methods=["POST"])])


def _starlette_endless() -> Starlette:
    return Starlette(routes=[Route("/endless", _endless_starlette), Route("/v1/embeddings", _echo, methods=["POST"])])


@pytest.mark.parametrize("make_app_", [_starlette_endless, lambda: _swallowing_app], ids=["starlette", "swallows"])
def test_asgi_middleware_frees_the_slot_of_a_client_that_stops_reading(make_app_):
    guard = Guard(parse_config(STALL_CFG))
    app = GuardMiddleware(make_app_(), guard=guard)
    with _uvicorn(app) as url:
        s = _stalled_client(url, "/endless")
        try:
            freed = asyncio.run(_until(lambda: sum(guard.admitted_total) == 1 and guard.inflight_total == 0))
            closed = _closed_by_server(s)
        finally:
            s.close()

        async def after():
            async with aiohttp.ClientSession() as session:
                return await _post(session, url + "/v1/embeddings", {"input": "x"})

        status = asyncio.run(after())[0]
    assert freed  # without client_stall_s the slot stays taken for as long as the connection lives
    assert closed  # by uvicorn, once what it had buffered was read
    assert guard.breaker.state == "closed"  # a client's stall is no failure of the service (no 200 of 0.3 s)
    assert status == 200


async def _post(session: aiohttp.ClientSession, url: str, body: dict | None = None,
                headers: dict | None = None) -> tuple[int, dict, dict]:
    async with session.post(url, json=body, headers=headers or {}) as r:
        text = await r.text()
        try:
            return r.status, dict(r.headers), json.loads(text) if text else {}
        except ValueError:
            return r.status, dict(r.headers), {"text": text}


def test_asgi_middleware_in_starlette_under_uvicorn(starlette_url):
    url, guard = starlette_url

    async def scenario():
        async with aiohttp.ClientSession() as s:
            body = {"model": "big", "messages": [{"role": "user", "content": "hello" * 80}], "max_tokens": 10}
            ok = await _post(s, url + "/v1/chat/completions", body)
            batch = [await _post(s, url + "/v1/embeddings", {"input": "x"}) for _ in range(3)]
            boom = [await _post(s, url + "/boom") for _ in range(3)]
            rerouted = await _post(s, url + "/v1/chat/completions", body)
            async with s.get(url + "/guard/metrics") as r:
                metrics = await r.text()
        return ok, batch, boom, rerouted, metrics

    ok, batch, boom, rerouted, metrics = asyncio.run(scenario())
    assert ok[0] == 200 and ok[2]["body"]["messages"][0]["content"] == "hello" * 80  # the body reached the app
    assert [b[0] for b in batch] == [200, 200, 429]  # batch's burst of 2, then its rate
    status, headers, err = batch[2]
    assert headers["Retry-After"] == "2" and err["error"]["code"] == "rate" and err["error"]["class"] == "batch"
    assert [b[0] for b in boom] == [500, 500, 500]
    assert guard.breaker.state == "open"
    assert rerouted[0] == 200 and rerouted[2]["body"]["model"] == "small"  # the cheaper model route
    admitted = _samples(metrics, "gpuscope_guard_admitted")
    assert admitted[(("class", "batch"),)] == 2
    assert _samples(metrics, "gpuscope_guard_shed")[(("class", "batch"), ("reason", "rate"))] == 1


def test_asgi_middleware_passes_a_body_nested_too_deep_to_parse(starlette_url):
    url, _ = starlette_url  # the model: fallback makes the middleware parse bodies
    body = b"[" * 100_000 + b"]" * 100_000  # json.loads raises RecursionError, not ValueError

    async def scenario():
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/length", data=body) as r:
            return r.status, await r.json()

    assert asyncio.run(scenario()) == (200, {"bytes": len(body), "tail": "]" * 8})


def test_asgi_middleware_passes_a_body_larger_than_it_reads(starlette_url):
    url, _ = starlette_url
    body = b"x" * (3 << 20) + b"the-end!"  # over classify.max_body_bytes (1 MiB): not parsed, passed on whole

    async def scenario():
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/length", data=body) as r:
            return r.status, await r.json()

    assert asyncio.run(scenario()) == (200, {"bytes": len(body), "tail": "the-end!"})


# ---- aiohttp middleware -----------------------------------------------------------------------------------
async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.filterwarnings("error::aiohttp.web_exceptions.NotAppKeyWarning")
def test_aiohttp_middleware():
    async def scenario():
        guard = Guard(parse_config({**CFG, "breaker": {"min_requests": 2, "failure_rate": 0.5, "open_s": 60}}))
        app = web.Application()

        async def chat(request: web.Request) -> web.Response:
            d = request[DECISION_KEY]  # typed: no NotAppKeyWarning
            return web.json_response({"class": d.klass, "body": await request.json()})

        async def fail(request: web.Request) -> web.Response:
            raise web.HTTPServiceUnavailable()

        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_post("/v1/embeddings", chat)
        app.router.add_get("/fail", fail)
        attach(app, guard)
        runner, url = await _serve(app)
        try:
            async with aiohttp.ClientSession() as s:
                ok = await _post(s, url + "/v1/chat/completions", {"x": 1}, {"x-priority": "batch"})
                batch = [await _post(s, url + "/v1/embeddings", {"x": 2}) for _ in range(2)]
                fails = []
                for _ in range(3):
                    async with s.get(url + "/fail") as r:
                        fails.append((r.status, r.headers.get("x-gpuscope-guard")))
                async with s.get(url + "/guard/metrics") as r:
                    metrics = await r.text()
        finally:
            await runner.cleanup()
        return ok, batch, fails, metrics

    ok, batch, fails, metrics = asyncio.run(scenario())
    assert ok[0] == 200 and ok[2] == {"class": "batch", "body": {"x": 1}}
    assert [b[0] for b in batch] == [200, 429]  # the header's request spent one of batch's two
    assert fails == [(503, None), (503, None), (503, "breaker_open")]  # the third never reached the handler
    assert _samples(metrics, "gpuscope_guard_breaker_state")[(("state", "open"),)] == 1


# ---- the proxy in front of a real upstream ------------------------------------------------------------------
async def _proxy(guard: Guard, upstream: str) -> tuple[ProxyServer, str]:
    px = await serve(guard, upstream)
    return px, px.url


def test_proxy_streams_sse_and_guards_the_upstream():
    async def scenario():
        go_on = asyncio.Event()

        async def stream(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(f"data: {json.dumps({'model': body.get('model'), 'n': 1})}\n\n".encode())
            await asyncio.wait_for(go_on.wait(), 10)  # only after the client saw event 1 through the proxy
            await resp.write(b"data: {\"n\": 2}\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp

        upstream_app = web.Application()
        upstream_app.router.add_post("/v1/completions", stream)
        up_runner, up_url = await _serve(upstream_app)
        guard = Guard(parse_config(CFG))
        px, px_url = await _proxy(guard, up_url)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(px_url + "/v1/completions", json={"model": "big", "stream": True}) as r:
                    status, ctype = r.status, r.headers["Content-Type"]
                    first = await r.content.readuntil(b"\n\n")
                    go_on.set()
                    rest = await r.read()
                batch = [await _post(s, px_url + "/v1/embeddings", {}) for _ in range(3)]
                async with s.get(px_url + "/guard/metrics") as r:
                    metrics = await r.text()
        finally:
            await px.close(grace_s=1)
            await up_runner.cleanup()
        return status, ctype, first, rest, batch, metrics

    status, ctype, first, rest, batch, metrics = asyncio.run(scenario())
    assert status == 200 and ctype.startswith("text/event-stream")
    assert json.loads(first[len(b"data: "):]) == {"model": "big", "n": 1}
    assert rest.endswith(b"data: [DONE]\n\n")
    assert [b[0] for b in batch] == [404, 404, 429]  # the upstream has no such route; the guard's rate still holds
    assert batch[2][1]["Retry-After"] == "2"
    assert _samples(metrics, "gpuscope_guard_admitted")[(("class", "interactive"),)] == 1


def test_proxy_upstream_down_gives_502_then_the_breaker_opens_and_cached_answers_serve():
    async def scenario():
        async def ok(request: web.Request) -> web.Response:
            return web.json_response({"answer": 42})

        upstream_app = web.Application()
        upstream_app.router.add_post("/v1/chat/completions", ok)
        up_runner, up_url = await _serve(upstream_app)
        cfg = {**CFG, "breaker": {"min_requests": 2, "failure_rate": 0.5, "open_s": 60, "fallback": "cached"}}
        guard = Guard(parse_config(cfg))
        px, px_url = await _proxy(guard, up_url)
        out = []
        try:
            async with aiohttp.ClientSession() as s:
                out.append(await _post(s, px_url + "/v1/chat/completions", {"model": "m"}))
                await up_runner.cleanup()  # the upstream goes away
                out.append(await _post(s, px_url + "/v1/chat/completions", {"model": "m"}))  # 1 of 2 failed: open
                out.append(await _post(s, px_url + "/v1/chat/completions", {"model": "m"}))  # open: cached
                out.append(await _post(s, px_url + "/v1/chat/completions", {"model": "other"}))  # open: nothing cached
        finally:
            await px.close(grace_s=1)
        return out

    out = asyncio.run(scenario())
    assert out[0][0] == 200 and out[0][2] == {"answer": 42}
    assert out[1][0] == 502 and "cannot be reached" in out[1][2]["error"]["message"]
    assert out[2][0] == 200 and out[2][2] == {"answer": 42} and out[2][1]["x-gpuscope-guard"] == "cached"
    assert out[3][0] == 503 and out[3][2]["error"]["code"] == "breaker_open"


def test_proxy_timeout_gives_504():
    async def scenario():
        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(5)
            return web.json_response({})

        upstream_app = web.Application()
        upstream_app.router.add_get("/slow", slow)
        up_runner, up_url = await _serve(upstream_app)
        guard = Guard(parse_config({**CFG, "breaker": {"timeout_s": 0.05}}))
        px, px_url = await _proxy(guard, up_url)
        try:
            async with aiohttp.ClientSession() as s, s.get(px_url + "/slow") as r:
                return r.status, await r.json()
        finally:
            await px.close(grace_s=1)
            await up_runner.cleanup()

    status, body = asyncio.run(scenario())
    assert status == 504 and "did not answer within 0.05 s" in body["error"]["message"]


def test_proxy_times_the_first_byte_and_the_gaps_not_the_whole_stream():
    async def scenario():
        async def tokens(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(15):  # 1.5 s in all: longer than timeout_s, each gap far under idle_timeout_s
                await resp.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(0.1)
            await resp.write_eof()
            return resp

        async def stall(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: 0\n\n")
            await asyncio.sleep(3)  # cut off by the proxy long before this
            return resp

        upstream_app = web.Application()
        upstream_app.router.add_post("/v1/completions", tokens)
        upstream_app.router.add_post("/stall", stall)
        up_runner, up_url = await _serve(upstream_app)
        breaker = {"timeout_s": 1.0, "idle_timeout_s": 1.0, "min_requests": 1, "failure_rate": 0.5}
        guard = Guard(parse_config({**CFG, "breaker": breaker}))
        px, px_url = await _proxy(guard, up_url)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(px_url + "/v1/completions", json={}) as r:
                    long = r.status, await r.read()
                async with s.get(px_url + "/guard/metrics") as r:
                    after_long = await r.text()
                async with s.post(px_url + "/stall", json={}) as r:
                    first = await r.content.readuntil(b"\n\n")
                    with pytest.raises(aiohttp.ClientPayloadError):  # cut off, not left hanging
                        await r.read()
                async with s.get(px_url + "/guard/metrics") as r:
                    after_stall = await r.text()
        finally:
            await px.close(grace_s=1)
            await up_runner.cleanup()
        return long, after_long, first, after_stall

    long, after_long, first, after_stall = asyncio.run(scenario())
    assert long[0] == 200 and long[1].count(b"data: ") == 15 and long[1].endswith(b"data: 14\n\n")
    assert _samples(after_long, "gpuscope_guard_breaker_state")[(("state", "closed"),)] == 1  # not a failure
    assert first == b"data: 0\n\n"
    assert _samples(after_stall, "gpuscope_guard_breaker_state")[(("state", "open"),)] == 1  # the stall was one


def test_proxy_reads_only_a_small_body_and_streams_a_large_one_through():
    async def scenario():
        async def digest(request: web.Request) -> web.Response:
            body = await request.read()
            return web.json_response({"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)})

        upstream_app = web.Application(client_max_size=64 << 20)
        upstream_app.router.add_post("/v1/completions", digest)
        up_runner, up_url = await _serve(upstream_app)
        # tokens cost, buckets of 1000 tokens: a read body's estimate decides; an unread one costs the whole
        # burst (so padding past the cap cannot make it cheap): each big body goes to a class of its own
        cfg = {"classes": [{"name": n, "rate": 1, "burst": 1000} for n in ("a", "b", "c")],
               "classify": {"cost": "tokens", "max_body_bytes": 4096, "header": "x-priority", "default": "a"},
               "breaker": {"enabled": False}}
        guard = Guard(parse_config(cfg))
        px, px_url = await _proxy(guard, up_url)
        big = json.dumps({"prompt": "x" * (5 << 20), "max_tokens": 1}).encode()  # ~1.3 M tokens if read

        async def chunked():
            for i in range(0, len(big), 65536):
                yield big[i:i + 65536]
        out = []
        try:
            async with aiohttp.ClientSession() as s:
                small = json.dumps({"prompt": "x" * 3196, "max_tokens": 1}).encode()  # 800 tokens

                async def small_chunked():
                    yield small[:100]
                    yield small[100:]
                # both read and estimated, the second chunked (no Content-Length): it is over what is left
                for data in (small, small_chunked()):
                    async with s.post(px_url + "/v1/completions", data=data) as r:
                        out.append(r.status)
                for klass, data in (("b", big), ("c", chunked())):
                    async with s.post(px_url + "/v1/completions", data=data,
                                      headers={"Content-Type": "application/json", "x-priority": klass}) as r:
                        out.append((r.status, await r.json()))
                async with s.post(px_url + "/v1/completions", data=small, headers={"x-priority": "b"}) as r:
                    out.append(r.status)  # b's burst went to the unread big body
        finally:
            await px.close(grace_s=1)
            await up_runner.cleanup()
        return out

    out = asyncio.run(scenario())
    assert out[:2] == [200, 429]
    want = {"sha256": hashlib.sha256(json.dumps({"prompt": "x" * (5 << 20), "max_tokens": 1}).encode()).hexdigest(),
            "bytes": len(json.dumps({"prompt": "x" * (5 << 20), "max_tokens": 1}))}
    assert out[2] == (200, want)  # Content-Length over the cap: not read (charged the burst), streamed through
    assert out[3] == (200, want)  # chunked, no Content-Length: the same
    assert out[4] == 429


def test_proxy_frees_the_slot_of_a_client_that_stops_reading():
    async def scenario():
        async def endless(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            await resp.prepare(request)
            with contextlib.suppress(ConnectionError):
                while True:
                    await resp.write(b"x" * 65536)
            return resp

        upstream_app = web.Application()
        upstream_app.router.add_get("/endless", endless)
        async def ok(request: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        upstream_app.router.add_get("/ok", ok)
        up_runner, up_url = await _serve(upstream_app)
        guard = Guard(parse_config(STALL_CFG))
        px, px_url = await _proxy(guard, up_url)
        try:
            s = _stalled_client(px_url, "/endless")
            try:
                freed = await _until(lambda: sum(guard.admitted_total) == 1 and guard.inflight_total == 0)
                # aborted while the client still reads nothing (a close would wait to flush for ever)
                closed = await _until(lambda: not px.conns, limit_s=10)
            finally:
                s.close()
            async with aiohttp.ClientSession() as session, session.get(px_url + "/ok") as r:
                after = r.status, await r.json()
        finally:
            await px.close(grace_s=1)
            await up_runner.cleanup()
        return guard, freed, closed, after

    guard, freed, closed, after = asyncio.run(scenario())
    assert freed and closed
    assert guard.breaker.state == "closed"  # the upstream kept sending: not its fault
    assert after == (200, {"ok": True})
