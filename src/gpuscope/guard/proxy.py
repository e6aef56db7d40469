"""`gpuscope guard proxy`: the guard in front of any HTTP service, as a reverse proxy.

    server = await serve(Guard(load_config("guard.yaml")), "http://127.0.0.1:8000", "127.0.0.1", 8090)
    print(server.url); await server.wait(); await server.close()

Every request (any method, any path) is decided; admitted ones are forwarded to the upstream over a
keep-alive connection with their body and headers (hop-by-hop ones dropped), and the answer goes back as it
comes, so server-sent events reach the client token by token. Latency is measured to the last byte, TTFT
to the first. The data path is asyncio Protocols with llhttp parsing both sides (_exchange.py,
_upstream.py), on uvloop where installed: no task, no request object and no header multidict per
request (the aiohttp proxy before spent 0.35-0.63 ms of CPU on one; BENCHMARKS.md, issue 18).

HTTP/1.1 as the proxy speaks it:
- `Connection: close` is honoured both ways: a client's ends its connection after the answer, an upstream's
  ends that upstream connection; HTTP/1.0 clients get keep-alive only when they ask for it.
- An answer without length or chunking (HTTP/1.0, SSE without chunking) runs to the upstream's close and
  is whole; it goes to an HTTP/1.1 client chunked, so the client's connection stays open.
- A request that fails on a reused upstream connection before any byte of the answer came (the upstream
  closed it as the request went out) is sent once more on a fresh connection when its method is idempotent
  and it is small enough to have been kept (64 KiB); counted in gpuscope_guard_proxy_retries_total.
- `Expect: 100-continue`: the proxy answers `100 Continue` itself once the request is admitted (a refused
  one never sends its body); any other expectation is a 417 sentence. Interim 1xx answers of the upstream
  are dropped, and trailers go through both ways when the next hop's message is chunked (dropped for an
  HTTP/1.0 client). An Upgrade (WebSocket, h2c) is not tunnelled: the request goes on without it.
- Upstream failures are counted by kind (gpuscope_guard_proxy_errors_total) and answered with one JSON
  sentence: cannot be reached or a malformed answer, a body longer than its length, a close before the
  answer: 502; no answer head within `breaker.timeout_s`: 504 (both count for the circuit breaker). Once
  the answer streams only the gap between two reads is timed (`breaker.idle_timeout_s`): a stalled or
  broken-off answer is cut by closing the client's connection (a clean end would tell it the answer is
  whole) and counts as a timeout or a 502.
- A class's `deadline_s` stops its requests there (`Decision.deadline_s`, counted from the admission): one
  still waiting for its upstream connection is answered 503 with Retry-After and never sent; one sent whose
  answer has not begun is cut (the upstream connection closed, never reused) and answered 504; one whose
  answer streams ends there: the last chunk of a chunked answer, the close of one that runs to the close, a
  cut connection for one framed by its length. The slot goes back as a drop for the limiter
  (`Guard.expire`), so the adaptive limit reacts; each is counted in gpuscope_guard_proxy_deadline_total
  {reason} and logged (one line per log interval, with the count of those not shown). A client that reads nothing for `breaker.client_stall_s` while an
  answer waits for it is cut off (aborted) and its slot freed, released as a 499 (not the upstream's fault).

The exhaustion defences are the HTTP kit's (gpuscope.http.limits): the request line and headers within
header_timeout, the body within body_timeout of them (408 sentences), a kept-alive connection closed after
idle_timeout, the connection cap below the open-file limit (the longest-idle connection is closed for a
newcomer, else a 503 sentence), a request line or header over 8,190 bytes a 414/431 sentence and a request
that is not HTTP a 400 sentence; each refusal is counted by reason (gpuscope.http.serve.REFUSALS) and shown
with the guard's metrics at /guard/metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time
from collections.abc import Coroutine
from typing import Any

from .._serverlog import RateLimitedLines, loop_exception_handler
from ..http.limits import Limits
from ..http.net import format_host
from ..http.serve import Connections, ListenError, Stats, connection_cap, listen_sentence, raise_fd_limit
from ._core import Guard
from ._deadline import DEADLINES
from ._exchange import Client
from ._http import needs_body
from ._metrics import CONTENT_TYPE, render
from ._signals import SignalPoller
from ._upstream import Pool

__all__ = ["DEADLINES", "ERRORS", "ProxyServer", "error_body", "run", "serve"]

log = logging.getLogger("gpuscope.guard")

#: what gpuscope_guard_proxy_errors_total{kind} counts
ERRORS = {
    "connect": "the upstream could not be reached (502)",
    "timeout": "no answer head within breaker.timeout_s (504)",
    "idle_timeout": "an answer stalled past breaker.idle_timeout_s between two reads (cut)",
    "malformed": "an answer that is not valid HTTP, or a 101 (502, or cut once streaming)",
    "closed": "the upstream closed the connection before its answer's head (502)",
    "short_body": "the upstream closed the connection before its answer's body was complete (cut)",
    "long_body": "an answer with more bytes than its length, or bytes after it (502, or cut once streaming)",
    "client_stall": "a client read nothing for breaker.client_stall_s while its answer waited (aborted)",
}


def error_body(status: int, message: str) -> bytes:
    """The proxy's own errors in the OpenAI form: {"error": {"message": sentence, "type": "proxy_error"}}."""
    return json.dumps({"error": {"message": message, "type": "proxy_error", "code": status}}).encode()


