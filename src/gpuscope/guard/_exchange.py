"""The guard proxy's data path: one asyncio Protocol per client connection, llhttp (httptools) parsing its
requests, one `_Exchange` per request between it and an upstream connection (_upstream.py).

No task per request: the parser's callbacks drive everything. A decision that cannot wait is taken inline
(`Guard.acquire`) when it is sure to be the one the queueing API would take (nothing queued, room under the
limit, local buckets); otherwise `Guard.acquire_async` runs in a task and may queue. Bodies are forwarded
as they come, each received chunk written on (`transport.write`), with flow control both ways: a full
upstream socket pauses reading from the client, a client that does not read pauses reading from the
upstream. One timer per client connection, re-armed only when a deadline comes due or an earlier one is
set, keeps every deadline: the kit's header, body and idle ones, the upstream's answer
(`breaker.timeout_s`) and gaps (`breaker.idle_timeout_s`), the client's stall (`breaker.client_stall_s`), and
the decision's own (`Decision.deadline_s`, from its class's `deadline_s`): there the request is stopped
(`_Exchange.past_deadline`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import urllib.parse
from collections import deque
from typing import Any

import httptools

from ._classify import OVERSIZE, RequestInfo
from ._deadline import stop
from ._http import GUARD_HEADER, cache_key, parse_json, refusal, rewrite_model
from ._upstream import Pool, Up
from ._wire import CHUNKED, HOP, NONE, Head, Headers, answer, request_head, response_head

__all__ = ["Client"]

log = logging.getLogger("gpuscope.guard")

monotonic = time.monotonic
INF = math.inf
MAX_LINE = 8190  # a request line or one header at most (aiohttp's and nginx's large_client_header_buffers)
MAX_HEAD = 65536  # a request's head at most, all headers together
MAX_HEADERS = 128
PENDING_MAX = 256 << 10  # body bytes held while the decision or the upstream connection is pending
REPLAY_MAX = 64 << 10  # a request kept for a retry on a fresh connection at most
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"TRACE"})
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_REASONS = {200: "OK", 400: "Bad Request", 408: "Request Timeout", 414: "URI Too Long", 417: "Expectation Failed",
            429: "Too Many Requests", 431: "Request Header Fields Too Large", 499: "Client Closed Request",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}

# why the client's reading is held (a bit each)
_HOLD_PIPELINE, _HOLD_PENDING, _HOLD_UPSTREAM = 1, 2, 4


class _Refused(Exception):
    """Raised in a parser callback: the request is over a limit; answer `status` with `sentence`."""

    def __init__(self, status: int, reason: str, sentence: str) -> None:
        super().__init__(sentence)
        self.status, self.reason, self.sentence = status, reason, sentence


class _Exchange:
    """One request and its answer. The fields a request usually leaves as they start are class attributes (as
    the guard's Decision does): an instance stores only what differs, and is built once per request."""

    url = b""
    method = b""
    path = ""
    http11 = True
    keep = True
    length = NONE
    head_done = False
    body_done = False
    body_size = 0
    collecting = False  # the decision waits for the body (cost: tokens, a cached or model: fallback)
    expect = False  # the client waits for 100 Continue before it sends the body
    trailers: list[tuple[bytes, bytes]] = []  # noqa: RUF012 - replaced, never appended to, while empty
    parsed: Any = None
    d: Any = None  # the admitted decision, until released
    task: asyncio.Task | None = None  # a decision that may queue, or an upstream connection being opened
    pool: Pool | None = None
    up: Up | None = None
    t0 = 0.0
    up_deadline = INF
    end_at = INF  # the decision's deadline (its class's deadline_s), in loop time
    sent = False  # some of the request has been written upstream
    ttft: float | None = None
    status = 0
    started = False  # the answer's head has gone to the client
    to_client = NONE  # the answer's framing to the client: its length, CHUNKED or NONE (to the close)
    close_after = False
    sent_whole = False  # the whole request is written upstream
    replay: list[bytes] | None = None  # what was written upstream, for one retry (idempotent, small)
    retried = False
    kept: list[bytes] | None = None  # the answer's body for the cached fallback
    kept_size = 0
    done = False
    connecting = False

    def __init__(self, client: Client) -> None:
        self.client = client
        self.head = Head()
        self.body: list[bytes] = []  # received, not yet sent upstream
        self.out: list[bytes] = []  # for the client, written at the end of the upstream read that made it

    # -- the request's body as it comes ---------------------------------------------------------------
    def req_body(self, chunk: bytes) -> None:
        up = self.up
        if up is not None and up.transport is not None and not self.collecting:
            data = (b"%x\r\n" % len(chunk) + chunk + b"\r\n") if self.length == CHUNKED else chunk
            up.transport.write(data)
            self._keep_replay(data)
            return
        self.body.append(chunk)
        self.body_size += len(chunk)
        if self.collecting:
            if self.body_size > self.client.server.max_body:
                self.collecting = False  # too large to read for an estimate: decided without it, streamed on
                self.client.decide(self, OVERSIZE)
        elif self.body_size > PENDING_MAX:
            self.client.hold(_HOLD_PENDING)

    def req_done(self) -> None:
        self.body_done = True
        if self.collecting:
            self.collecting = False
            whole = b"".join(self.body)
            self.body = [whole]
            self.body_size = len(whole)
            self.client.decide(self, parse_json(whole))
            return
        up = self.up
        if up is not None and up.transport is not None and self.length == CHUNKED:
            data = _last_chunk(self.trailers)
            up.transport.write(data)
            self._keep_replay(data)
        if up is not None:
            self.sent_whole = True

    def _keep_replay(self, data: bytes) -> None:
        r = self.replay
        if r is not None:
            r.append(data)
            if len(r) > 64 or sum(map(len, r)) > REPLAY_MAX:
                self.replay = None

    # -- the upstream's answer -----------------------------------------------------------------------
    def up_head(self, up: Up) -> None:
        c = self.client
        self.status = status = up.status
        framing = up.head.length
        if self.method == b"HEAD" or status in (204, 304):
            to_client = NONE
            length = framing if framing >= 0 else NONE
        elif framing >= 0:
            to_client = length = framing
        elif self.http11:
            to_client = length = CHUNKED
        else:
            to_client = length = NONE
            self.close_after = True  # an HTTP/1.0 client: the body runs to the close
        self.to_client = to_client
        close = self.close_after or not self.keep or not self.body_done
        self.close_after = close
        self.out.append(response_head(status, up.reason, up.head.forwarded(), length, close,
                                      keep_alive_header=not close and not self.http11))
        if c.server.keep_cache and status == 200:
            self.kept = []
        self.up_deadline = c.loop.time() + c.server.idle_timeout_s

    def up_body(self, chunk: bytes) -> None:
        if self.ttft is None:
            self.ttft = monotonic() - self.t0
        if self.to_client == CHUNKED:
            self.out += (b"%x\r\n" % len(chunk), chunk, b"\r\n")
        else:
            self.out.append(chunk)
        kept = self.kept
        if kept is not None:
            self.kept_size += len(chunk)
            if self.kept_size <= self.client.server.cache_bytes:
                kept.append(chunk)
            else:
                self.kept = None
        self.up_deadline = self.client.loop.time() + self.client.server.idle_timeout_s

    def flush(self) -> None:
        out = self.out
        if out:
            self.started = True
            t = self.client.transport
            if t is not None:
                t.write(b"".join(out) if len(out) > 1 else out[0])
            out.clear()

    def up_done(self, up: Up) -> None:
        if self.done:
            return
        c = self.client
        if self.to_client == CHUNKED:
            self.out.append(_last_chunk(up.trailers))
        self.flush()
        server = c.server
        if up.keep and self.sent_whole and not up.eof_body and not up.closed:
            up.ex = None
            self.pool.put(up)  # type: ignore[union-attr]
        elif not up.closed:
            up.close()
        self.up = None
        if self.kept is not None and self.d is not None and self.d.degrade == "":
            server.guard.cache_put(cache_key(self.method.decode("latin-1"), self.path, self.parsed), b"".join(self.kept),
                                   (up.head.content_type or b"application/json").decode("latin-1"))
        self.release(self.status)
        c.finish(self)

    def up_failed(self, up: Up, kind: str, detail: str) -> None:
        """The upstream failed this exchange: retried once on a fresh connection when it may be, else a 502
        (or a cut answer when its head has gone to the client). `kind` is counted."""
        if self.done:
            return
        c = self.client
        server = c.server
        up.ex = None
        if not up.closed:
            up.abort()
        self.up = None
        if (kind == "closed" and up.reused and not up.got and not self.retried and self.replay is not None
                and self.sent_whole and self.method in IDEMPOTENT):
            self.retried = True  # a keep-alive connection the upstream closed as the request went out
            server.count("retried")
            self.connect(fresh=True)
            return
        server.count(kind)
        self.out.clear()
        if self.started:
            log.warning("gpuscope guard: the upstream %s broke off an answer (%s); cut off %s %s", self.pool_url,
                        detail, self.method.decode("latin-1"), self.path)
            self.release(502)
            c.cut(self)
            return
        self.release(502)
        c.answer_error(self, 502, f"The upstream {self.pool_url} failed: {detail}.")

    def up_paused(self, paused: bool) -> None:
        if paused:
            self.client.hold(_HOLD_UPSTREAM)
        else:
            self.client.unhold(_HOLD_UPSTREAM)

    def _drop_upstream(self) -> None:
        """Close the upstream connection (never reused: an answer may still be coming), cancel a connect under way,
        and drop what was queued for it."""
        up, self.up = self.up, None
        if up is not None:
            up.abort()
        if self.task is not None and self.connecting:
            self.task.cancel()
            self.task = None
            self.connecting = False
        self.out.clear()

    def up_timeout(self) -> None:
        """The upstream deadline passed: no answer within timeout_s (504), or a gap past idle_timeout_s (cut)."""
        c = self.client
        server = c.server
        self._drop_upstream()
        if self.started:
            server.count("idle_timeout")
            log.warning("gpuscope guard: the upstream %s sent nothing for %g s mid-answer; cut off %s %s",
                        self.pool_url, server.idle_timeout_s, self.method.decode("latin-1"), self.path)
            self.release(504, timed_out=True)
            c.cut(self)
            return
        server.count("timeout")
        self.release(504, timed_out=True)
        c.answer_error(self, 504, f"The upstream {self.pool_url} did not answer within {server.timeout_s:g} s.")

    def past_deadline(self) -> None:
        """The decision's deadline passed with the request still under way: it is stopped there, as its class's
        deadline_s says (`_deadline.stop` decides what it is answered, counts and logs it, and gives the slot back
        through `Guard.expire`: a drop for the limiter). The upstream connection is closed (never reused: its
        answer is still coming), and the client gets a 503 with Retry-After if the request was never sent (its
        upstream connection was still being opened), a 504 if it was sent and no byte of the answer has gone to
        the client, or else the answer's end: the last chunk of a chunked answer (the client's connection stays
        usable), the close of one that runs to the close; an answer framed by its length can only be cut (a clean
        end would say it is whole)."""
        self.end_at = INF
        d, self.d = self.d, None
        if d is None or self.done:
            return
        c = self.client
        s = c.server
        st = stop(s.guard, d, sent=self.sent, started=self.started,
                  what=f"{self.method.decode('latin-1')} {self.path[:200]}", upstream=self.pool_url, lines=s.lines)
        self._drop_upstream()
        self.kept = None  # a cut answer is not one to serve from the cache
        if st.status:
            c._answer(self, st.status, st.headers, st.body())
        elif self.to_client == CHUNKED:
            t = c.transport
            if t is not None:
                t.write(_last_chunk([]))
            if not self.body_done:
                self.close_after = True
            c.finish(self)
        else:
            c.cut(self)

    @property
    def pool_url(self) -> str:
        return self.pool.url if self.pool is not None else self.client.server.upstream

    # -- sending upstream ------------------------------------------------------------------------------
    def connect(self, fresh: bool = False) -> None:
        pool = self.pool
        assert pool is not None
        up = None if fresh else pool.take()
        if up is not None:
            self.send(up)
            return
        self.connecting = True
        self.task = self.client.loop.create_task(self._open(pool))

    async def _open(self, pool: Pool) -> None:
        try:
            up = await pool.open()
        except asyncio.CancelledError:
            raise
        except (OSError, ValueError) as e:  # refused, unreachable, a bad name, a TLS failure
            self.task = None
            self.connecting = False
            if self.done:
                return
            self.client.server.count("connect")
            self.release(502)
            self.client.answer_error(self, 502, f"The upstream {pool.url} cannot be reached: {type(e).__name__}.")
            return
        self.task = None
        self.connecting = False
        if self.done:
            up.close()
            return
        self.send(up)

    def send(self, up: Up) -> None:
        """Write the request (what of it has come) to `up`; the rest follows as it comes."""
        self.up = up
        up.attach(self)
        pool = self.pool
        assert pool is not None
        body = self.body
        length = self.length
        if self.body_done and length == CHUNKED and not self.trailers:
            length = self.body_size  # all here: sent with its length
        parts = [request_head(self.method, pool.prefix + self.url, pool.host_header, self.head.forwarded(), length)]
        if length == CHUNKED:
            for chunk in body:
                parts += (b"%x\r\n" % len(chunk), chunk, b"\r\n")
            if self.body_done:
                parts.append(_last_chunk(self.trailers))
        else:
            parts += body
        data = b"".join(parts) if len(parts) > 1 else parts[0]
        self.length = length
        self.body = []
        self.body_size = 0
        self.client.unhold(_HOLD_PENDING)
        if self.replay is None and not self.retried and self.method in IDEMPOTENT and len(data) <= REPLAY_MAX:
            self.replay = [data]
        elif self.retried and self.replay is not None:
            data = b"".join(self.replay)
        self.sent_whole = self.body_done
        self.sent = True
        up.transport.write(data)  # type: ignore[union-attr]

    def release(self, status: int, timed_out: bool = False) -> None:
        d = self.d
        if d is not None:
            self.d = None
            self.client.server.guard.release(d, status, monotonic() - self.t0, timed_out=timed_out, ttft_s=self.ttft)


def _last_chunk(trailers: list[tuple[bytes, bytes]]) -> bytes:
    if not trailers:
        return b"0\r\n\r\n"
    return b"0\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in trailers) + b"\r\n"


class Client(asyncio.Protocol):
    """One client connection: its requests in order (a pipelined one waits its turn), their deadlines."""

    def __init__(self, server: Any) -> None:  # proxy.ProxyServer (which imports this module)
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[_Exchange] = deque()
        self.parsing: _Exchange | None = None
        self.peer = "?"
        self.held = 0
        self.closed = False
        self.write_paused = False
        self.requests = 0
        self.head_bytes = 0
        self.url_bytes = 0
        # deadlines (loop time): the kit's (phase: header | body | idle) and the client's stall
        self.phase = "header"
        self.deadline = INF
        self.stall_at = INF
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = INF

    # -- connection ------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else "?"
        self._due_phase("header", self.server.limits.header_timeout_s)
        self.server.admit(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for ex in self.queue:
            self._drop(ex, 499)
        self.queue.clear()
        self.server.forget(self)

    def _drop(self, ex: _Exchange, status: int) -> None:
        ex.done = True
        if ex.task is not None and ex.connecting:
            # a connection being opened; a decision under way is left to finish (a task cancelled after its waiter
            # was given a slot would lose the slot): decided() then releases it as a 499
            ex.task.cancel()
            ex.task = None
        if ex.up is not None:
            ex.up.abort()
            ex.up = None
        ex.release(status)

    def idle(self) -> bool:
        """No request in hand and none begun: closing it loses nothing."""
        return not self.queue and self.parsing is None and not self.closed

    def pause_writing(self) -> None:
        self.write_paused = True
        self._due_stall(self.loop.time() + self.server.client_stall_s)
        ex = self.queue[0] if self.queue else None
        if ex is not None and ex.up is not None and ex.up.transport is not None:
            ex.up.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.stall_at = INF
        ex = self.queue[0] if self.queue else None
        if ex is not None and ex.up is not None and ex.up.transport is not None:
            ex.up_deadline = self.loop.time() + self.server.idle_timeout_s
            ex.up.transport.resume_reading()

    def hold(self, why: int) -> None:
        if not self.held and self.transport is not None:
            self.transport.pause_reading()
        self.held |= why

    def unhold(self, why: int) -> None:
        if self.held & why:
            self.held &= ~why
            if not self.held and self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.parsing is not None and not self.parsing.head_done:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # an Upgrade (WebSocket, h2c) is not tunnelled: the request went on without it; nothing after it is read
            for ex in self.queue:
                ex.close_after = True
            self.hold(_HOLD_PIPELINE)
        except httptools.HttpParserCallbackError as e:
            why = e.__context__
            if isinstance(why, _Refused):
                self._refuse(why.status, why.reason, why.sentence)
            else:
                log.error("gpuscope guard: the proxy failed on a request from %s", self.peer, exc_info=why)
                self._refuse(500, "", "The proxy failed on this request.")
        except httptools.HttpParserError as e:
            self._malformed(str(e).rstrip(".") or type(e).__name__)
        else:
            if self.parsing is not None and not self.parsing.head_done and self.head_bytes > MAX_HEAD:
                self._refuse(431, "headers_too_large",
                             f"The request's headers are longer than {MAX_HEAD} bytes in all; send shorter headers.")

    def _malformed(self, why: str) -> None:
        s = self.server
        if s.lines.allow("malformed"):
            log.warning("gpuscope guard: malformed HTTP request from %s answered 400: %s%s", self.peer, why[:200],
                        s.lines.more("malformed"))
        self._refuse(400, "malformed", f"The request is not valid HTTP: {why[:120]}.")

    def _refuse(self, status: int, reason: str, sentence: str) -> None:
        """Answer the request being parsed (or the connection) with a JSON sentence, then close."""
        if reason:
            self.server.stats.count(reason)
        ex = self.parsing
        if ex is not None and ex in self.queue and ex is not self.queue[0]:
            self._close()  # a pipelined request's answer cannot jump the queue
            return
        if ex is not None and ex.d is not None:
            ex.release(499)
        if ex is not None and ex.started:
            self.cut(ex)
            return
        self.answer_and_close(status, sentence)

    def answer_and_close(self, status: int, sentence: str) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            body = self.server.error_body(status, sentence)
            t.write(answer(status, _REASONS.get(status, "Error"), {"Content-Type": "application/json",
                                                                 "Cache-Control": "no-store",
                                                                 GUARD_HEADER: "proxy_error"}, body, close=True))
        self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        t = self.transport
        if t is not None:
            t.close()  # flushes what was written, then closes; connection_lost releases what is left
        for ex in self.queue:
            if not ex.done:
                self._drop(ex, 499)

    def cut(self, ex: _Exchange) -> None:
        """End a half-sent answer by closing the connection: a clean end would tell the client it is whole."""
        ex.done = True
        self._close()

    def force_close(self) -> None:
        self._close()

    # -- deadlines ------------------------------------------------------------------------------------
    def _due_phase(self, phase: str, after_s: float) -> None:
        self.phase = phase
        when = self.deadline = self.loop.time() + after_s
        if when < self.timer_at:
            self._arm(when)

    def _due_stall(self, when: float) -> None:
        self.stall_at = when
        if when < self.timer_at:
            self._arm(when)

    def due_upstream(self, ex: _Exchange, after_s: float) -> None:
        when = ex.up_deadline = self.loop.time() + after_s
        if when < self.timer_at:
            self._arm(when)

    def due_end(self, ex: _Exchange, after_s: float) -> None:
        when = ex.end_at = self.loop.time() + max(0.0, after_s)
        if when < self.timer_at:
            self._arm(when)

    def _arm(self, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_at(when, self._on_timer)
        self.timer_at = when

    def _on_timer(self) -> None:
        self.timer = None
        self.timer_at = INF
        if self.closed:
            return
        now = self.loop.time()
        ex = self.queue[0] if self.queue else None
        if self.write_paused and ex is not None and now >= self.stall_at:
            self._stalled(ex)
            return
        if self.phase and now >= self.deadline:
            self._phase_over()
            if self.closed:
                return
        ex = self.queue[0] if self.queue else None
        if ex is not None and now >= ex.end_at:
            ex.past_deadline()
            if self.closed:
                return
        ex = self.queue[0] if self.queue else None
        if ex is not None and not self.write_paused and now >= ex.up_deadline:
            ex.up_timeout()
            if self.closed:
                return
        ex = self.queue[0] if self.queue else None
        nxt = self.stall_at if self.write_paused else INF
        if self.phase:
            nxt = min(nxt, self.deadline)
        if ex is not None:
            nxt = min(nxt, ex.end_at)
            if not self.write_paused:
                nxt = min(nxt, ex.up_deadline)
        if nxt < INF:
            self._arm(max(nxt, now + 0.001))

    def _phase_over(self) -> None:
        lim = self.server.limits
        phase, self.phase = self.phase, ""
        if phase == "idle":
            self._close()
        elif phase == "header":
            self.server.stats.count("header_timeout")
            if self.parsing is not None or self.head_bytes:  # a request began: say why it ends
                self.answer_and_close(408, f"The request's headers did not arrive within {lim.header_timeout_s:g} s; "
                                           "the connection is closed.")
            else:
                self._close()
        elif phase == "body":
            self.server.stats.count("body_timeout")
            ex = self.parsing
            if ex is not None:
                ex.release(499)  # the client's doing: no failure of the upstream
            if ex is not None and (ex.started or ex is not (self.queue[0] if self.queue else None)):
                self._close()
            else:
                self.answer_and_close(408, f"The request's body did not arrive within {lim.body_timeout_s:g} s of "
                                           "its headers; the connection is closed.")

    def _stalled(self, ex: _Exchange) -> None:
        s = self.server
        s.count("client_stall")
        log.warning("gpuscope guard: a client read nothing for %g s; cut off %s %s and freed its slot",
                    s.client_stall_s, ex.method.decode("latin-1"), ex.path)
        ex.release(499)  # the client stopped reading: the upstream is not to blame
        ex.done = True
        if ex.up is not None:
            ex.up.abort()
            ex.up = None
        self.closed = True
        t = self.transport
        if t is not None:
            t.abort()  # not close(): that would wait to flush what the client never reads

    # -- httptools callbacks ------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        ex = self.parsing = _Exchange(self)
        self.queue.append(ex)
        self.url_bytes = 0
        if len(self.queue) > 1:
            self.hold(_HOLD_PIPELINE)  # one request at a time: read the next once this one is answered
        elif self.phase != "header":
            self._due_phase("header", self.server.limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        ex = self.parsing
        assert ex is not None
        ex.url += url
        if len(ex.url) > MAX_LINE:
            raise _Refused(414, "uri_too_long", f"The request line is longer than {MAX_LINE} bytes; send a shorter URL.")

    def on_header(self, name: bytes, value: bytes) -> None:
        ex = self.parsing
        if len(name) + len(value) > MAX_LINE:
            raise _Refused(431, "headers_too_large",
                           f"A request header is longer than {MAX_LINE} bytes; send shorter headers.")
        if ex.head_done:  # type: ignore[union-attr]
            ex.trailers = [*ex.trailers, (name, value)]  # type: ignore[union-attr]
            return
        n = name.lower()  # Head.add, written out: this runs once per header
        head = ex.head  # type: ignore[union-attr]
        raw = head.raw
        raw[n] = value
        if n in HOP:
            head.hop(n, value)
        else:
            head.parts += (name, b": ", value, b"\r\n")
        if len(raw) > MAX_HEADERS:
            raise _Refused(431, "headers_too_large", "The request has too many headers.")

    def on_headers_complete(self) -> None:
        ex = self.parsing
        assert ex is not None
        p = self.parser
        ex.head_done = True
        self.head_bytes = 0
        self.requests += 1
        ex.method = p.get_method()
        ex.http11 = p.get_http_version() == "1.1"
        ex.keep = p.should_keep_alive()
        ex.length = length = ex.head.length
        if length == NONE or length == 0:
            ex.body_done = length == NONE  # a length of 0 ends at message complete, like any other
            self.phase = ""
        else:
            self._due_phase("body", self.server.limits.body_timeout_s)
        if ex is self.queue[0]:
            self.start(ex)

    def on_body(self, body: bytes) -> None:
        ex = self.parsing
        if ex is not None and not ex.done:
            ex.req_body(body)

    def on_message_complete(self) -> None:
        ex = self.parsing
        self.parsing = None
        if self.phase == "body":
            self.phase = ""
        if ex is not None and not ex.done:
            ex.req_done()

    # -- the exchange ---------------------------------------------------------------------------------
    def start(self, ex: _Exchange) -> None:
        """A request whose head is in and whose turn it is."""
        s = self.server
        raw_path, _, _ = ex.url.partition(b"?")
        path = raw_path.decode("latin-1")
        ex.path = urllib.parse.unquote(path) if "%" in path else path
        value = ex.head.expect
        if value is not None:
            if value.strip().lower() != b"100-continue":
                self._answer(ex, 417, {"Content-Type": "application/json", GUARD_HEADER: "proxy_error"},
                             s.error_body(417, f"This proxy knows no expectation but 100-continue, not "
                                               f"{value.decode('latin-1')[:60]!r}."), close=True)
                return
            ex.expect = ex.http11 and not ex.body_done
        if ex.path == s.metrics_path and ex.method in (b"GET", b"HEAD"):
            self._answer(ex, 200, {"Content-Type": s.metrics_type}, s.metrics())
            return
        if s.needs_body and ex.length != NONE and ex.length != 0:
            if ex.length == CHUNKED or ex.length <= s.max_body:
                ex.collecting = True  # decided once the body is in (or past max_body)
                if ex.expect:
                    ex.expect = False
                    self.transport.write(CONTINUE)  # type: ignore[union-attr]
                if ex.body_done:
                    ex.req_done()
                return
            self.decide(ex, OVERSIZE)  # declared too large to read: charged as the burst, streamed unread
            return
        self.decide(ex, None)

    def decide(self, ex: _Exchange, parsed: Any) -> None:
        s = self.server
        ex.parsed = parsed
        info = RequestInfo(ex.path, Headers(ex.head.raw), parsed, ex.method.decode("latin-1"))
        g = s.guard
        if s.inline and not g.queued_total and g.inflight_total < g._effective_limit():
            # the queueing API would admit or refuse this one at once, as acquire() does: no task for it
            self.decided(ex, g.acquire(info))
            return
        ex.task = self.loop.create_task(self._decide_async(ex, info))

    async def _decide_async(self, ex: _Exchange, info: RequestInfo) -> None:
        d = await self.server.guard.acquire_async(info)
        ex.task = None
        self.decided(ex, d)

    def decided(self, ex: _Exchange, d: Any) -> None:
        s = self.server
        if ex.done or self.closed:
            if d.admitted:
                s.guard.release(d, 499, 0.0)
            return
        if not d.admitted:
            cached = s.guard.cache_get(cache_key(ex.method.decode("latin-1"), ex.path, ex.parsed)) \
                if d.degrade == "cached" else None
            if cached is not None:
                self._answer(ex, 200, {"Content-Type": cached[1], GUARD_HEADER: "cached"}, cached[0])
                return
            status, h, b = refusal(d)
            self._answer(ex, status, h, b)
            return
        ex.d = d
        ex.t0 = monotonic()
        if d.degrade == "model" and ex.body_done and ex.body and ex.parsed is not None:
            new = rewrite_model(ex.body[0] if len(ex.body) == 1 else b"".join(ex.body), d.target)
            ex.body, ex.body_size = [new], len(new)
            if ex.length != NONE:
                ex.length = len(new)
        ex.pool = s.pool(d.target) if d.degrade == "upstream" else s.main_pool
        if ex.expect and not ex.body_done:
            ex.expect = False
            self.transport.write(CONTINUE)  # type: ignore[union-attr]
        self.due_upstream(ex, s.timeout_s)
        if d.deadline_s != INF:  # the guard's monotonic clock, not necessarily the loop's: the time left
            self.due_end(ex, d.deadline_s - s.guard.now())
        ex.connect()

    def _answer(self, ex: _Exchange, status: int, headers: dict[str, str], body: bytes, close: bool = False) -> None:
        """An answer of the proxy's own; the connection closes after it when the request's body is unread."""
        close = close or not ex.keep or not ex.body_done or ex.close_after
        ex.close_after = close
        t = self.transport
        if t is not None:
            t.write(answer(status, _REASONS.get(status, "OK"), headers, b"" if ex.method == b"HEAD" else body, close))
        ex.started = True
        self.finish(ex)

    def answer_error(self, ex: _Exchange, status: int, sentence: str) -> None:
        self._answer(ex, status, {"Content-Type": "application/json", GUARD_HEADER: "proxy_error"},
                     self.server.error_body(status, sentence))

    def finish(self, ex: _Exchange) -> None:
        """The exchange is over: the next request's turn, or the idle deadline, or the close."""
        ex.done = True
        q = self.queue
        if q and q[0] is ex:
            q.popleft()
        if self.closed:
            return
        if ex.close_after or self.server.closing:
            self._close()
            return
        self.unhold(_HOLD_UPSTREAM | _HOLD_PENDING)
        if q:
            nxt = q[0]
            if len(q) <= 1:
                self.unhold(_HOLD_PIPELINE)
            if nxt.head_done:
                self.start(nxt)
            return
        self.unhold(_HOLD_PIPELINE)
        if self.parsing is None:
            self._due_phase("idle", self.server.limits.idle_timeout_s)
