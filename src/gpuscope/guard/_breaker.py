"""A circuit breaker on the upstream: closed -> open -> half-open -> closed, by failure rate over a window.

Closed: outcomes are kept for `window_s`; with at least `min_requests` of them and a failure share at or
over `failure_rate`, it opens. Open: nothing goes upstream for `open_s`. Half-open: up to `probes`
requests at a time go through as probes; `success_threshold` successes close it, one failure reopens it.
A failure is what `failures` names: '5xx' (500-599), '429', '503' (alone, without '5xx'),
'timeout', 'slo' (a success slower than `slo_s`). Times are monotonic seconds from the caller.

    >>> from gpuscope.guard._config import BreakerConfig
    >>> b = Breaker(BreakerConfig(min_requests=2, failure_rate=0.5, open_s=10))
    >>> for t in (0.0, 0.1):
    ...     b.record(b.allow(t), status=500, latency_s=0.1, timed_out=False, now=t)
    >>> b.state, b.allow(1.0), b.allow(11.0), b.state
    ('open', None, 'probe', 'half_open')
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from ._config import BreakerConfig

__all__ = ["Breaker"]

log = logging.getLogger("gpuscope.guard")

STATES = ("closed", "open", "half_open")


class Breaker:
    def __init__(self, cfg: BreakerConfig) -> None:
        self.cfg = cfg
        self.state = "closed"
        # True while allow() would answer 'pass' without looking at the clock (closed, or disabled): the
        # guard's decision path reads this one attribute instead of calling allow()
        self.passing = True
        # told (old, new) on every state change; the event emitter sets it (it only appends to a queue)
        self.on_change: Callable[[str, str], None] | None = None
        self._outcomes: deque[tuple[float, bool]] = deque()
        self._failures = 0
        self._opened_at = 0.0
        self._probes_out = 0
        self._probe_ok = 0
        f = set(cfg.failures)
        self._f5xx, self._f429, self._f503 = "5xx" in f, "429" in f, "503" in f
        self._ftimeout, self._fslo = "timeout" in f, "slo" in f and cfg.slo_s > 0
        # record() runs once per request: the config values it reads, as plain attributes
        self._enabled = cfg.enabled
        self._window_s = cfg.window_s
        self._min_requests = cfg.min_requests
        self._failure_rate = cfg.failure_rate

    def allow(self, now: float) -> str | None:
        """'pass' (closed), 'probe' (half-open, a probe slot taken) or None (open: do not call upstream)."""
        if not self.cfg.enabled or self.state == "closed":
            return "pass"
        if self.state == "open":
            if now - self._opened_at < self.cfg.open_s:
                return None
            self._set("half_open")
            self._probes_out = 0
            self._probe_ok = 0
        if self._probes_out < self.cfg.probes:
            self._probes_out += 1
            return "probe"
        return None

    def cancel(self, token: str | None) -> None:
        """A request that `allow` let through and that never went upstream."""
        if token == "probe":
            self._probes_out = max(0, self._probes_out - 1)

    def retry_after_s(self, now: float) -> float:
        return max(0.0, self.cfg.open_s - (now - self._opened_at)) if self.state == "open" else 1.0

    def is_failure(self, status: int, latency_s: float, timed_out: bool) -> bool:
        if timed_out:
            return self._ftimeout
        if status == 429:
            return self._f429
        if status == 503:
            return self._f503 or self._f5xx
        if 500 <= status <= 599:
            return self._f5xx
        return self._fslo and latency_s > self.cfg.slo_s

    def record(self, token: str | None, status: int, latency_s: float, timed_out: bool, now: float) -> None:
        """The outcome of a request that `allow` let through with `token`."""
        if token is None or not self._enabled:
            return
        if status == 499:  # the client went away or stopped reading: says nothing of the upstream
            if token == "probe":
                self._probes_out = max(0, self._probes_out - 1)
            return
        # a plain success (under 429, in time, no SLO to check) is no failure: is_failure's call spared
        failed = (timed_out or status >= 429 or self._fslo) and self.is_failure(status, latency_s, timed_out)
        if token == "probe":
            self._probes_out = max(0, self._probes_out - 1)
            if self.state != "half_open":
                return
            if failed:
                self._open(now)
            else:
                self._probe_ok += 1
                if self._probe_ok >= self.cfg.success_threshold:
                    self._set("closed")
                    self._outcomes.clear()
                    self._failures = 0
            return
        if self.state != "closed":
            return  # a request admitted before the breaker opened: its outcome is already old news
        q = self._outcomes
        q.append((now, failed))
        if failed:
            self._failures += 1
        cutoff = now - self._window_s
        while q and q[0][0] < cutoff:
            if q.popleft()[1]:
                self._failures -= 1
        if self._failures and len(q) >= self._min_requests and self._failures >= self._failure_rate * len(q):
            self._open(now)

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._set("open")
        self._outcomes.clear()
        self._failures = 0

    def _set(self, state: str) -> None:
        if state != self.state:
            log.warning("gpuscope guard: upstream circuit %s -> %s", self.state, state)
            old, self.state = self.state, state
            self.passing = state == "closed" or not self.cfg.enabled
            if self.on_change is not None:
                try:
                    self.on_change(old, state)
                except Exception:  # noqa: BLE001 - a listener never breaks a decision
                    log.exception("gpuscope guard: the breaker's change listener failed")
