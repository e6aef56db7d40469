"""A logger for aiohttp's HTTP servers (the agent, the guard's proxy) that turns a malformed request into
one short line, rate-limited.

aiohttp logs every request it cannot parse (`GET @host/`, a bad header, a line too long) at ERROR with a
full traceback, so any client can fill the log. It still answers 400; only the log changes:

    runner = web.AppRunner(app, logger=server_logger())    # or web.run_app(app, logger=server_logger())
"""

from __future__ import annotations

import logging
import time

from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["server_logger"]


class _BadRequestLines(logging.Filter):
    """At most one line per `interval_s` for unparsable requests, with the count of those not shown."""

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._next_s = 0.0
        self._unshown = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True  # a real server error keeps its traceback
        now = time.monotonic()
        if now < self._next_s:
            self._unshown += 1
            return False
        self._next_s = now + self.interval_s
        why = next((ln.strip() for ln in str(exc.message).splitlines() if ln.strip()), "")
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        more = f" ({self._unshown} more in the last {self.interval_s:g} s not shown)" if self._unshown else ""
        self._unshown = 0
        record.msg, record.args = "malformed HTTP request from %s answered %s: %s: %s%s", (
            peer, exc.code, type(exc).__name__, why.rstrip(":"), more)
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
