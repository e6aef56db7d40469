"""The guard proxy speaking HTTP/1.1 as real servers and clients do, on loopback: scripted asyncio upstreams
(each answers with exactly the bytes written here), Python's http.server (HTTP/1.0, close-delimited bodies),
and raw-socket clients, so that what goes over the wire is what is asserted.

Covered: Connection: close both ways, HTTP/1.0 clients, close-delimited bodies read to EOF (and SSE without
chunking streamed as it comes), the one retry on a reused connection the upstream closed (idempotent
requests only), Expect: 100-continue, interim 1xx answers, trailers both ways, pipelining, and broken
upstream answers (malformed, longer or shorter than their length, stalled mid-body, a 101), each a counted
error and a 502/504 sentence (or a cut answer), never a slot left taken. Every wait is bounded; no assertion
is on how long something took."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Awaitable, Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuscope.guard import Guard, parse_config
from gpuscope.guard.proxy import ProxyServer, serve

BOUND_S = 10.0  # far above what any step needs; only a proxy that never acts reaches it
CFG: dict[str, Any] = {"classes": [{"name": "interactive", "share": 0.8},
                                   {"name": "batch", "share": 0.2, "rate": 0.001, "burst": 1}],
                       "classify": {"header": "x-priority", "default": "interactive"},
                       "breaker": {"min_requests": 1000, "timeout_s": 2.0, "idle_timeout_s": 0.3}}

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Scripted:
    """An upstream that runs `script(reader, writer, connection_number)` per connection; `.seen` keeps the
    bytes of every request head (and body) it read through `read_request`."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.seen: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    async def __aenter__(self) -> Scripted:
        async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.script(r, w, self.connections)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                w.close()

        self.server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def read_request(self, r: asyncio.StreamReader) -> bytes:
        """One request: its head, and its body by Content-Length or chunking (trailers included)."""
        head = await r.readuntil(b"\r\n\r\n")
        lower = head.lower()
        body = b""
        if b"content-length:" in lower:
            n = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
            body = await r.readexactly(n)
        elif b"transfer-encoding: chunked" in lower:
            while True:
                size_line = await r.readuntil(b"\r\n")
                body += size_line
                if int(size_line.split(b";")[0], 16) == 0:
                    while True:  # trailers, then the empty line
                        line = await r.readuntil(b"\r\n")
                        body += line
                        if line == b"\r\n":
                            break
                    break
                body += await r.readexactly(int(size_line.split(b";")[0], 16) + 2)
        self.seen.append(head + body)
        return head + body


OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"


