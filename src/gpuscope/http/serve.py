"""Start a gpuscope HTTP server: one way to listen, one sentence when it cannot, one way to stop, and
the defences every server needs against slow or greedy clients.

    served = await start(app, "127.0.0.1", 9471, limits=Limits(), flag="--port")   # ListenError: a sentence
    print(f"listening on {served.url}")
    await served.wait()     # until SIGTERM or SIGINT (or served.stop_soon())
    await served.close()    # graceful: the app's on_shutdown, open requests finish, then cleanup

What `start` adds to aiohttp (the figures: docs/RELIABILITY.md, "Servers under exhaustion"):
- deadlines: the request line and headers within `limits.header_timeout_s` (a slow one gets a 408
  sentence and the connection is closed), the body within `limits.body_timeout_s` of the headers;
- a connection cap below the open-file limit (raised from its soft to its hard value at start): past
  it the longest-idle connection is closed for the newcomer, and when none is idle the newcomer gets a
  503 sentence and is closed, so the server keeps answering;
- a request line or header over 8,190 bytes, or any request that is not HTTP, is answered in the
  server's JSON error form (431/414/400), not aiohttp's plain text;
- malformed requests and asyncio's accept errors are logged as one line per interval with a count;
- every refusal is counted by its reason (`Served.stats`, REFUSALS; the dashboard's streams count theirs
  through `stats_of(request)`): the agent shows them in /api/v1/status and on /metrics;
- HTTPS with `tls=ServerTls(cert, key)` (gpuscope.http.tls: the files re-read when they change, the TLS
  handshake within `limits.header_timeout_s`); without it, beyond loopback, one warning line at start
  when the server says how to turn TLS on (`tls_how`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from .._serverlog import loop_exception_handler, server_logger
from ..catalog import series_key
from ..errors import Unavailable
from .limits import Limits
from .net import format_host
from .responses import error_bytes
from .tls import ServerTls, warn_clear_text

__all__ = ["REFUSALS", "ErrorBody", "ListenError", "Served", "Stats", "connection_cap", "listen_sentence", "raise_fd_limit",
           "start", "stats_of"]

log = logging.getLogger("gpuscope.http")

#: open files kept free for the server's own work (its store, logs, upstream lookups) below the cap
RESERVED_FDS = 64
#: (status, sentence) -> the body bytes of an answer written below aiohttp's handlers
ErrorBody = Callable[[int, str], bytes]

_REASONS = {400: "Bad Request", 408: "Request Timeout", 414: "URI Too Long", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 503: "Service Unavailable", 504: "Gateway Timeout"}


class ListenError(Unavailable):
    """The server cannot listen where it was told: one sentence (exit 1)."""


#: Why a server refused a request or closed a connection, the `reason` of gpuscope_http_refusals_total.
REFUSALS = {
    "header_timeout": "the request line and headers took longer than header_timeout (408, or closed if nothing came)",
    "body_timeout": "the request body took longer than body_timeout (408)",
    "connection_cap": "max_connections were open and none was idle: the newcomer got a 503",
    "idle_evicted": "max_connections were open: the longest-idle one was closed for a newcomer",
    "uri_too_long": "a request line over 8,190 bytes (414)",
    "headers_too_large": "a header over 8,190 bytes, or too many headers (431)",
    "malformed": "a request that is not valid HTTP (400)",
    "streams_per_client": "a live dashboard stream past streams_per_client from one address (429)",
    "streams_server_full": "a live dashboard stream past the server's 32 (503)",
    "stream_stalled": "a live dashboard stream whose client read nothing for stream_stall was cut",
}


@dataclass
class Stats:
    """What the defences did: the connection cap, open connections, the open-file limit, and a count per
    refusal (REFUSALS). Counted on the server's event loop; `status()` and `self_metrics()` may be read
    from any thread."""

    max_connections: int = 0
    open_connections: int = 0
    fd_limit: tuple[int, int] = (0, 0)  # (soft before, soft now)
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSALS, 0))

    def count(self, reason: str) -> None:
        self.refused[reason] += 1

    def status(self) -> dict[str, Any]:
        """The `http` section of a status page."""
        return {"max_connections": self.max_connections, "open_connections": self.open_connections,
                "open_files_limit": self.fd_limit[1], "refused": dict(self.refused)}

    def self_metrics(self) -> dict[str, float]:
        """The same as a server's own series: gpuscope_http_refusals_total{reason} (every reason, 0 included,
        so that rate() works from the start), gpuscope_http_open_connections, gpuscope_http_max_connections."""
        out = {series_key("gpuscope_http_refusals_total", reason=k): float(v) for k, v in self.refused.items()}
        out["gpuscope_http_open_connections"] = float(self.open_connections)
        out["gpuscope_http_max_connections"] = float(self.max_connections)
        return out


def stats_of(request: web.BaseRequest) -> Stats | None:
    """The Stats of the server answering `request`: None when it was not started by `start` (a test client)."""
    kit = getattr(request.protocol, "_kit", None)
    return kit.stats if isinstance(kit, _Kit) else None


def raise_fd_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit (capped at 1,048,576); (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):  # a container may refuse: keep what we have
            return soft, soft
        return soft, want
    return soft, soft


def connection_cap(limits: Limits, fd_soft: int) -> int:
    """`limits.max_connections`, lowered so that the connections' files fit below the open-file limit."""
    room = max(1, (fd_soft - RESERVED_FDS) // max(1, limits.fds_per_connection))
    return max(1, min(limits.max_connections, room))


def raw_answer(status: int, body: bytes) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for answers written straight to the socket."""
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + body


class Connections:
    """The connection cap, for any server's connections (the kit's own, the guard proxy's): past
    `stats.max_connections` the longest-idle one is closed for the newcomer, and with none idle the newcomer
    gets a 503 sentence. A connection has idle(), force_close() and answer_and_close(status, message)."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.conns: dict[Any, None] = {}  # oldest first

    def admit(self, c: Any) -> None:
        conns = self.conns
        conns[c] = None
        self.stats.open_connections = len(conns)
        if len(conns) <= self.stats.max_connections:
            return
        victim = next((x for x in conns if x is not c and x.idle()), None)
        if victim is not None:  # the longest-idle connection makes room: a new request is about to come
            self.stats.count("idle_evicted")
            self.forget(victim)
            victim.force_close()
            return
        self.stats.count("connection_cap")
        self.forget(c)
        c.answer_and_close(503, f"This server has {self.stats.max_connections} connections open, its limit, and "
                                "none is idle; retry in a few seconds.")

    def forget(self, c: Any) -> None:
        self.conns.pop(c, None)
        self.stats.open_connections = len(self.conns)


@dataclass
class _Kit:
    limits: Limits
    error_body: ErrorBody
    stats: Stats
    connections: Connections = field(init=False)

    def __post_init__(self) -> None:
        self.connections = Connections(self.stats)

    def admit(self, h: _Handler) -> None:
        self.connections.admit(h)

    def forget(self, h: _Handler) -> None:
        self.connections.forget(h)


class _Handler(RequestHandler):
    """aiohttp's connection handler with the header and body deadlines, the connection cap and JSON errors."""

    _kit: _Kit | None = None
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _header_bytes = 0
    _payload: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._kit = getattr(self._manager, "kit", None)
        if self._kit is None:
            return
        self._arm_header_timer()
        self._kit.admit(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_timers()
        if self._kit is not None:
            self._kit.forget(self)
        super().connection_lost(exc)

    def idle(self) -> bool:
        """No request being answered and none whose body is still coming: closing it loses nothing."""
        return (not self._request_in_progress and not self._messages and not self._force_close
                and (self._payload is None or self._payload.is_eof()))

    def data_received(self, data: bytes) -> None:
        before = self._request_count
        super().data_received(data)
        kit = self._kit
        if kit is None or self._force_close or self.transport is None:
            return
        if self._request_count > before:  # a request's headers are complete
            self._header_bytes = 0
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            self._payload = self._messages[-1][1] if self._messages else None
            if self._payload is not None and not self._payload.is_eof() and self._body_timer is None:
                self._body_timer = self._loop.call_later(kit.limits.body_timeout_s, self._body_late)
        elif data:
            if self._payload is not None and not self._payload.is_eof():
                pass  # body bytes
            elif self._header_timer is None and not self._request_in_progress and not self._messages:
                self._arm_header_timer()  # the first bytes of the next request on a kept-alive connection
            self._header_bytes += len(data)
        if self._body_timer is not None and (self._payload is None or self._payload.is_eof()):
            self._body_timer.cancel()
            self._body_timer = None

    def _arm_header_timer(self) -> None:
        assert self._kit is not None
        self._header_timer = self._loop.call_later(self._kit.limits.header_timeout_s, self._headers_late)

    def _cancel_timers(self) -> None:
        for t in (self._header_timer, self._body_timer):
            if t is not None:
                t.cancel()
        self._header_timer = self._body_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._kit is None or self.transport is None or self._request_in_progress or self._messages:
            return
        self._kit.stats.count("header_timeout")
        if self._header_bytes:  # a request began: say why it ends (a connection that sent nothing just closes)
            self.answer_and_close(408, f"The request's headers did not arrive within "
                                       f"{self._kit.limits.header_timeout_s:g} s; the connection is closed.")
        else:
            self.force_close()

    def _body_late(self) -> None:
        self._body_timer = None
        if self._kit is None or self.transport is None or self._payload is None or self._payload.is_eof():
            return
        self._kit.stats.count("body_timeout")
        # A handler reading the body gets a ConnectionResetError now, the exception it gets for a client that
        # left (a read after the close below would raise a bare RuntimeError instead).
        self._payload.set_exception(ConnectionResetError("The request body did not arrive in time."))
        req = self._current_request
        if req is not None and req.writer is not None and req.writer.output_size == 0:
            self.answer_and_close(408, f"The request's body did not arrive within {self._kit.limits.body_timeout_s:g} s "
                                       "of its headers; the connection is closed.")
        else:
            self.force_close()  # an answer has begun: cutting it is all that is left

    def answer_and_close(self, status: int, sentence: str) -> None:
        """Write a whole JSON answer straight to the socket and close it once flushed."""
        kit = self._kit
        transport = self.transport
        if transport is not None and not transport.is_closing():
            body = kit.error_body(status, sentence) if kit is not None else error_bytes(status, sentence)
            transport.write(raw_answer(status, body))
        self.force_close()  # transport.close() flushes what was written, then closes

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse (or a handler that raised past every
        middleware), in the server's JSON form; the log line stays aiohttp's (rate-limited by
        server_logger)."""
        if isinstance(exc, ConnectionError) and (self.transport is None or self._force_close):
            # the client left, or a deadline closed the connection under a handler reading the body: no
            # one reads this answer, and it is no server error worth a traceback
            self.log_debug("a handler saw its connection close: %r", exc)
        elif self._request_count == 1 and isinstance(exc, BadHttpMethod):
            self.logger.debug("Error handling request from %s", request.remote, exc_info=exc)
        else:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        status, sentence = _error_sentence(status, exc, self.max_line_size, self.max_field_size)
        kit = self._kit
        if kit is not None and isinstance(exc, HttpProcessingError):  # the client's request, not a server error
            kit.stats.count({414: "uri_too_long", 431: "headers_too_large"}.get(status, "malformed"))
        body = kit.error_body(status, sentence) if kit is not None else error_bytes(status, sentence)
        resp = web.Response(status=status, body=body, content_type="application/json",
                            headers={"Cache-Control": "no-store"})
        resp.force_close()
        return resp


def _error_sentence(status: int, exc: BaseException | None, max_line: int, max_field: int) -> tuple[int, str]:
    if isinstance(exc, LineTooLong):
        line = exc.args[0] if exc.args else b""
        if isinstance(line, bytearray):  # aiohttp's parser keeps the request line in a bytearray
            return 414, f"The request line is longer than {max_line} bytes; send a shorter URL."
        return 431, f"A request header is longer than {max_field} bytes; send shorter headers."
    if isinstance(exc, HttpProcessingError):
        why = next((ln.strip() for ln in str(exc.message).splitlines() if ln.strip()), "").rstrip(":.")
        if "too many headers" in why.lower():
            return 431, "The request has too many headers."
        return 400, f"The request is not valid HTTP: {why[:120] or type(exc).__name__}."
    if status == 504:
        return 504, "The server did not answer in time."
    if status >= 500:
        return status, f"The server failed to answer: {type(exc).__name__ if exc else 'an error'}."
    return status, "The request is not valid HTTP."


class _KitServer(Server):
    kit: _Kit

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    def __init__(self, app: web.Application, kit: _Kit, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._kit = kit

    async def _make_server(self) -> Server:
        base = await super()._make_server()
        server = _KitServer(base.request_handler, request_factory=base.request_factory,
                            handler_cancellation=base.handler_cancellation, loop=base._loop, **base._kwargs)
        server.kit = self._kit
        return server


@dataclass
class Served:
    """A started server: where it listens, what its defences did, and how to stop it."""

    runner: web.AppRunner
    host: str
    port: int
    stats: Stats
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    tls: ServerTls | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{format_host(self.host)}:{self.port}"

    def stop_soon(self) -> None:
        self.stopping.set()

    async def wait(self, signals: bool = True) -> None:
        """Until SIGTERM or SIGINT (when `signals` and on the main thread) or stop_soon()."""
        loop = asyncio.get_running_loop()
        installed = []
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    loop.add_signal_handler(sig, self.stopping.set)
                    installed.append(sig)
                except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                    pass
        try:
            await self.stopping.wait()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    async def close(self) -> None:
        if self.tls is not None:
            self.tls.unwatch()
        await self.runner.cleanup()


class _Site(web.TCPSite):
    """aiohttp's TCPSite with a deadline on the TLS handshake (asyncio's default is 60 s: a client that
    stalls in it would hold its socket six times longer than one that stalls in its headers)."""

    def __init__(self, *args: Any, handshake_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handshake_timeout_s = handshake_timeout_s

    async def start(self) -> None:
        if self._ssl_context is None:
            return await super().start()
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port,
            ssl_handshake_timeout=self._handshake_timeout_s)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port


async def start(app: web.Application, host: str, port: int, *, limits: Limits | None = None,
                flag: str = "--port", error_body: ErrorBody = error_bytes, handler_cancellation: bool = False,
                shutdown_timeout_s: float = 60.0, tls: ServerTls | None = None, tls_how: str | None = None) -> Served:
    """Serve `app` on host:port (port 0: a free one, see .port) with the kit's defences; ListenError with
    one sentence naming `flag` when it cannot listen. `error_body` writes the server's JSON error form.
    `tls`: HTTPS, its files watched while it serves; `tls_how` (e.g. "--tls-cert and --tls-key"): beyond
    loopback without `tls`, one warning line naming it."""
    limits = (limits or Limits()).checked()
    before, after = raise_fd_limit()
    if after != before:
        log.info("open-file limit raised from %d to %d", before, after)
    stats = Stats(fd_limit=(before, after))
    stats.max_connections = connection_cap(limits, after)
    if stats.max_connections < limits.max_connections:
        log.warning("at most %d connections (not %d): the open-file limit is %d", stats.max_connections,
                    limits.max_connections, after)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(loop_exception_handler(limits.log_interval_s))
    kit = _Kit(limits, error_body, stats)
    runner = _Runner(app, kit, access_log=None, handle_signals=False, logger=server_logger(limits.log_interval_s),
                     keepalive_timeout=limits.idle_timeout_s, handler_cancellation=handler_cancellation,
                     shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    site = _Site(runner, host, port, reuse_address=True, backlog=1024, ssl_context=tls.context if tls else None,
                 handshake_timeout_s=limits.header_timeout_s)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ListenError(listen_sentence(host, port, flag, e)) from None
    bound = next((a[1] for a in runner.addresses if isinstance(a, tuple)), port)
    if tls is not None:
        tls.watch(loop)
    elif tls_how:
        warn_clear_text(host, tls, tls_how)
    return Served(runner, host, bound, stats, tls=tls)


def listen_sentence(host: str, port: int, flag: str, e: OSError) -> str:
    """The ListenError sentence for an OSError of bind/listen on host:port (a server not built on `start` too)."""
    where = f"{format_host(host)}:{port}"
    if e.errno == errno.EADDRINUSE:
        return f"Port {port} on {host} is already in use; choose another with {flag}."
    if e.errno == errno.EACCES:
        return f"Cannot listen on {where}: permission denied (ports below 1024 need privileges); choose another with {flag}."
    if e.errno == errno.EADDRNOTAVAIL:
        return f"Cannot listen on {where}: no interface of this machine has the address {host}."
    if isinstance(e, socket.gaierror):
        return f"Cannot listen on {where}: the name {host!r} does not resolve."
    return f"Cannot listen on {where}: {(e.strerror or str(e)).rstrip('.')}."
