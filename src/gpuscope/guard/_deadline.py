"""A request past its class's `deadline_s`: what every data path does there (the proxy, the ASGI and the aiohttp
middlewares), decided once here so that they say and count the same thing.

The deadline counts from the admission (`Decision.deadline_s`). Where the request stands decides the answer:
- `not_sent`: admitted, but it never reached the service (the proxy still opening its upstream connection, a
  middleware whose request resumed from the queue after its deadline): 503 with Retry-After, never sent;
- `no_answer`: the service has it and no byte of the answer has gone to the client: stopped there (the proxy
  closes its upstream connection, a middleware cancels the handler) and answered 504;
- `mid_answer`: the answer is streaming: it ends there, cleanly when its framing allows (the last chunk, the
  close of a close-delimited one), else the connection is cut (a clean end would say an answer framed by its
  length is whole).
The slot goes back through `Guard.expire` (a drop for the adaptive limit); each stop is counted in
`Guard.deadline_total[reason]` (gpuscope_guard_proxy_deadline_total{reason} on /guard/metrics, whichever data
path stopped it) and logged, one line per log interval with the count of those not shown.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import Protocol

from ._core import DEADLINE_REASONS, Decision, Guard
from ._http import GUARD_HEADER

__all__ = ["DEADLINES", "Stop", "stop"]

log = logging.getLogger("gpuscope.guard")

#: what gpuscope_guard_proxy_deadline_total{reason} counts: requests stopped at their class's deadline_s
DEADLINES = {
    "not_sent": "admitted but not yet at the service (no upstream connection in time, or resumed from the queue "
                "past it): answered 503 with Retry-After, never sent",
    "no_answer": "at the service, no byte of the answer to the client yet: stopped there (the upstream connection "
                 "closed, or the handler cancelled), answered 504",
    "mid_answer": "its answer streaming: ended there (the last chunk, or the close; a cut when framed by its length)",
}

assert tuple(DEADLINES) == DEADLINE_REASONS


class Lines(Protocol):
    """A rate limit on log lines (gpuscope._serverlog.RateLimitedLines is one)."""

    def allow(self, kind: str) -> bool: ...

    def more(self, kind: str) -> str: ...


class _GuardLines:
    """The guard's own: one line per interval_s, with the count of those held back (for the middlewares, which
    have no HTTP kit of their own)."""

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._next_s = -math.inf
        self._unshown = 0

    def allow(self, kind: str) -> bool:
        now = self.clock()
        if now < self._next_s:
            self._unshown += 1
            return False
        self._next_s = now + self.interval_s
        return True

    def more(self, kind: str) -> str:
        n, self._unshown = self._unshown, 0
        return f" ({n} more in the last {self.interval_s:g} s not shown)" if n else ""


class Stop:
    """What to do with a request stopped at its deadline: `reason` (a key of DEADLINES); for not_sent and
    no_answer the answer to give (`status`, `headers`, `sentence`, `body()`); for mid_answer status 0: the data
    path ends the answer under way in its own terms."""

    __slots__ = ("reason", "status", "headers", "sentence", "klass", "budget_s")

    def __init__(self, reason: str, status: int, headers: dict[str, str], sentence: str, klass: str,
                 budget_s: float) -> None:
        self.reason, self.status, self.headers, self.sentence = reason, status, headers, sentence
        self.klass, self.budget_s = klass, budget_s

    def body(self) -> bytes:
        """The answer's body in the OpenAI error form, as the guard's refusals are."""
        return json.dumps({"error": {"message": self.sentence, "type": "deadline", "code": self.status,
                                     "class": self.klass}}).encode()


def stop(guard: Guard, d: Decision, sent: bool, started: bool, what: str = "", upstream: str = "",
         lines: Lines | None = None) -> Stop:
    """The request of `d` is stopped at its deadline: `sent` whether it reached the service, `started` whether a
    byte of the answer went to the client. Takes the slot back (unless the guard already did), counts and logs
    the stop, and says what to answer. `what` names the request in the log line (method and path); `upstream`
    the proxy's upstream URL, named in the answer's sentence; `lines` the data path's log rate limit (the
    guard's own, one line per 10 s, without one)."""
    guard.expire(d)
    budget = guard.cfg.classes[d.class_index].deadline_s or 0.0
    service = f"the upstream {upstream}" if upstream else "the service"
    if not sent:
        reason, done = "not_sent", "answered 503, never sent"
        retry = str(max(1, math.ceil(guard._concurrency_retry_s())))
        where = f"for a connection to {service}" if upstream else f"before {service} could take it"
        st = Stop(reason, 503, {"Content-Type": "application/json", "Retry-After": retry, GUARD_HEADER: "deadline"},
                  f"The request waited its {d.klass} class's deadline_s of {budget:g} s {where} and was not sent; "
                  f"retry after {retry} s.", d.klass, budget)
    elif not started:
        reason, done = "no_answer", "stopped, answered 504"
        st = Stop(reason, 504, {"Content-Type": "application/json", GUARD_HEADER: "deadline"},
                  f"{service[0].upper()}{service[1:]} did not answer within the {d.klass} class's deadline_s of "
                  f"{budget:g} s; the request was stopped there.", d.klass, budget)
    else:
        reason, done = "mid_answer", "its answer ended there"
        st = Stop(reason, 0, {}, "", d.klass, budget)
    with guard._lock:
        guard.deadline_total[reason] += 1
    if lines is None:
        lines = guard._deadline_lines
        if lines is None:
            lines = guard._deadline_lines = _GuardLines(10.0, guard.now)
    if lines.allow("deadline"):
        log.warning("gpuscope guard: %s passed its %s class's deadline_s (%g s): %s%s", what[:200] or "a request",
                    d.klass, budget, done, lines.more("deadline"))
    return st