async def _keepalive(up: Scripted, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
    while True:
        await up.read_request(r)
        w.write(OK)
        await w.drain()


@contextlib.asynccontextmanager
async def _proxy(upstream: str, cfg: dict | None = None):
    guard = Guard(parse_config(cfg or CFG))
    px = await serve(guard, upstream)
    try:
        yield px, guard
    finally:
        await px.close(grace_s=1)


async def _exchange(px: ProxyServer, raw: bytes, *, until_eof: bool = True) -> bytes:
    """Send `raw` on a new connection; what came back until the proxy closed it (or BOUND_S passed)."""
    r, w = await asyncio.open_connection("127.0.0.1", px.port)
    try:
        w.write(raw)
        await w.drain()
        return await asyncio.wait_for(r.read(), BOUND_S) if until_eof else b""
    finally:
        w.close()


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _sentence(answer: bytes) -> str:
    msg = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["message"]
    assert msg[0].isupper() and msg.endswith(".") and "\n" not in msg, msg
    return msg


def _metric(px: ProxyServer, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(px.metrics().decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def _get(path: str = "/x", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: proxy\r\n{extra}\r\n".encode()


# -- Connection: close, both ways -----------------------------------------------------------------------
def test_the_clients_connection_close_ends_its_connection_after_the_answer():
    async def scenario():
        async with Scripted(lambda r, w, n: _keepalive(up, r, w, n)) as up, _proxy(up.url) as (px, guard):
            kept = await _exchange(px, _get() + _get("/y", "Connection: close\r\n"))  # read to EOF: both answers
            return kept, guard.inflight_total, up.connections

    kept, inflight, conns = asyncio.run(scenario())
    assert kept.count(b"HTTP/1.1 200 OK") == 2 and kept.endswith(b"ok")  # the proxy closed after the second
    first, _, second = kept.partition(b"ok")
    assert b"Connection: close" not in first and b"Connection: close" in second
    assert inflight == 0 and conns == 1  # one upstream connection, kept alive for both


@pytest.mark.parametrize("says_close", [True, False], ids=["with-header", "without-header"])
def test_an_upstream_that_closes_after_each_answer(says_close):
    """Allowed by HTTP/1.1 either way; 20 requests on one client connection all get their answer."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n" + (b"Connection: close\r\n" if says_close else b"")

    async def script(r, w, n):
        await up.read_request(r)
        w.write(head + b"\r\nok")
        await w.drain()

    async def scenario():
        nonlocal up
        async with Scripted(script) as up, _proxy(up.url) as (px, guard):
            raw = b"".join(_get(f"/{i}") for i in range(19)) + _get("/last", "Connection: close\r\n")
            got = await _exchange(px, raw)
            return got, guard, up.connections, px

    up: Any = None
    got, guard, conns, px = asyncio.run(scenario())
    assert got.count(b"HTTP/1.1 200 OK") == 20 and got.count(b"ok") == 20
    assert guard.inflight_total == 0 and conns == 20  # one upstream connection per answer
    assert sum(px.errors.values()) == 0  # a close seen before the next request is no failure


def test_an_http10_client_gets_keep_alive_only_when_it_asks():
    async def scenario():
        async with Scripted(lambda r, w, n: _keepalive(up, r, w, n)) as up, _proxy(up.url) as (px, _):
            plain = await _exchange(px, b"GET /a HTTP/1.0\r\n\r\n")
            r, w = await asyncio.open_connection("127.0.0.1", px.port)
            w.write(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            first = await asyncio.wait_for(r.readuntil(b"ok"), BOUND_S)
            w.write(b"GET /b HTTP/1.0\r\n\r\n")  # the same connection serves a second request
            second = await asyncio.wait_for(r.read(), BOUND_S)
            w.close()
            return plain, first, second

    plain, first, second = asyncio.run(scenario())
    assert _status(plain) == 200 and b"Connection: close" in plain  # and it closed (read() returned)
    assert b"Connection: keep-alive" in first and _status(second) == 200 and b"Connection: close" in second


# -- close-delimited bodies --------------------------------------------------------------------------------
class _Http10(BaseHTTPRequestHandler):
    """Python's http.server as it is: HTTP/1.0, no Content-Length, the body ends when it closes."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"x" * 100_000 + b"the-end")

    def log_message(self, *args: Any) -> None:
        pass


def test_a_close_delimited_body_from_http_server_is_whole_and_the_client_keeps_its_connection():
    httpd = HTTPServer(("127.0.0.1", 0), _Http10)
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()

    async def scenario():
        async with _proxy(f"http://127.0.0.1:{httpd.server_address[1]}") as (px, guard):
            got = await _exchange(px, _get("/a") + _get("/b", "Connection: close\r\n"))
            old = await _exchange(px, b"GET /c HTTP/1.0\r\n\r\n")
            return got, old, guard.inflight_total, dict(px.errors)

    try:
        got, old, inflight, errors = asyncio.run(scenario())
    finally:
        httpd.shutdown()
        httpd.server_close()
    answers = got.split(b"HTTP/1.1 200 ")[1:]
    assert len(answers) == 2  # both on one client connection: the first was framed, not ended by a close
    for a in answers:
        head, _, body = a.partition(b"\r\n\r\n")
        assert b"Transfer-Encoding: chunked" in head
        assert _dechunk(body) == b"x" * 100_000 + b"the-end"
    assert old.endswith(b"the-end") and b"Connection: close" in old  # an HTTP/1.0 client: to the close as well
    assert inflight == 0 and sum(errors.values()) == 0


def _dechunk(body: bytes) -> bytes:
    out = b""
    while True:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out += rest[:n]
        body = rest[n + 2:]


def test_sse_without_chunking_streams_each_event_as_it_comes():
    gate = asyncio.Event()

    async def script(r, w, n):
        await up.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\ndata: 1\n\n")
        await w.drain()
        await asyncio.wait_for(gate.wait(), BOUND_S)  # only once the client has read event 1 through the proxy
        w.write(b"data: 2\n\ndata: [DONE]\n\n")
        await w.drain()

    async def scenario():
        nonlocal up
        async with Scripted(script) as up, _proxy(up.url) as (px, guard):
            r, w = await asyncio.open_connection("127.0.0.1", px.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Length: 2\r\n\r\n{}")
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), BOUND_S)
            first = await asyncio.wait_for(r.readuntil(b"data: 1\n\n\r\n"), BOUND_S)
            gate.set()
            rest = await asyncio.wait_for(r.readuntil(b"0\r\n\r\n"), BOUND_S)
            w.close()
            return head, first, rest, guard

    up: Any = None
    head, first, rest, guard = asyncio.run(scenario())
    assert b"text/event-stream" in head and b"Transfer-Encoding: chunked" in head
    assert first.endswith(b"data: 1\n\n\r\n") and b"data: [DONE]\n\n" in rest
    assert guard.inflight_total == 0 and sum(guard.admitted_total) == 1


# -- a reused connection the upstream closed: one retry, idempotent only ------------------------------------
def test_a_request_on_a_reused_connection_the_upstream_closed_is_retried_once_when_idempotent():
    async def script(r, w, n):
        await up.read_request(r)
        w.write(OK)  # the first request of each connection is answered, kept alive...
        await w.drain()
        await up.read_request(r)  # ...and the second is read and dropped with the connection, unanswered

    async def scenario():
        nonlocal up
        async with Scripted(script) as up, _proxy(up.url) as (px, guard):
            out = [await _exchange(px, _get("/1", "Connection: close\r\n"))]
            out.append(await _exchange(px, _get("/2", "Connection: close\r\n")))  # reused, dropped, sent again
            post = b"POST /3 HTTP/1.1\r\nHost: p\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
            out.append(await _exchange(px, post))  # the retried connection is reused now: dropped, not retried
            return out, px.retries, dict(px.errors), guard.inflight_total, up.connections

    up: Any = None
    out, retries, errors, inflight, conns = asyncio.run(scenario())
    assert [_status(a) for a in out] == [200, 200, 502]
    assert retries == 1 and errors["closed"] == 1 and conns == 2
    assert "closed the connection before answering" in _sentence(out[2])
    assert inflight == 0


# -- Expect, 1xx, trailers, pipelining ------------------------------------------------------------------------
def test_expect_100_continue_is_answered_by_the_proxy_once_admitted():
    async def scenario():
        async with Scripted(lambda r, w, n: _keepalive(up, r, w, n)) as up, _proxy(up.url) as (px, _):
            r, w = await asyncio.open_connection("127.0.0.1", px.port)
            w.write(b"POST /v1/x HTTP/1.1\r\nHost: p\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
            cont = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), BOUND_S)  # before any body byte was sent
            w.write(b"hello")
            answer = await asyncio.wait_for(r.readuntil(b"ok"), BOUND_S)
            w.close()
            # batch's bucket holds one request: the next one is refused without being asked for its body
            batch = (b"POST /v1/x HTTP/1.1\r\nHost: p\r\nx-priority: batch\r\nContent-Length: 5\r\n"
                     b"Expect: 100-continue\r\n\r\n")
            await _exchange(px, batch, until_eof=False)  # takes the one token, then hangs up
            refused = await _exchange(px, batch)
            odd = await _exchange(px, b"POST /v1/x HTTP/1.1\r\nHost: p\r\nContent-Length: 5\r\nExpect: tea\r\n\r\nhello")
            return cont, answer, refused, odd, up.seen

    cont, answer, refused, odd, seen = asyncio.run(scenario())
    assert cont == b"HTTP/1.1 100 Continue\r\n\r\n" and _status(answer) == 200
    assert seen[0].endswith(b"\r\n\r\nhello") and b"expect" not in seen[0].lower()  # Expect stops at the proxy
    assert _status(refused) == 429 and b"100 Continue" not in refused and b"Connection: close" in refused
    assert _status(odd) == 417 and "100-continue" in _sentence(odd)


def test_interim_answers_are_dropped_and_a_101_is_a_502():
    async def script(r, w, n):
        req = await up.read_request(r)
        if req.startswith(b"GET /hints"):
            w.write(b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"
                    b"HTTP/1.1 100 Continue\r\n\r\n" + OK)
        else:
            w.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n")
        await w.drain()

    async def scenario():
        nonlocal up
        async with Scripted(script) as up, _proxy(up.url) as (px, guard):
            hints = await _exchange(px, _get("/hints", "Connection: close\r\n"))
            switched = await _exchange(px, _get("/ws", "Connection: close\r\n"))
            return hints, switched, guard.inflight_total, dict(px.errors)

    up: Any = None
    hints, switched, inflight, errors = asyncio.run(scenario())
    assert hints.startswith(b"HTTP/1.1 200 OK") and hints.endswith(b"ok") and b"103" not in hints
    assert _status(switched) == 502 and "does not tunnel" in _sentence(switched)
    assert errors["malformed"] == 1 and inflight == 0


def test_trailers_go_through_both_ways_on_chunked_messages():
    async def script(r, w, n):
        await up.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Digest\r\n\r\n"
                b"2\r\nok\r\n0\r\nX-Digest: abc\r\n\r\n")
        await w.drain()

    async def scenario():
        nonlocal up
        async with Scripted(script) as up, _proxy(up.url) as (px, _):
            req = (b"POST /up HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                   b"3\r\nabc\r\n0\r\nX-Checksum: 42\r\n\r\n")
            return await _exchange(px, req), up.seen

    up: Any = None
    got, seen = asyncio.run(scenario())
    assert b"Transfer-Encoding: chunked" in seen[0] and seen[0].endswith(b"3\r\nabc\r\n0\r\nX-Checksum: 42\r\n\r\n")
    assert got.endswith(b"2\r\nok\r\n0\r\nX-Digest: abc\r\n\r\n")


def test_pipelined_requests_are_answered_in_order():
    async def script(r, w, n):
        while True:
            req = await up.read_request(r)
            body = req.split(b" ")[1]
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await w.drain()

    async def scenario():
        nonlocal up
        async with Scripted(script) as up, _proxy(up.url) as (px, guard):
            raw = b"".join(_get(f"/{i}") for i in range(5)) + _get("/end", "Connection: close\r\n")
            return await _exchange(px, raw), guard.inflight_total

    up: Any = None
    got, inflight = asyncio.run(scenario())
    bodies = [a.partition(b"\r\n\r\n")[2][:4].split(b"HTTP")[0] for a in got.split(b"HTTP/1.1 200 OK")[1:]]
    assert bodies == [b"/0", b"/1", b"/2", b"/3", b"/4", b"/end"] and inflight == 0


# -- broken upstream answers: a counted error, a sentence, no slot left taken --------------------------------
@pytest.mark.parametrize("answer, kind, status, words", [
    (b"HTTP/1.1 2xx Fine\r\n\r\n", "malformed", 502, "not valid HTTP"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA BYTES", "long_body", 502, "more than its answer's length"),
    (b"", "closed", 502, "closed the connection before answering"),
])
def test_a_broken_answer_is_a_502_sentence(answer, kind, status, words):
    async def script(r, w, n):
        await up.read_request(r)
        w.write(answer)
        await w.drain()

    async def scenario():
        nonlocal up
        async with Scripted(script) as up, _proxy(up.url) as (px, guard):
            got = await _exchange(px, _get("/x", "Connection: close\r\n"))
            return got, px, guard

    up: Any = None
    got, px, guard = asyncio.run(scenario())
    assert _status(got) == status and words in _sentence(got)
    assert px.errors[kind] == 1 and _metric(px, "gpuscope_guard_proxy_errors_total", kind=kind) == 1
    assert guard.inflight_total == 0


@pytest.mark.parametrize("then", ["close", "stall"])
def test_an_answer_that_breaks_off_mid_body_is_cut_and_counted(then):
    async def script(r, w, n):
        await up.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nfirst-bytes")
        await w.drain()
        if then == "stall":
            await asyncio.sleep(BOUND_S)  # idle_timeout_s (0.3 s) cuts it long before

    async def scenario():
        nonlocal up
        async with Scripted(script) as up, _proxy(up.url) as (px, guard):
            got = await _exchange(px, _get("/x"))  # no Connection: close: only a cut ends this read
            return got, px, guard

    up: Any = None
    got, px, guard = asyncio.run(scenario())
    assert got.startswith(b"HTTP/1.1 200 OK") and got.endswith(b"first-bytes")  # 11 of 100 bytes, then the close
    assert px.errors["short_body" if then == "close" else "idle_timeout"] == 1
    assert guard.inflight_total == 0


def test_clients_that_leave_while_queued_or_mid_answer_leave_no_slot_taken():
    """One slot (a fixed limit of 1), a slow upstream, 30 clients of which two thirds hang up early: at the end
    nothing is in flight and nothing waits."""
    async def script(r, w, n):
        while True:
            await up.read_request(r)
            await asyncio.sleep(0.02)
            w.write(OK)
            await w.drain()

    cfg = {**CFG, "controller": {"mode": "fixed", "min_limit": 1, "initial_limit": 1, "max_limit": 1},
           "classes": [{"name": "interactive", "share": 1.0, "queue_timeout_s": 5.0}]}

    async def one(px: ProxyServer, i: int) -> int | None:
        r, w = await asyncio.open_connection("127.0.0.1", px.port)
        w.write(_get(f"/{i}", "Connection: close\r\n"))
        try:
            if i % 3:
                await asyncio.sleep(0.01 * (i % 5))
                return None  # hangs up: queued, or mid-answer
            return _status(await asyncio.wait_for(r.read(), BOUND_S))
        finally:
            w.close()

    async def scenario():
        nonlocal up
        async with Scripted(script) as up, _proxy(up.url, cfg) as (px, guard):
            statuses = await asyncio.gather(*(one(px, i) for i in range(30)))
            deadline = asyncio.get_running_loop().time() + BOUND_S
            while (guard.inflight_total or guard.queued_total) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)  # the last queued ones are served or time out
            return statuses, guard.inflight_total, guard.queued_total, await _exchange(px, _get("/after", "Connection: close\r\n"))

    up: Any = None
    statuses, inflight, queued, after = asyncio.run(scenario())
    assert all(s == 200 for s in statuses if s is not None)
    assert inflight == 0 and queued == 0 and _status(after) == 200


def test_the_metrics_page_is_valid_exposition_with_the_proxys_counters():
    async def scenario():
        async with Scripted(lambda r, w, n: _keepalive(up, r, w, n)) as up, _proxy(up.url) as (px, _):
            got = await _exchange(px, _get("/guard/metrics", "Connection: close\r\n"))
            return got

    got = asyncio.run(scenario())
    assert _status(got) == 200 and b"text/plain; version=0.0.4" in got
    names = {f.name for f in text_string_to_metric_families(got.partition(b"\r\n\r\n")[2].decode())}
    assert {"gpuscope_guard_admitted", "gpuscope_guard_proxy_errors", "gpuscope_guard_proxy_retries",
            "gpuscope_http_refusals", "gpuscope_http_open_connections"} <= names
