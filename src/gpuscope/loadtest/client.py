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

HTTP/1.1 as servers speak it (RFC 9112): a connection is kept after an answer unless the answer or the
request itself says `Connection: close` (or the answer is HTTP/1.0 without keep-alive). A server may also
close a kept-alive connection without saying so, and a request sent as it does fails before any byte of
answer: such a request is sent once more on a fresh connection (`t_retried`), as browsers, curl, Go and
aiohttp do, when sending it twice is safe — an idempotent method (GET, HEAD, OPTIONS, TRACE, PUT, DELETE),
an Idempotency-Key header, or a write that failed at once (no byte left). Any other request (a POST) is
recorded as a disconnect: the server may have acted on it. A body with neither Content-Length nor chunking
ends at the server's close (a clean close completes it, a reset cuts it); 1xx interim answers are skipped
(so `Expect: 100-continue` works: the body goes at once, as RFC 9110 10.1.1 allows); trailers are read and
dropped; a HEAD's answer ends with its headers. A 101, a status outside 100-599, headers over 64 KiB and
bytes past an answer's end are malformed.

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

# A connection idle for longer than this has had its server's close, if any, read by the loop (which reads
# after running its timers, in ticks of 1 ms; a busy server closes a few ms after its answer).
_SETTLED_S = 0.010
_CLOSER_MEMORY_S = 1.0   # how long a server seen closing right after an answer is taken to go on doing so

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


# What a request's own bytes say about how its answer is read (worked out once per payload).
_HEAD = 1    # a HEAD: the answer ends with its headers, whatever its Content-Length says (RFC 9110 9.3.2)
_RETRY = 2   # safe to send twice: an idempotent method (RFC 9110 9.2.2) or an Idempotency-Key header
_CLOSE = 4   # it says `Connection: close`: its connection ends with its answer

_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})
_IDEMPOTENCY_KEYS = frozenset({b"idempotency-key", b"x-idempotency-key"})

# An answer's status line and headers (interim 1xx answers included) may take this much; past it the
# answer is refused as malformed (llhttp itself sets no limit; nginx's large_client_header_buffers and
# Node's --max-http-header-size are 8-32 KiB, so 64 KiB is generous).
MAX_HEAD_BYTES = 64 << 10

# How far an answer has come (_Conn.phase).
_HEAD_DUE, _INTERIM, _HEADERS_IN, _COMPLETE = 0, 1, 2, 3   # its status line and headers to come; a 1xx being
                                                            # read past; the final headers in; all of it in

_SWITCHED = "the server switched protocols (101), which the load tester did not ask for"
_EXCESS = ("the server sent bytes past the end of its Content-Length (a body longer than it said), so the answer's "
           "end is unknown")


def request_traits(payload: bytes) -> int:
    """The _HEAD, _RETRY and _CLOSE bits of an encoded request.

    >>> request_traits(b"POST / HTTP/1.1\\r\\nConnection: close\\r\\n\\r\\n") == _CLOSE
    True
    """
    end = payload.find(b"\r\n\r\n")
    lines = payload[:end if end >= 0 else len(payload)].split(b"\r\n")
    method = lines[0].partition(b" ")[0]
    flags = (_HEAD if method == b"HEAD" else 0) | (_RETRY if method in _IDEMPOTENT else 0)
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name in _IDEMPOTENCY_KEYS:
            flags |= _RETRY
        elif name == b"connection" and b"close" in (t.strip() for t in value.lower().split(b",")):
            flags |= _CLOSE
    return flags


class _Fields:
    """Collects the header fields of the last answer in some bytes (the rare paths only: no callback per
    header on the hot path)."""

    def __init__(self) -> None:
        self.fields: list[tuple[bytes, bytes]] = []

    def on_message_begin(self) -> None:
        self.fields = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name.lower(), value.strip()))


def answer_framing(head: bytes) -> tuple[int | None, bool]:
    """(Content-Length, chunked) of the last answer whose status line and headers `head` holds; neither
    means its body ends when the connection closes (RFC 9112 6.3).

    >>> answer_framing(b"HTTP/1.0 200 OK\\r\\nServer: x\\r\\n\\r\\n"), answer_framing(b"HTTP/1.1 200 OK\\r\\nContent-Length: 4\\r\\n\\r\\n")
    ((None, False), (4, False))
    """
    f = _Fields()
    try:
        httptools.HttpResponseParser(f).feed_data(head)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        pass
    length = next((int(v) for n, v in f.fields if n == b"content-length" and v.isdigit()), None)
    codings = b",".join(v for n, v in f.fields if n == b"transfer-encoding").lower().split(b",")
    return length, codings[-1].strip() == b"chunked"


