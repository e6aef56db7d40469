"""Rate-limited one-line logging for gpuscope's HTTP servers (the agent, the dashboard, both proxies), so
that no client can fill the log.

aiohttp logs every request it cannot parse (`GET @host/`, a bad header, a line too long) at ERROR with a
full traceback, and asyncio logs every failed accept() (EMFILE: out of open files) with another; under a
flood of either that was 74 MB of log a minute. Here each kind becomes at most one line per interval,
with the count of those not shown:

    runner = web.AppRunner(app, logger=server_logger())    # malformed requests
    loop.set_exception_handler(loop_exception_handler())   # accept errors and other asyncio noise
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["RateLimitedLines", "loop_exception_handler", "server_logger"]


class RateLimitedLines:
    """`allow(kind)`: True at most once per `interval_s` per kind; `unshown(kind)` is the count of those
    refused since, reset when read."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._next_s: dict[str, float] = {}
        self._unshown: dict[str, int] = {}

    def allow(self, kind: str) -> bool:
        now = self.clock()
        if now < self._next_s.get(kind, 0.0):
            self._unshown[kind] = self._unshown.get(kind, 0) + 1
            return False
        if len(self._next_s) > 256:  # kinds come from exception types and messages: bounded
            self._next_s.clear()
        self._next_s[kind] = now + self.interval_s
        return True

    def more(self, kind: str) -> str:
        """' (N more in the last 10 s not shown)', or '' when none was held back."""
        n = self._unshown.pop(kind, 0)
        return f" ({n} more in the last {self.interval_s:g} s not shown)" if n else ""


class _BadRequestLines(logging.Filter):
    """At most one line per `interval_s` for unparsable requests, with the count of those not shown."""

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self.lines = RateLimitedLines(interval_s)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True  # a real server error keeps its traceback
        if not self.lines.allow("malformed"):
            return False
        why = next((ln.strip() for ln in str(exc.message).splitlines() if ln.strip()), "")
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg, record.args = "malformed HTTP request from %s answered %s: %s: %s%s", (
            peer, exc.code, type(exc).__name__, why.rstrip(":")[:200], self.lines.more("malformed"))
        record.exc_info, record.exc_text = None, None
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def server_logger(interval_s: float = 10.0) -> logging.Logger:
    """A child of aiohttp's `aiohttp.server` logger (same handlers) with the malformed-request filter."""
    log = logging.getLogger("aiohttp.server.gpuscope")
    if not any(isinstance(f, _BadRequestLines) for f in log.filters):
        log.addFilter(_BadRequestLines(interval_s))
    return log


def loop_exception_handler(interval_s: float = 10.0, logger: logging.Logger | None = None) -> Callable[..., None]:
    """An asyncio exception handler that writes one WARNING line per kind of failure and interval, without
    a traceback: 'socket.accept() out of system resource: OSError [Errno 24] Too many open files (41 more
    in the last 10 s not shown)'. A kind is the context's message and the exception's type."""
    log = logger or logging.getLogger("gpuscope.http")
    lines = RateLimitedLines(interval_s)

    def handler(loop: Any, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        message = str(context.get("message") or "asyncio reported an error")
        kind = f"{message}|{type(exc).__name__}"
        if not lines.allow(kind):
            return
        what = f": {type(exc).__name__} {exc}" if exc is not None else ""
        log.warning("%s%s%s", message, what[:300], lines.more(kind))

    return handler