class ProxyServer:
    """A listening guard proxy: where it listens, what its defences did, how to stop it."""

    metrics_path = "/guard/metrics"
    metrics_type = CONTENT_TYPE

    def __init__(self, guard: Guard, upstream: str, limits: Limits, loop: asyncio.AbstractEventLoop) -> None:
        self.guard = guard
        self.upstream = upstream.rstrip("/")
        self.limits = limits
        self.loop = loop
        cfg = guard.cfg
        br = cfg.breaker
        self.timeout_s = br.timeout_s
        self.idle_timeout_s = br.idle_timeout_s
        self.client_stall_s = br.client_stall_s
        self.keep_cache = br.fallback == "cached"
        self.cache_bytes = br.cache_bytes
        self.needs_body = needs_body(guard)
        self.max_body = cfg.classify.max_body_bytes
        # the inline decision when the buckets are local (Redis buckets are asked over the network: async)
        self.inline = not hasattr(guard.buckets, "atake")
        self.error_body = error_body
        self.lines = RateLimitedLines(limits.log_interval_s)
        self.stats = Stats()
        self.errors = dict.fromkeys(ERRORS, 0)
        self.retries = 0
        self.connections = Connections(self.stats)
        self.conns = self.connections.conns  # oldest first
        self.main_pool = Pool(self.upstream, loop)
        self._pools: dict[str, Pool] = {self.upstream: self.main_pool}
        self.closing = False
        self.stopping = asyncio.Event()
        self.poller = SignalPoller(guard)
        self._server: asyncio.AbstractServer | None = None
        self.host = ""
        self.port = 0
        self.tls = False

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{format_host(self.host)}:{self.port}"

    def pool(self, url: str) -> Pool:
        """The pool of another upstream (the breaker's `upstream:URL` fallback)."""
        url = url.rstrip("/")
        p = self._pools.get(url)
        if p is None:
            p = self._pools[url] = Pool(url, self.loop)
        return p

    @property
    def deadlines(self) -> dict[str, int]:
        """Requests stopped at their class's deadline_s, by reason (the guard's count: `_deadline.DEADLINES`)."""
        return self.guard.deadline_total

    def count(self, kind: str) -> None:
        if kind == "retried":
            self.retries += 1
        else:
            self.errors[kind] += 1

    # -- the connection cap (the HTTP kit's, for this server's connections) ---------------------------
    def admit(self, c: Client) -> None:
        self.connections.admit(c)

    def forget(self, c: Client) -> None:
        self.connections.forget(c)

    # -- /guard/metrics ------------------------------------------------------------------------------
    def metrics(self) -> bytes:
        out = [render(self.guard).decode(),
               "# HELP gpuscope_guard_proxy_errors_total Upstream and client failures the proxy met, by kind.\n"
               "# TYPE gpuscope_guard_proxy_errors_total counter\n"]
        out += (f'gpuscope_guard_proxy_errors_total{{kind="{k}"}} {v}\n' for k, v in self.errors.items())
        out.append("# HELP gpuscope_guard_proxy_retries_total Requests sent again on a fresh upstream connection.\n"
                   "# TYPE gpuscope_guard_proxy_retries_total counter\n"
                   f"gpuscope_guard_proxy_retries_total {self.retries}\n")
        kinds = {"gpuscope_http_refusals_total": ("counter", "Requests refused or connections closed by the HTTP "
                                                             "kit's defences, by reason."),
                 "gpuscope_http_open_connections": ("gauge", "Client connections open."),
                 "gpuscope_http_max_connections": ("gauge", "The connection cap in force.")}
        said = set()
        for key, v in self.stats.self_metrics().items():
            name = key.partition("{")[0]
            if name not in said:
                said.add(name)
                out.append(f"# HELP {name} {kinds[name][1]}\n# TYPE {name} {kinds[name][0]}\n")
            out.append(f"{key} {v:g}\n")
        return "".join(out).encode()

    # -- start and stop ---------------------------------------------------------------------------------
    async def start(self, host: str, port: int, flag: str, ssl: Any = None) -> None:
        before, after = raise_fd_limit()
        self.stats.fd_limit = (before, after)
        self.stats.max_connections = connection_cap(self.limits, after)
        if self.stats.max_connections < self.limits.max_connections:
            log.warning("at most %d connections (not %d): the open-file limit is %d", self.stats.max_connections,
                        self.limits.max_connections, after)
        self.loop.set_exception_handler(loop_exception_handler(self.limits.log_interval_s))
        try:
            # ssl: an ssl.SSLContext (gpuscope.http.tls.ServerTls.context), its handshake within header_timeout
            self._server = await self.loop.create_server(
                lambda: Client(self), host, port, reuse_address=True, backlog=1024, ssl=ssl,
                ssl_handshake_timeout=self.limits.header_timeout_s if ssl is not None else None)
        except OSError as e:
            raise ListenError(listen_sentence(host, port, flag, e)) from None
        sock = self._server.sockets[0]
        self.host, self.port, self.tls = host, sock.getsockname()[1], ssl is not None
        for s in self._server.sockets:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.poller.start()

    def stop_soon(self) -> None:
        self.stopping.set()

    async def wait(self, signals: bool = True) -> None:
        """Until SIGTERM or SIGINT (when `signals` and on the main thread) or stop_soon()."""
        installed = []
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    self.loop.add_signal_handler(sig, self.stopping.set)
                    installed.append(sig)
                except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                    pass
        try:
            await self.stopping.wait()
        finally:
            for sig in installed:
                self.loop.remove_signal_handler(sig)

    async def close(self, grace_s: float = 60.0) -> None:
        """Stop listening, let the requests under way finish (up to grace_s), then close everything."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for c in list(self.conns):
            if c.idle():
                c.force_close()
        deadline = time.monotonic() + grace_s
        while any(c.queue for c in self.conns) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for c in list(self.conns):
            c.force_close()
        for p in self._pools.values():
            p.close()
        await self.poller.stop()
        aclose = getattr(self.guard.buckets, "aclose", None)
        if aclose is not None:
            await aclose()
        if self._server is not None:
            await self._server.wait_closed()


async def serve(guard: Guard, upstream: str, host: str = "127.0.0.1", port: int = 0, *, limits: Limits | None = None,
                flag: str = "--listen", ssl: Any = None) -> ProxyServer:
    """Start the proxy on host:port (port 0: a free one, see .port); ListenError with one sentence naming `flag`
    when it cannot listen. `ssl`: an ssl.SSLContext to serve HTTPS with."""
    server = ProxyServer(guard, upstream, (limits or Limits(fds_per_connection=2)).checked(),
                         asyncio.get_running_loop())
    await server.start(host, port, flag, ssl)
    return server


def run(main: Coroutine[Any, Any, int]) -> int:
    """Run the proxy's main coroutine on uvloop when it is installed (a third of the standard loop's time per
    request), else on the standard loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if hasattr(asyncio, "Runner"):  # 3.11+
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    uvloop.install()  # pragma: no cover - 3.10
    return asyncio.run(main)