class _Conn(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time.

    An answer is finished once the parser's call returns (not inside its callbacks), so that bytes past its
    end in the same read are seen: a body longer than its Content-Length is an error, not the next answer."""

    __slots__ = ("client", "transport", "parser", "rec", "on_done", "on_chunk", "deadline", "now", "keep",
                 "payload", "flags", "served", "written", "head", "phase", "bad", "body_n",
                 "idle_at")

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
        self.payload = b""
        self.flags = 0
        self.served = 0              # answers this connection has carried: > 0 means a reused connection
        self.written = False         # the request's bytes went to the socket (the write did not fail at once)
        self.head: bytes | None = None   # the answer's bytes until its headers are complete (rare paths read it)
        self.phase = _HEAD_DUE       # how far its answer has come
        self.bad: str | None = None  # why the answer is not one to accept (its status line, bytes past its end)
        self.body_n = 0              # body bytes of the answer so far
        self.idle_at = 0.0           # when its last answer ended (seconds since t0)

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
        had_headers = self.phase >= _HEADERS_IN
        if not had_headers:
            self.head = data if self.head is None else self.head + data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.bad = _SWITCHED
        except httptools.HttpParserError as e:
            if self.phase == _COMPLETE:
                self.bad = _EXCESS
            elif self.bad is None:
                self.fail("malformed", f"bad HTTP response: {e}")
                return
        # (the bytes of this read that were body are not head: body_n counts what the parser gave as body)
        # (a callback that ended the record left its phase short of _COMPLETE: on_message_complete saw no rec)
        if self.phase == _COMPLETE and self.bad is None and (
                had_headers or len(self.head) - self.body_n <= MAX_HEAD_BYTES):  # type: ignore[arg-type]
            s = rec.status   # the answer, complete (as _answered, inline: this is every request's path)
            if s >= 300 and rec.error is None:
                rec.error = "http_429" if s == 429 else "http_5xx" if s >= 500 else "http_4xx"
                rec.error_detail = f"HTTP {s}"
            self.served += 1
            self._finish(reuse=self.keep)
        elif self.rec is not rec:   # ended by a callback (a stream's reader refused the body)
            return
        elif self.bad is not None:
            self.fail("malformed", self.bad)
        elif not had_headers and len(self.head or b"") - self.body_n > MAX_HEAD_BYTES:
            self.fail("malformed", f"the answer's status line and headers exceed {MAX_HEAD_BYTES >> 10} KiB")

    def connection_lost(self, exc: Exception | None) -> None:
        client = self.client
        client._forget(self)
        rec = self.rec
        if rec is None:
            now = perf_counter() - client.t0
            if self.served and now - self.idle_at < _SETTLED_S:
                client.unsaid_close_at = now   # closed right after an answer that did not say so
            return
        if self.served and rec.t_first_byte is None:
            client.unsaid_close_at = perf_counter() - client.t0
        if self.phase >= _HEADERS_IN and exc is None and answer_framing(self.head or b"") == (None, False):
            # No Content-Length, no chunking: the body ends with the connection (HTTP/1.0 style, or SSE
            # without chunking). A reset instead of a clean close leaves it unknown, so that is a disconnect.
            rec.t_end = perf_counter() - self.client.t0
            self._answered(reuse=False)
        elif rec.t_first_byte is None and self.served and rec.t_retried is None and (
                self.flags & _RETRY or not self.written):
            self._retry()
        else:
            self.fail("disconnect", self._cut(exc))

    # httptools callbacks (no on_message_begin: a Python call per answer for what on_headers_complete sees)
    def on_headers_complete(self) -> None:
        if self.phase:   # _COMPLETE: a second answer's headers in the read that ended the first (bytes past its end)
            self.bad = _EXCESS
            return
        parser = self.parser
        status = parser.get_status_code()
        if not 200 <= status <= 599:
            if 100 <= status < 200 and status != 101:
                self.phase = _INTERIM   # 100 Continue, 103 Early Hints: the answer is still to come
                return
            self.bad = _SWITCHED if status == 101 else \
                f"the server answered status {status}, which is not an HTTP status (100-599)"
        self.phase = _HEADERS_IN
        rec = self.rec
        if rec is None:
            return
        rec.status = status
        flags = self.flags
        self.keep = parser.should_keep_alive() and not flags & _CLOSE
        if flags & _HEAD:
            # Its Content-Length is that of the GET it stands for: no body follows. The parser would wait for
            # one, so the connection gets a fresh parser for its next answer.
            self.phase = _COMPLETE
            rec.t_end = self.now
            self.parser = httptools.HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        self.body_n += len(body)
        if self.on_chunk is not None and self.rec is not None and 200 <= self.rec.status < 300:
            err = self.on_chunk(body, self.now)
            if err:
                self.fail(err, "bad server-sent events or JSON in the response")

    def on_message_complete(self) -> None:
        phase = self.phase
        if phase == _INTERIM:
            self.phase = _HEAD_DUE
            return
        rec = self.rec
        if rec is None or phase == _COMPLETE:
            return
        self.phase = _COMPLETE
        rec.t_end = self.now

    # own
    def start(self, rec: RequestRecord, payload: bytes, on_done: OnDone, on_chunk: OnChunk | None) -> None:
        self.rec = rec
        self.on_done = on_done
        self.on_chunk = on_chunk
        self.payload = payload
        self.head = self.bad = None
        self.phase = self.body_n = 0   # _HEAD_DUE, no body yet
        client = self.client
        if payload is client._traits_payload:
            flags = self.flags = client._traits_flags
        else:
            flags = self.flags = client.traits(payload)
        now = perf_counter() - client.t0
        if rec.t_retried is None:
            rec.t_sent = now
        deadline = self.deadline = rec.t_intended + client.timeout_s
        if now >= deadline:
            # It waited in the client (--max-connections) past its deadline: not sent, the connection kept.
            _unsent_timeout(rec, client.timeout_s, now)
            self._finish(reuse=True)
            return
        rec.bytes_out = len(payload)
        transport = self.transport
        transport.write(payload)  # type: ignore[union-attr]
        if not flags & _RETRY:
            # A write that failed at once (the server's reset had arrived) closes the transport before it
            # returns: then no byte of the request left, and it may go again on a fresh connection.
            self.written = not transport.is_closing()  # type: ignore[union-attr]
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

    def timed_out(self, timeout_s: float) -> None:
        rec = self.rec
        if rec is None:
            return
        within = f"within {timeout_s:g} s of its intended send"
        if rec.t_first_byte is None:
            self.fail("timeout", f"no answer {within}")
        elif self.phase < _HEADERS_IN:
            self.fail("timeout", f"the answer's headers were not complete {within}")
        else:
            self.fail("timeout", f"the answer stopped {self.body_n} bytes into its body: not complete {within}")

    def _answered(self, reuse: bool) -> None:
        rec = self.rec
        if rec is not None:
            s = rec.status
            if s >= 300 and rec.error is None:
                rec.error = "http_429" if s == 429 else "http_5xx" if s >= 500 else "http_4xx"
                rec.error_detail = f"HTTP {s}"
        self.served += 1
        self._finish(reuse=reuse)

    def _retry(self) -> None:
        """Send the request again on a fresh connection: this one failed under it before any byte of answer,
        having carried an earlier answer (the server closed it as the request went out)."""
        rec, payload, on_done, on_chunk = self.rec, self.payload, self.on_done, self.on_chunk
        self.rec = self.on_done = self.on_chunk = None
        rec.t_retried = perf_counter() - self.client.t0  # type: ignore[union-attr]
        self.client._open(rec, payload, on_done, on_chunk)  # type: ignore[arg-type]

    def _cut(self, exc: Exception | None) -> str:
        """The sentence of a disconnect: where in the answer the connection ended."""
        rec = self.rec
        how = "closed" if exc is None else f"reset ({exc.strerror or exc})" if isinstance(exc, OSError) else "lost"
        if rec is None or rec.t_first_byte is None:
            if self.served and rec is not None and rec.t_retried is None:
                method = self.payload.partition(b" ")[0].decode("latin-1")
                return (f"the server {how} a reused keep-alive connection without answering; a {method} is not sent "
                        "again (it may have been processed) unless it carries an Idempotency-Key header")
            return f"the server {how} the connection without answering" + (
                " (the retry on a fresh connection too)" if rec is not None and rec.t_retried is not None else "")
        if self.phase < _HEADERS_IN:
            return f"the server {how} the connection in the middle of the answer's status line and headers"
        length, chunked = answer_framing(self.head or b"")
        if length is not None:
            return f"the server {how} the connection after {self.body_n} of its {length} bytes of body (Content-Length)"
        if chunked:
            return f"the server {how} the connection before the last chunk of its chunked body ({self.body_n} bytes in)"
        return (f"the connection was {how} {self.body_n} bytes into a body that ends with the connection: "
                "a reset, not a close, so it cannot be told complete")

    def _finish(self, reuse: bool) -> None:
        rec, done = self.rec, self.on_done
        self.rec = self.on_done = self.on_chunk = None
        if reuse:
            self.idle_at = self.now
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
        self._traits_payload, self._traits_flags = b"", 0   # the last payload's traits (a static one is one object)
        # When the server was last seen closing a kept-alive connection right after an answer without saying
        # so (seconds since t0): for a while after that, requests wait for a settled connection (_take_idle).
        self.unsaid_close_at: float | None = None

    @property
    def in_flight(self) -> int:
        return len(self._all) - len(self._idle) + self._opening

    def send(self, rec: RequestRecord, payload: bytes, on_done: OnDone, on_chunk: OnChunk | None = None) -> None:
        idle = self._idle
        if idle and (conn := idle.pop() if self.unsaid_close_at is None else self._take_idle(payload)) is not None:
            conn.start(rec, payload, on_done, on_chunk)
        elif (self.max_connections and len(self._all) + self._opening >= self.max_connections) \
                or self._opening >= MAX_OPENING:
            self._waiting.append((rec, payload, on_done, on_chunk))
            deadline = rec.t_intended + self.timeout_s
            if deadline < self._timer_at:
                self._arm(deadline)
        else:
            self._open(rec, payload, on_done, on_chunk)

    def _open(self, rec: RequestRecord, payload: bytes, on_done: OnDone, on_chunk: OnChunk | None) -> None:
        """Send on a connection of its own, opened now (a retry comes here directly: the connection it replaces
        is already gone, so --max-connections still holds)."""
        self._opening += 1
        asyncio.get_running_loop().create_task(self._open_and_send(rec, payload, on_done, on_chunk))

    def _take_idle(self, payload: bytes) -> _Conn | None:
        """The idle connection to send on: the one that went idle last (the others may then time out at the
        server while idle, cleanly).

        A server that closes after each answer without saying so is seen closing only when the loop next
        reads, after it has run its timers, and sends fall due at that very moment (a loop timer is due
        within its 1 ms tick): a connection idle for less than _SETTLED_S may be closed already, which costs
        a GET a retry and a POST a disconnect. So, for _CLOSER_MEMORY_S after the server was last seen doing
        that, a request takes the latest connection idle for longer, or (None) a fresh connection when it may
        open one, and only failing both the latest. Against servers that keep their connections nothing
        changes (one comparison)."""
        idle = self._idle
        seen = self.unsaid_close_at
        now = perf_counter() - self.t0
        if seen is None or now - seen > _CLOSER_MEMORY_S:
            return idle.pop()
        settled = now - _SETTLED_S
        for k in range(len(idle) - 1, max(len(idle) - 5, -1), -1):
            if idle[k].idle_at < settled:
                return idle.pop(k)
        if self._opening < MAX_OPENING and (
                not self.max_connections or len(self._all) + self._opening < self.max_connections):
            return None
        return idle.pop()

    def traits(self, payload: bytes) -> int:
        """request_traits(payload), looked up once for a payload sent again and again."""
        if payload is not self._traits_payload:
            self._traits_payload, self._traits_flags = payload, request_traits(payload)
        return self._traits_flags

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
            rec.t_failed = perf_counter() - self.t0
            if rec.t_retried is None:
                rec.t_sent = rec.t_failed
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
                conn.timed_out(self.timeout_s)
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
    if rec.t_retried is not None:   # its first send failed under it and the deadline came before the retry's
        rec.error, rec.error_detail = "timeout", f"its retry could not be sent within {timeout_s:g} s of its intended send"
        rec.t_failed = now_s
        return
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
