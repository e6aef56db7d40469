"""The guard proxy's upstream side: a keep-alive pool per upstream URL, one asyncio Protocol per connection,
llhttp (httptools) parsing the answers.

A connection carries one exchange at a time (no pipelining). What it parses goes to that exchange
(`_Exchange` in _exchange.py: up_head, up_body, up_done, up_failed, flush) as it comes: one read of the socket
is one write to the client, so a server-sent event goes out as soon as it came in. An answer is whole only
once the parser is done with the read that ended it: bytes past its end (a body longer than its
Content-Length, a second answer nobody asked for) make it a failure and the connection is not reused.
A close-delimited body (no length, not chunked: HTTP/1.0, or SSE without chunking) ends at EOF and is
whole. Interim 1xx answers are dropped (the proxy answers `100 Continue` to its client itself); a `101`
is a failure (the proxy tunnels no upgraded protocol).

Idle connections are reused newest first and dropped after `IDLE_S` (or the upstream's own
`Keep-Alive: timeout=`, less a second, when lower): most servers close an idle connection after 5 s or
more, and one closed while a request is on its way is the failure that `_Exchange` retries once.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from collections import deque
from typing import Any

import httptools

from ._wire import HOP, NONE, Head

__all__ = ["IDLE_S", "Pool"]

IDLE_S = 4.0  # an idle upstream connection is dropped after this (below the 5 s of uvicorn, Node, Go's default)
MAX_IDLE = 256  # idle connections kept per upstream at most


class Pool:
    """Connections to one upstream base URL (http or https, with an optional path prefix)."""

    def __init__(self, url: str, loop: asyncio.AbstractEventLoop) -> None:
        u = urllib.parse.urlsplit(url)
        self.url = url
        self.loop = loop
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if u.scheme == "https" else None
        self.prefix = u.path.rstrip("/").encode("latin-1")
        self.host_header = u.netloc.rpartition("@")[2].encode("idna")
        self.idle: deque[Up] = deque()
        self.opened_total = 0

    def take(self) -> Up | None:
        """The newest idle connection still open, or None."""
        idle = self.idle
        now = self.loop.time()
        while idle:
            up = idle.pop()
            if up.transport is not None and not up.transport.is_closing() and now < up.expires:
                return up
            up.close()
        return None

    async def open(self) -> Up:
        _, up = await self.loop.create_connection(lambda: Up(self), self.host, self.port, ssl=self.ssl,
                                                  server_hostname=self.host if self.ssl else None)
        self.opened_total += 1
        return up

    def put(self, up: Up) -> None:
        idle = self.idle
        now = self.loop.time()
        while idle and idle[0].expires <= now:
            idle.popleft().close()
        if len(idle) >= MAX_IDLE:
            idle.popleft().close()
        up.reused = True
        up.expires = now + up.keep_s
        idle.append(up)

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()


class Up(asyncio.Protocol):
    """One connection to the upstream."""

    __slots__ = ("pool", "transport", "parser", "ex", "reused", "got", "status", "reason", "head", "trailers",
                 "head_done", "interim", "complete", "stray", "eof_body", "keep", "keep_s", "expires", "closed")

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.ex: Any = None
        self.reused = False
        self.keep_s = IDLE_S
        self.expires = 0.0
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.got = False
        self.status = 0
        self.reason = b""
        self.head = Head()
        self.trailers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.interim = False
        self.complete = False
        self.stray = False
        self.eof_body = False
        self.keep = False

    def attach(self, ex: Any) -> None:
        self._reset()
        self.ex = ex

    def close(self) -> None:
        self.ex = None
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.ex = None
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        ex = self.ex
        if ex is None:  # bytes on an idle connection: it cannot be trusted with the next request
            self.close()
            return
        self.got = True
        err = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            err = "it switched protocols (101), which this proxy does not tunnel"
        except httptools.HttpParserError as e:
            err = f"its answer is not valid HTTP ({str(e).rstrip('.') or type(e).__name__})"
        if self.ex is not ex:  # the exchange gave up on this connection meanwhile (a HEAD's answer, a cut)
            return
        if self.complete:
            if err is not None or self.stray:
                ex.up_failed(self, "long_body", "it sent more than its answer's length")
            else:
                self.ex = None
                ex.up_done(self)
        elif err is not None:
            ex.up_failed(self, "malformed", err)
        else:
            ex.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        ex, self.ex = self.ex, None
        if ex is None:
            return
        if self.head_done and self.eof_body and not self.complete:
            ex.up_done(self)  # a close-delimited body ends here, whole
        elif self.complete:
            ex.up_done(self)
        elif not self.head_done:
            ex.up_failed(self, "closed", "it closed the connection before answering")
        else:
            ex.up_failed(self, "short_body", "it closed the connection before its answer was complete")

    def pause_writing(self) -> None:
        if self.ex is not None:
            self.ex.up_paused(True)

    def resume_writing(self) -> None:
        if self.ex is not None:
            self.ex.up_paused(False)

    # -- httptools callbacks ----------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:
            self.stray = True

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            self.trailers.append((name, value))
            return
        n = name.lower()  # Head.add, written out
        head = self.head
        if n in HOP:
            head.hop(n, value)
            return
        if n == b"content-type":
            head.content_type = value
        head.parts += (name, b": ", value, b"\r\n")

    def on_headers_complete(self) -> None:
        if self.stray:
            return
        status = self.parser.get_status_code()
        if status < 200 and status != 101:  # interim (100, 102, 103): dropped; the final answer follows
            self.interim = True
            self.head = Head()
            self.reason = b""
            return
        self.status = status
        self.head_done = True
        self.keep = self.parser.should_keep_alive()
        ex = self.ex
        if status == 101:
            return  # the parser raises HttpParserUpgrade for it next: a failure
        self.eof_body = self.head.length == NONE and status not in (204, 304)
        if self.keep and self.head.keep_alive is not None:
            self.keep_s = _keep_alive_s(self.head.keep_alive)
        ex.up_head(self)
        if ex.method == b"HEAD" and self.ex is ex:
            # llhttp cannot be told that a HEAD's answer has no body: it is whole now, and the connection,
            # whose parser would wait for a body, is not reused
            self.complete = True
            self.keep = False
            self.eof_body = False
            self.ex = None
            ex.up_done(self)
            self.close()

    def on_body(self, chunk: bytes) -> None:
        ex = self.ex
        if ex is not None and not self.stray:
            ex.up_body(chunk)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if not self.stray and self.status != 101:  # a 101 is no answer to pass on: the parser's upgrade error says so
            self.complete = True


def _keep_alive_s(value: bytes) -> float:
    """How long the upstream keeps an idle connection, from its `Keep-Alive: timeout=N` less a second (IDLE_S when
    it says more, or nothing)."""
    for part in value.split(b","):
        k, _, v = part.strip().partition(b"=")
        if k.lower() == b"timeout" and v.strip().isdigit():
            return max(0.0, min(IDLE_S, int(v) - 1.0))
    return IDLE_S
