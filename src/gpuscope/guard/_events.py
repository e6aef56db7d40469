"""The guard's state changes in the gpuscope agent's event stream (POST /api/v1/events, kind 'guard').

Changes, not decisions: the breaker opening, going half-open and closing (reported by the breaker the
instant it moves); and, looked at once a second by the emitter's own thread, a class starting to be shed
(with the counts per reason over that second) and stopping (after QUIET_CHECKS seconds without a shed,
with the episode's total), the adaptive limit moving by more than LIMIT_MOVE_RATIO since the last report
or reaching its minimum, the GPU signal going stale or fresh again, and Redis fallback entered or left.

Events wait in a bounded queue (the oldest dropped first, counted in `dropped_total`) and go out at most
once a second, MAX_BATCH per request, from a daemon thread. Nothing here blocks or raises into the
decision path: the breaker's hook appends to a deque, and every failure (no agent, a 4xx, a timeout) is
logged once per outage and swallowed. A batch the agent could not take (no answer, 429, 5xx) is kept
for the next second; one it refused as malformed (other 4xx) is dropped and counted.

On when `signals.agent` is set and `signals.events` is true; the token is read from
`signals.agent_token_file`, else GPUSCOPE_TOKEN, else the agent's default data directory.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["EventEmitter"]

log = logging.getLogger("gpuscope.guard")

MAX_QUEUE = 1000
MAX_BATCH = 100           # the agent's per-request cap
INTERVAL_S = 1.0
POST_TIMEOUT_S = 2.0
LIMIT_MOVE_RATIO = 0.2    # a limit change smaller than this since the last report is noise, not news
QUIET_CHECKS = 5          # checks without a shed before a class's shedding is reported as stopped
_BREAKER_SEVERITY = {"open": "critical", "half_open": "warning", "closed": "info"}


class EventEmitter:
    """Posts a guard's state changes to a gpuscope agent. `check()` and `flush()` are what the thread runs
    each second; tests may call them directly."""

    def __init__(self, guard: Any, url: str | None = None, token: str | None = None, *,
                 interval_s: float = INTERVAL_S, max_queue: int = MAX_QUEUE, source: str | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.guard = guard
        self.url = (url if url is not None else guard.cfg.signals.agent).rstrip("/") + "/api/v1/events"
        self._token = token
        self._token_read = token is not None
        self.interval_s = interval_s
        self.source = source or f"gpuscope-guard@{socket.gethostname()}:{os.getpid()}"
        self.wall_clock = wall_clock
        self.queue: deque[dict[str, Any]] = deque(maxlen=max_queue)
        self.dropped_total = 0
        self.sent_total = 0
        self.failed_posts_total = 0
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # what the last check saw
        self._shed_seen: dict[tuple[int, str], int] = dict(guard.shed_total)
        self._shedding: dict[int, list[float]] = {}  # class index -> [started (wall s), count, quiet checks]
        self._limit_ref = float(guard.limiter.limit)
        self._at_min = False
        self._gpu_state = "none"
        self._fallback = bool(getattr(guard.buckets, "fallback_active", False))
        guard.breaker.on_change = self._on_breaker

    @staticmethod
    def wanted(guard: Any) -> bool:
        s = guard.cfg.signals
        return bool(s.agent) and s.events

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpuscope-guard-events", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = POST_TIMEOUT_S + 1.0) -> None:
        """Stop the thread after one last check and send (waits at most timeout_s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self.guard.breaker.on_change == self._on_breaker:
            self.guard.breaker.on_change = None

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.interval_s)
            try:
                self.check()
                self.flush()
            except Exception:  # noqa: BLE001 - the emitter must never take the guard down
                log.exception("gpuscope guard: the event emitter failed; it keeps going")
            if stopping:
                return

    # -- producing ---------------------------------------------------------------------------------
    def emit(self, etype: str, severity: str, message: str, labels: dict[str, str] | None = None,
             time_s: float | None = None) -> None:
        """Queue one event (never blocks, never raises); the oldest is dropped when the queue is full."""
        try:
            q = self.queue
            if len(q) == q.maxlen:
                self.dropped_total += 1
            q.append({"kind": "guard", "type": etype, "severity": severity, "message": message[:500],
                      "source": self.source, "labels": labels or {},
                      "time": self.wall_clock() if time_s is None else time_s})
        except Exception:  # noqa: BLE001
            pass

    def _on_breaker(self, old: str, new: str) -> None:
        # called by Breaker._set, inside the decision path: a dict and a deque append, nothing more
        open_s = self.guard.cfg.breaker.open_s
        why = {"open": f"nothing goes upstream for {open_s:g} s", "half_open": "probing the upstream",
               "closed": "the upstream answers again"}.get(new, "")
        self.emit(f"breaker_{new}", _BREAKER_SEVERITY.get(new, "warning"),
                  f"upstream circuit {old} -> {new}: {why}", {"from": old, "to": new})

    def check(self) -> None:
        """Compare the guard's state with the last check and queue an event for each change."""
        g = self.guard
        self._check_shedding(g)
        self._check_limit(g)
        state = g.limiter.gpu_signal_state(g.now())
        if self._gpu_state == "fresh" and state in ("stale_hold", "stale_ignored"):
            self.emit("gpu_signal_stale", "warning", f"the GPU signal from {g.cfg.signals.agent} is stale: the limit "
                      f"is held for {g.cfg.signals.stale_hold_s:g} s, then the GPU signal is ignored", {"state": state})
        elif self._gpu_state in ("stale_hold", "stale_ignored") and state == "fresh":
            self.emit("gpu_signal_fresh", "info", "the GPU signal is fresh again", {"state": state})
        self._gpu_state = state
        fallback = getattr(g.buckets, "fallback_active", None)
        if isinstance(fallback, bool) and fallback != self._fallback:
            url = getattr(g.buckets, "url", "")
            if fallback:
                self.emit("redis_fallback_entered", "warning", f"Redis {url} is unreachable: rate buckets are local, "
                          "each replica taking its share")
            else:
                self.emit("redis_fallback_left", "info", f"Redis {url} answers again: rate buckets are shared")
            self._fallback = fallback

    def _check_shedding(self, g: Any) -> None:
        shed = dict(g.shed_total)
        names = g.cfg.class_names()
        delta: dict[int, dict[str, int]] = {}
        for (idx, reason), n in shed.items():
            d = n - self._shed_seen.get((idx, reason), 0)
            if d > 0:
                delta.setdefault(idx, {})[reason] = d
        self._shed_seen = shed
        now = self.wall_clock()
        for idx, name in enumerate(names):
            reasons = delta.get(idx)
            ep = self._shedding.get(idx)
            if reasons:
                n = sum(reasons.values())
                if ep is None:
                    self._shedding[idx] = [now, n, 0]
                    by = ", ".join(f"{r} {c}" for r, c in sorted(reasons.items()))
                    self.emit("shedding_started", "warning", f"shedding class {name}: {n} requests in the last "
                              f"{self.interval_s:g} s ({by})",
                              {"class": name, "shed": str(n), **{r: str(c) for r, c in reasons.items()}})
                else:
                    ep[1] += n
                    ep[2] = 0
            elif ep is not None:
                ep[2] += 1
                if ep[2] >= QUIET_CHECKS:
                    del self._shedding[idx]
                    self.emit("shedding_stopped", "info", f"stopped shedding class {name}: {int(ep[1])} requests "
                              f"shed over {now - ep[0]:.0f} s", {"class": name, "shed": str(int(ep[1]))})

    def _check_limit(self, g: Any) -> None:
        limit = float(g.limiter.limit)
        lo = float(g.cfg.controller.min_limit)
        ref = self._limit_ref
        if ref > 0 and abs(limit - ref) > LIMIT_MOVE_RATIO * ref:
            down = limit < ref
            self.emit("limit_changed", "warning" if down else "info",
                      f"concurrency limit {'down' if down else 'up'} from {ref:.1f} to {limit:.1f}",
                      {"from": f"{ref:.1f}", "to": f"{limit:.1f}"})
            self._limit_ref = limit
        if limit <= lo + 1e-9 and not self._at_min:
            self._at_min = True
            self.emit("limit_at_min", "warning", f"concurrency limit at its minimum {lo:g}: the upstream is slow "
                      "or the GPU overloaded", {"limit": f"{limit:.1f}"})
        elif limit > lo * (1 + LIMIT_MOVE_RATIO):
            self._at_min = False

    # -- sending -----------------------------------------------------------------------------------
    def flush(self) -> bool:
        """Send what is queued (MAX_BATCH per request); True when the queue was emptied. Never raises."""
        while self.queue:
            batch: list[dict[str, Any]] = []
            while self.queue and len(batch) < MAX_BATCH:
                batch.append(self.queue.popleft())
            outcome = self._post(batch)
            if outcome == "sent":
                self.sent_total += len(batch)
            elif outcome == "refused":
                self.dropped_total += len(batch)
                return False
            else:
                self._requeue(batch)
                return False
        return True

    def _requeue(self, batch: list[dict[str, Any]]) -> None:
        room = self.queue.maxlen - len(self.queue) if self.queue.maxlen is not None else len(batch)
        kept = batch[len(batch) - max(0, room):] if room < len(batch) else batch
        self.dropped_total += len(batch) - len(kept)
        self.queue.extendleft(reversed(kept))

    def _post(self, batch: list[dict[str, Any]]) -> str:
        """'sent', 'retry' (no answer, 429, 5xx: the agent may take it later) or 'refused' (another 4xx)."""
        if not self._token_read:
            self._token_read = True
            self._token = _find_token(self.guard.cfg.signals.agent_token_file)
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        req = urllib.request.Request(self.url, data=json.dumps(batch).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=POST_TIMEOUT_S) as r:
                r.read()
            if self._failing:
                log.warning("gpuscope guard: the agent at %s takes events again", self.url)
                self._failing = False
            return "sent"
        except urllib.error.HTTPError as e:
            self.failed_posts_total += 1
            try:
                why = json.loads(e.read()).get("error", e.reason)
            except (ValueError, AttributeError, OSError):
                why = e.reason
            self._fail(f"the agent at {self.url} answered {e.code}: {why}")
            return "retry" if e.code == 429 or e.code >= 500 else "refused"
        except Exception as e:  # noqa: BLE001 - URLError, timeouts, resets: the agent is away
            self.failed_posts_total += 1
            self._fail(f"no agent answers at {self.url} ({type(e).__name__}); events wait in a queue of "
                       f"{self.queue.maxlen}")
            return "retry"

    def _fail(self, msg: str) -> None:
        if not self._failing:  # once per outage, not once a second
            self._failing = True
            log.warning("gpuscope guard: cannot post events: %s", msg)


def _find_token(path: str) -> str | None:
    if path:
        try:
            return open(os.path.expanduser(path), encoding="utf-8").read().strip() or None
        except OSError as e:
            log.warning("gpuscope guard: the agent token file %s cannot be read (%s); posting without a token",
                        path, e.strerror)
            return None
    try:
        from ..http.auth import find_token  # GPUSCOPE_TOKEN, then the agent's default data directory

        return find_token(None, None)
    except Exception:  # noqa: BLE001
        return None
