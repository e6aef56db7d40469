"""The guard proxy stops a request at its class's deadline_s, on loopback against real sockets: an upstream that
answers 3 s late (the deadline is 0.5 s), one that begins its answer and then stalls, one whose listen queue
is full so the proxy cannot connect. Asserted is what was recorded: the answer the client got, whether the
upstream saw its connection closed before it answered, the proxy's counters and log lines, the guard's
expiries and the limiter's reaction. The upstream's delays only decide what happens when the proxy fails to
act; no assertion is on how long anything took."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from typing import Any

from test_guard_proxy_http11 import BOUND_S, OK, Scripted, _metric, _sentence, _status

from gpuscope.guard import Guard, parse_config
from gpuscope.guard.proxy import ProxyServer, serve
from gpuscope.http.limits import Limits

LATE_S = 3.0  # how late the upstream answers when nobody stops the request
CFG: dict[str, Any] = {
    "classes": [{"name": "interactive", "share": 0.8, "deadline_s": 0.5}, {"name": "batch", "share": 0.2}],
    "classify": {"header": "x-priority", "default": "interactive"},
    # AIMD: a drop lowers the limit at once (x backoff_ratio), so the limiter's reaction is one number
    "controller": {"mode": "aimd", "min_limit": 1, "initial_limit": 10, "max_limit": 10, "backoff_ratio": 0.5},
    "breaker": {"min_requests": 1000, "timeout_s": 30, "idle_timeout_s": 30}}


@contextlib.asynccontextmanager
async def _proxy(upstream: str, cfg: dict | None = None):
    guard = Guard(parse_config(cfg or CFG))
    # one log line per hour at most for each kind: what the test counts is the rate limit, not the clock
    px = await serve(guard, upstream, limits=Limits(fds_per_connection=2, log_interval_s=3600))
    try:
        yield px, guard
    finally:
        await px.close(grace_s=1)


class Late:
    """An upstream (tests' Scripted) that, for a path starting /slow, waits LATE_S for its connection to close
    before it answers (recording 'closed' when the proxy closed it first); `begin` is written at once when set
    (an answer's head and first bytes); other paths get OK at once."""

    def __init__(self, begin: bytes = b"", rest: bytes = OK) -> None:
        self.begin, self.rest = begin, rest
        self.seen: list[str] = []
        self.up = Scripted(self._script)

    async def _script(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            head = await self.up.read_request(r)
            path = head.split(b" ", 2)[1].decode()
            if not path.startswith("/slow"):
                w.write(OK)
                await w.drain()
                continue
            if self.begin:
                w.write(self.begin)
                await w.drain()
            try:
                eof = await asyncio.wait_for(r.read(1), LATE_S) == b""
            except asyncio.TimeoutError:
                eof = False
            except ConnectionError:
                eof = True
            self.seen.append("closed" if eof else "answered")
            if eof:
                return
            w.write(self.rest)
            await w.drain()


async def _until(cond, bound_s: float = BOUND_S) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + bound_s
    while not cond():
        assert loop.time() < end, "never got there"
        await asyncio.sleep(0.01)


async def _send(px: ProxyServer, raw: bytes) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", px.port)
    try:
        w.write(raw)
        await w.drain()
        return await asyncio.wait_for(r.read(), BOUND_S)
    finally:
        w.close()


def _get(path: str, extra: str = "Connection: close\r\n") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: proxy\r\n{extra}\r\n".encode()


def test_a_request_with_no_answer_by_its_deadline_is_cut_and_answered_504(caplog):
    late = Late()

    async def scenario() -> dict:
        async with late.up, _proxy(late.up.url) as (px, guard):
            with caplog.at_level(logging.WARNING, logger="gpuscope.guard"):
                got = await asyncio.gather(*(_send(px, _get(f"/slow{i}")) for i in range(3)))
                await _until(lambda: len(late.seen) == 3)
            connections = late.up.connections
            after = await _send(px, _get("/fast"))  # a fresh upstream connection: the cut ones are not reused
            return {"got": got, "seen": list(late.seen), "after": after, "connections": (connections,
                                                                                          late.up.connections),
                    "counted": px.deadlines.copy(), "shown": _metric(px, "gpuscope_guard_proxy_deadline_total",
                                                                      reason="no_answer"),
                    "expired": list(guard.expired_total), "inflight": guard.inflight_total,
                    "limit": guard.limiter.limit, "errors": sum(px.errors.values())}

    out = asyncio.run(scenario())
    for got in out["got"]:
        assert _status(got) == 504 and b"x-gpuscope-guard: deadline" in got.lower()
        assert "did not answer within the interactive class's deadline_s of 0.5 s" in _sentence(got)
    assert out["seen"] == ["closed"] * 3  # the upstream saw its connection closed before it answered
    assert _status(out["after"]) == 200 and out["connections"] == (3, 4)
    assert out["counted"] == {"not_sent": 0, "no_answer": 3, "mid_answer": 0} and out["shown"] == 3
    assert out["expired"] == [3, 0] and out["inflight"] == 0
    assert out["limit"] < 10  # the limiter took each as a drop (AIMD: x0.5 a drop, floored at min_limit)
    assert out["errors"] == 0  # not an upstream failure: the proxy's own deadline
    lines = [r.getMessage() for r in caplog.records if "deadline_s" in r.getMessage()]
    assert len(lines) == 1 and "stopped, answered 504" in lines[0]  # three cuts, one line per log interval


def test_a_chunked_answer_streaming_at_the_deadline_ends_cleanly_there():
    late = Late(begin=b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"d\r\ndata: first\n\n\r\n",
                rest=b"e\r\ndata: second\n\n\r\n0\r\n\r\n")

    async def scenario() -> tuple:
        async with late.up, _proxy(late.up.url) as (px, guard):
            r, w = await asyncio.open_connection("127.0.0.1", px.port)
            try:
                w.write(_get("/slow", ""))  # keep-alive: a clean end leaves the connection usable
                await w.drain()
                head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), BOUND_S)
                body = b""
                while not body.endswith(b"0\r\n\r\n"):
                    chunk = await asyncio.wait_for(r.read(65536), BOUND_S)
                    assert chunk, f"the connection closed instead of the answer ending: {body!r}"
                    body += chunk
                w.write(_get("/fast"))  # the same connection, the next request
                await w.drain()
                again = await asyncio.wait_for(r.read(), BOUND_S)
            finally:
                w.close()
            await _until(lambda: late.seen)
            return head, body, again, list(late.seen), px.deadlines.copy(), guard.expired_total[0], guard.inflight_total

    head, body, again, seen, counted, expired, inflight = asyncio.run(scenario())
    assert head.startswith(b"HTTP/1.1 200 OK") and b"transfer-encoding: chunked" in head.lower()
    assert body == b"d\r\ndata: first\n\n\r\n0\r\n\r\n"  # what came before the deadline, then the last chunk
    assert _status(again) == 200 and again.endswith(b"ok")
    assert seen == ["closed"]
    assert counted == {"not_sent": 0, "no_answer": 0, "mid_answer": 1} and expired == 1 and inflight == 0


def test_an_answer_framed_by_its_length_streaming_at_the_deadline_is_cut():
    late = Late(begin=b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\nfirst-bytes",
                rest=b"x" * 89)

    async def scenario() -> tuple:
        async with late.up, _proxy(late.up.url) as (px, guard):
            got = await _send(px, _get("/slow", ""))  # no Connection: close: only a cut ends this read
            await _until(lambda: late.seen)
            return got, list(late.seen), px.deadlines.copy(), guard.inflight_total

    got, seen, counted, inflight = asyncio.run(scenario())
    assert got.startswith(b"HTTP/1.1 200 OK") and got.endswith(b"first-bytes")  # 11 of 100 bytes, then the close
    assert seen == ["closed"] and counted["mid_answer"] == 1 and inflight == 0


def test_a_request_still_waiting_for_its_upstream_connection_at_the_deadline_is_never_sent():
    """The upstream's listen queue is full (backlog 0, filled, never accepted): the proxy's connection attempt
    hangs. At the deadline it is given up and the client gets a 503 with Retry-After; nothing reached the
    upstream."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        fillers.append(s)

    async def scenario() -> tuple:
        async with _proxy(f"http://127.0.0.1:{port}") as (px, guard):
            got = await _send(px, _get("/slow"))
            return got, px.deadlines.copy(), list(guard.expired_total), guard.inflight_total, px.errors["connect"]

    try:
        got, counted, expired, inflight, connect_errors = asyncio.run(scenario())
        listener.setblocking(False)
        ours = {s.getsockname() for s in fillers}
        received = b""
        while True:  # whatever else the listener did accept: none of it carries a byte of the request
            try:
                conn, peer = listener.accept()
            except BlockingIOError:
                break
            with conn, contextlib.suppress(ConnectionError):
                if peer not in ours:
                    conn.settimeout(BOUND_S)  # the proxy gave it up: it is closed, so EOF comes at once
                    received += conn.recv(65536)
    finally:
        for s in fillers:
            s.close()
        listener.close()
    assert _status(got) == 503
    head = got.partition(b"\r\n\r\n")[0].lower()
    assert b"retry-after: " in head and b"x-gpuscope-guard: deadline" in head
    msg = _sentence(got)
    assert "waited its interactive class's deadline_s of 0.5 s" in msg and "was not sent" in msg
    assert json.loads(got.partition(b"\r\n\r\n")[2])["error"]["code"] == 503
    assert counted == {"not_sent": 1, "no_answer": 0, "mid_answer": 0} and expired == [1, 0] and inflight == 0
    assert connect_errors == 0 and received == b""


def test_a_class_without_a_deadline_is_not_stopped():
    late = Late()
    cfg = {**CFG, "classes": [{"name": "interactive", "share": 0.8}, {"name": "batch", "share": 0.2}]}

    async def scenario() -> tuple:
        async with late.up, _proxy(late.up.url, cfg) as (px, guard):
            got = await _send(px, _get("/slow"))
            return got, list(late.seen), px.deadlines.copy()

    got, seen, counted = asyncio.run(scenario())
    assert _status(got) == 200 and seen == ["answered"] and sum(counted.values()) == 0
