"""A small, fast HTTP/1.1 client: asyncio Protocols, keep-alive pools, llhttp (httptools) response parsing.

Why not aiohttp: its client spends most of a small request in Python-level bookkeeping (a task, a
response object, header multidicts); a load generator needs one callback per response and a timestamp
per body chunk. Requests are pre-encoded bytes; a connection carries one request at a time (no
pipelining, as browsers and inference clients do). Completion is a callback, so no task is created per
request on a warm connection.

Timeouts: a request's deadline is its intended send time plus the timeout (latency is measured from the
intended send, so a timed-out request's recorded latency, `t_failed - t_intended`, is the timeout). One
loop timer per client is armed for the earliest deadline, so a timeout fires within about a millisecond
(the loop's timer resolution). Nothing is allocated per request for it (a heap entry per request cost 6 %
of the closed-loop throughput, mostly in garbage collection): when the timer fires, the deadlines of the
requests then in flight are sorted once into a list that later firings walk; a request started after
that only lowers `_new_min`, the earliest deadline not in the list, and the list is taken again when that
comes due. With fast answers that is one sort of the requests in flight per timeout period. Requests
waiting for a connection (`max_connections`) are in send order, which is deadline order, so the timer
fails the expired ones from the head of the queue; none of them takes a connection, and a connection
being opened gets only the time left to its request's deadline.

    client = Client("http://127.0.0.1:8000", timeout_s=30.0, t0=time.perf_counter())
    client.send(record, payload_bytes, on_done=lambda rec: ..., on_chunk=None)
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter

import httptools

from ..errors import UsageError
from .records import RequestRecord

perf_counter = time.perf_counter

# Connections being opened at once: beyond this, requests wait for the first connection to come free or
# open, so that a burst cannot turn into thousands of simultaneous handshakes (the lateness is recorded).
MAX_OPENING = 64

# The loop's timers may fire up to a millisecond early (uvloop counts whole ms): a connection attempt is
# given this much beyond its request's deadline, so that it never fails before the deadline.
_TIMER_TICK_S = 0.001

OnDone = Callable[[RequestRecord], None]
OnChunk = Callable[[bytes, float], "str | None"]   # returns an error class to abort, else None


# Characters kept as they are when a URL's path or query is percent-encoded: RFC 3986 reserved and '%'.
_URL_SAFE = "/:@!$&'()*+,;=?%[]~"


class UrlError(UsageError, ValueError):
    """A URL the client cannot use; the message is one sentence."""


@dataclass(frozen=True, slots=True)
class Target:
    scheme: str
    host: str
    port: int
    path: str            # path and query, at least "/"
    host_header: str

    @classmethod
    def parse(cls, url: str) -> Target:
        # Whitespace or control characters would end up in the request line and split or reshape it.
        if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7f for c in url):
            raise UrlError(f"{shown_url(url)!r} is not a usable URL: it holds a space or a control character.")
        try:
            u = urllib.parse.urlsplit(url)
        except ValueError as e:
            raise UrlError(f"'{shown_url(url)}' is not a usable URL ({e}).") from None
        if u.scheme not in ("http", "https") or not u.hostname:
            raise UrlError(f"'{shown_url(url)}' is not an http:// or https:// URL with a host.")
        try:
            port = u.port or (443 if u.scheme == "https" else 80)
        except ValueError:
            raise UrlError(f"'{shown_url(url)}' has an invalid port.") from None
        # A request line is ASCII: non-ASCII path or query characters are sent percent-encoded (UTF-8),
        # as browsers and curl do; what is already percent-encoded or reserved is left as it is.
        path = urllib.parse.quote(u.path or "/", safe=_URL_SAFE) + (
            f"?{urllib.parse.quote(u.query, safe=_URL_SAFE)}" if u.query else "")
        default = (u.scheme == "https" and port == 443) or (u.scheme == "http" and port == 80)
        host = u.hostname if ":" not in u.hostname else f"[{u.hostname}]"
        return cls(u.scheme, u.hostname, port, path, host if default else f"{host}:{port}")


def shown_url(url: str) -> str:
    """The URL as it may be printed or written to a file: a password in it replaced by ***."""
    try:
        u = urllib.parse.urlsplit(url)
        if u.password is None:
            return url
        netloc = f"{u.username or ''}:***@{u.netloc.rpartition('@')[2]}"
        return urllib.parse.urlunsplit(u._replace(netloc=netloc))
    except ValueError:
        return url


def encode_request(target: Target, method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
    """One HTTP/1.1 request as bytes (keep-alive, Content-Length framing)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {target.host_header}"]
    lower = {k.lower() for k in headers}
    if "user-agent" not in lower:
        lines.append("User-Agent: gpuscope-loadtest")
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    lines.extend(f"{k}: {v}" for k, v in headers.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Conn(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    __slots__ = ("client", "transport", "parser", "rec", "on_done", "on_chunk", "deadline", "now", "keep")

    def __init__(self, client: Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.rec: RequestRecord | None = None
        self.on_done: OnDone | None = None
        self.on_chunk: OnChunk | None = None
        self.deadline = 0.0
        self.now = 0.0
        self.keep = True

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        rec = self.rec
        if rec is None:   # bytes nobody asked for: the connection cannot be trusted any more
            self._close()
            return
        now = self.now = perf_counter() - self.client.t0
        if rec.t_first_byte is None:
            rec.t_first_byte = now
        rec.bytes_in += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.fail("malformed", f"bad HTTP response: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._forget(self)
        if self.rec is not None:
            self.fail("disconnect", "the server closed the connection before the answer was complete")

    # httptools callbacks
    def on_headers_complete(self) -> None:
        rec = self.rec
        if rec is not None:
            rec.status = self.parser.get_status_code()
        self.keep = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self.on_chunk is not None and self.rec is not None and 200 <= self.rec.status < 300:
            err = self.on_chunk(body, self.now)
            if err:
                self.fail(err, "bad server-sent events or JSON in the response")

    def on_message_complete(self) -> None:
        rec = self.rec
        if rec is None:
            return
        rec.t_end = self.now
        s = rec.status
        if s >= 300 and rec.error is None:
            rec.error = "http_429" if s == 429 else "http_5xx" if s >= 500 else "http_4xx"
            rec.error_detail = f"HTTP {s}"
        self._finish(reuse=self.keep)

    # own
    def start(self, rec: RequestRecord, payload: bytes, on_done: OnDone, on_chunk: OnChunk | None) -> None:
        self.rec, self.on_done, self.on_chunk = rec, on_done, on_chunk
        client = self.client
        rec.t_sent = perf_counter() - client.t0
        deadline = self.deadline = rec.t_intended + client.timeout_s
        if rec.t_sent >= deadline:
            # It waited in the client (--max-connections) past its deadline: not sent, the connection kept.
            _unsent_timeout(rec, client.timeout_s, rec.t_sent)
            self._finish(reuse=True)
            return
        rec.bytes_out = len(payload)
        self.transport.write(payload)  # type: ignore[union-attr]
        if deadline < client._new_min:
            client._new_min = deadline
            if deadline < client._timer_at:
                client._arm(deadline)

    def fail(self, error: str, detail: str) -> None:
        rec = self.rec
        if rec is None:
            return
        if rec.error is None:
            rec.error, rec.error_detail = error, detail
        rec.t_end = None
        rec.t_failed = perf_counter() - self.client.t0
        self._finish(reuse=False)

    def _finish(self, reuse: bool) -> None:
        rec, done = self.rec, self.on_done
        self.rec = self.on_done = self.on_chunk = None
        if reuse:
            self.client._idle.append(self)
            if self.client._waiting:
                self.client._drain_waiting()
        else:
            self._close()
        if done is not None and rec is not None:
            done(rec)

    def _close(self) -> None:
        self.client._forget(self)
        if self.transport is not None:
            self.transport.close()


class Client:
    """A pool of keep-alive connections to one host; `send` never raises (failures land in the record)."""

    def __init__(self, url: str, *, t0: float, timeout_s: float = 30.0, verify_tls: bool = True,
                 max_connections: int = 0) -> None:
        self.target = Target.parse(url)
        self.t0 = t0
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        self._opening = 0
        self._waiting: deque[tuple[RequestRecord, bytes, OnDone, OnChunk | None]] = deque()
        self._draining = False
        self._ssl: ssl.SSLContext | None = None
        if self.target.scheme == "https":
            self._ssl = ssl.create_default_context()
            if not verify_tls:
                self._ssl.check_hostname = False
                self._ssl.verify_mode = ssl.CERT_NONE
        # Timeouts (see the module's docstring): (deadline_s, conn, rec) of the requests in flight when the
        # timer last took them, by deadline, walked from _due_next; an entry whose conn no longer carries
        # its rec has ended. _new_min: the earliest deadline of a request started since.
        self._due: list[tuple[float, _Conn, RequestRecord]] = []
        self._due_next = 0
        self._new_min = float("inf")
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    @property
    def in_flight(self) -> int:
        return len(self._all) - len(self._idle) + self._opening

    def send(self, rec: RequestRecord, payload: bytes, on_done: OnDone, on_chunk: OnChunk | None = None) -> None:
        if self._idle:
            self._idle.pop().start(rec, payload, on_done, on_chunk)
        elif (self.max_connections and len(self._all) + self._opening >= self.max_connections) \
                or self._opening >= MAX_OPENING:
            self._waiting.append((rec, payload, on_done, on_chunk))
            deadline = rec.t_intended + self.timeout_s
            if deadline < self._timer_at:
                self._arm(deadline)
        else:
            self._opening += 1
            asyncio.get_running_loop().create_task(self._open_and_send(rec, payload, on_done, on_chunk))

    async def _open_and_send(self, rec: RequestRecord, payload: bytes, on_done: OnDone,
                             on_chunk: OnChunk | None) -> None:
        loop = asyncio.get_running_loop()
        t = self.target
        now = perf_counter() - self.t0
        left_s = connect_budget_s(rec, self.timeout_s, now)
        if left_s <= 0.0:   # it waited in the client past its deadline: not sent, no connection opened
            self._opening -= 1
            _unsent_timeout(rec, self.timeout_s, now)
            on_done(rec)
            self._drain_waiting()
            return
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Conn(self), t.host, t.port, ssl=self._ssl,
                server_hostname=t.host if self._ssl else None), left_s + _TIMER_TICK_S)
        except Exception as e:  # every failure to connect is the server's side of the story: classify it
            self._opening -= 1
            rec.t_sent = rec.t_failed = perf_counter() - self.t0
            rec.error, rec.error_detail = classify_connect_error(e)
            on_done(rec)
            self._drain_waiting()
            return
        self._opening -= 1
        sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._all.add(conn)
        if conn.transport is None or conn.transport.is_closing():
            conn.rec = rec
            conn.on_done = on_done
            conn.fail("disconnect", "the server closed the connection as soon as it was opened")
            return
        conn.start(rec, payload, on_done, on_chunk)
        self._drain_waiting()

    def _forget(self, conn: _Conn) -> None:
        self._all.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass
        self._drain_waiting()

    def _drain_waiting(self) -> None:
        """Send waiting requests while connections are free; fail those past their deadline unsent.

        A loop, never a recursion: sending or failing one may end another request (and call back here),
        and thousands of expired requests in a row once overflowed the stack and lost their records."""
        if self._draining:   # an outer call is looping: it sees what this one would have
            return
        self._draining = True
        try:
            waiting = self._waiting
            while waiting:
                rec, payload, on_done, on_chunk = waiting[0]
                now = perf_counter() - self.t0
                if now >= rec.t_intended + self.timeout_s:
                    waiting.popleft()
                    _unsent_timeout(rec, self.timeout_s, now)
                    on_done(rec)
                elif self._idle or (self._opening < MAX_OPENING and (
                        not self.max_connections or len(self._all) + self._opening < self.max_connections)):
                    waiting.popleft()
                    self.send(rec, payload, on_done, on_chunk)
                else:
                    break
        finally:
            self._draining = False

    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = asyncio.get_running_loop().call_later(max(deadline - (perf_counter() - self.t0), 0.0),
                                                            self._expire)

    def _expire(self) -> None:
        """Time out every request whose deadline has passed, then arm the timer for the next deadline."""
        self._timer, self._timer_at = None, float("inf")
        now = perf_counter() - self.t0
        if self._new_min <= now:   # a request the list does not hold may be due: take the list again
            self._due = sorted(((c.deadline, c, c.rec) for c in self._all if c.rec is not None),  # type: ignore[misc]
                               key=itemgetter(0))
            self._due_next, self._new_min = 0, float("inf")
        due, k = self._due, self._due_next
        while k < len(due):
            deadline, conn, rec = due[k]
            if conn.rec is not rec:
                k += 1
            elif deadline <= now:
                k += 1
                conn.fail("timeout", f"no complete answer within {self.timeout_s:g} s of its intended send")
                now = perf_counter() - self.t0
            else:
                break
        if k >= len(due):
            self._due, k = [], 0
        self._due_next = k
        if self._waiting:
            self._drain_waiting()   # fails the expired ones at the head of the queue
        # The loop's timers may fire a fraction of a millisecond early (uvloop counts whole ms): what is not
        # due yet gets the timer again, never failed early.
        nxt = min(self._due[k][0] if self._due else float("inf"), self._new_min,
                  self._waiting[0][0].t_intended + self.timeout_s if self._waiting else float("inf"))
        if nxt < self._timer_at and nxt != float("inf"):
            self._arm(nxt)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for conn in list(self._all):
            conn._close()


def connect_budget_s(rec: RequestRecord, timeout_s: float, now_s: float) -> float:
    """Seconds a connection for `rec` may take to open at `now_s`: what is left to its deadline (intended
    send plus the timeout), so that time spent waiting for a connection counts against the timeout.

    >>> connect_budget_s(RequestRecord(i=0, stage=0, worker=0, t_intended=1.0, t_sent=0.0), 0.5, 1.25)
    0.25
    """
    return max(rec.t_intended + timeout_s - now_s, 0.0)


def _unsent_timeout(rec: RequestRecord, timeout_s: float, now_s: float) -> None:
    rec.error, rec.error_detail = "timeout", f"not sent within {timeout_s:g} s of its intended send"
    rec.t_sent = rec.t_failed = now_s


def classify_connect_error(e: BaseException) -> tuple[str, str]:
    if isinstance(e, (ssl.SSLError, ssl.CertificateError)):
        return "tls", f"TLS handshake failed: {getattr(e, 'reason', None) or e}"
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return "timeout", "the connection could not be opened in time"
    if isinstance(e, OSError):
        return "connect", f"cannot connect: {e.strerror or e}"
    return "client", f"{type(e).__name__}: {e}"
