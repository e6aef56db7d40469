"""The guard: one decision per request, in microseconds, with no I/O unless Redis buckets are configured.

    >>> from gpuscope.guard import Guard, RequestInfo, parse_config
    >>> g = Guard(parse_config({"classes": [{"name": "interactive", "share": 0.9}, {"name": "batch", "share": 0.1}]}))
    >>> d = g.acquire(RequestInfo(path="/v1/completions", headers={"x-priority": "batch"}))
    >>> d.admitted, d.klass
    (True, 'batch')
    >>> g.release(d, status=200, latency_s=0.12)

Order of a decision: classify -> breaker (open: degrade or 503) -> concurrency (can it run now?) ->
buckets (class and tenant GCRA; over: 429 with Retry-After from the bucket) -> admit, or (async API only)
wait in the bounded priority queue until a slot frees or the class's deadline passes.

Concurrency with guaranteed shares: a request runs only while fewer than the limit are in flight, whatever
its class, so the shares never take the total past the limit. Each class's share is a number of reserved
slots of the limit in force (`_shares.reserved_slots`: they scale with the limit, add up to at most
floor(limit), and a class with a share has at least one when the limit allows). What a class does not use
is borrowable by the others; a slot borrowed is not taken back mid-request, so the share is the class's
first claim on the slots that free: when a slot frees, waiting classes under their reserved slots are
served first, then the highest priority. (Netflix concurrency-limits' percentage partitions admit a class
under its share even with the total at the limit: the shares then add to it.) When the queue is full, a
newcomer evicts the newest waiter of a lower class, or is shed itself: the lowest priority is shed first.

Deadlines (a class's `deadline_s`): an admitted request that still holds its slot that long after its
admission gives the slot back (`Decision.expired`): a drop for the limiter, no outcome for the breaker (a slow
upstream is the limiter's business; a probe that never answers does fail), and its later release does
nothing. So a request stuck in flight (a hung handler, an answer behind a backlog) never holds the limit
for ever. Checked on every decision and release, and by a timer while requests wait in the queue; a data
path that stops the request at its deadline (the proxy and both middlewares do, through `_deadline.stop`) gives
the slot back the same way with `expire`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ._breaker import Breaker
from ._bucket import _EPS_S, LocalBuckets
from ._classify import Classifier, RequestInfo
from ._config import GuardConfig
from ._limit import AdaptiveLimit, GpuSignal
from ._shares import reserved_slots

__all__ = ["Decision", "Guard"]

log = logging.getLogger("gpuscope.guard")

_REASONS = ("rate", "tenant_rate", "concurrency", "queue_full", "queue_timeout", "evicted", "gpu_saturated",
            "breaker_open")  # why a decision was shed (Decision.reason)
DEADLINE_REASONS = ("not_sent", "no_answer", "mid_answer")  # where a request stood when stopped (_deadline.DEADLINES)
_REFRESH_S = 0.25  # how often the decision path re-checks the GPU signal's staleness


class Decision:
    """What the guard decided. Release every admitted decision exactly once (`Guard.release`).

    `status` is the HTTP status to answer with when not admitted (429, or 503 with the circuit open);
    `reason` is admitted | rate | tenant_rate | concurrency | queue_full | queue_timeout | evicted |
    gpu_saturated | breaker_open; `degrade` is '' | 'cached' | 'model' | 'upstream' (the breaker's fallback
    in force) with `target` the cheaper model or the other upstream.

    The fields an admitted decision shares with every other are class attributes, and the guard's inline
    path builds its decisions from per-class subclasses (`_decision_types`) that also fix the class and the
    refusal: a decision is built once per request, and each field stored costs about as much as a dict
    lookup. A plain class rather than a slotted one for that reason: an instance stores only what differs."""

    FIELDS = ("admitted", "klass", "tenant", "cost", "status", "reason", "retry_after_s", "queued_s", "degrade",
              "target", "class_index", "start_s", "probe", "released", "deadline_s", "expired", "inflight_at")

    admitted = True
    klass = ""
    tenant = ""
    cost = 1.0
    status = 200
    reason = "admitted"
    retry_after_s = 0.0
    queued_s = 0.0
    degrade = ""
    target = ""
    class_index = 0
    start_s = 0.0
    probe: str | None = "pass"
    released = False
    deadline_s = math.inf  # monotonic time past which the guard takes the slot back (its class's deadline_s)
    expired = False  # the guard took the slot back at deadline_s; a data path may stop the request too
    inflight_at = 0  # requests in flight when it was admitted (what it found ahead of it)

    def __init__(self, admitted: bool, klass: str, tenant: str, cost: float, class_index: int = 0,
                 start_s: float = 0.0, reason: str = "admitted", released: bool = False) -> None:
        self.admitted = admitted
        self.klass = klass
        self.tenant = tenant
        self.cost = cost
        self.class_index = class_index
        self.start_s = start_s
        self.reason = reason
        self.released = released

    def __repr__(self) -> str:
        return (f"Decision({self.reason}, class={self.klass!r}, tenant={self.tenant!r}, cost={self.cost:g}, "
                f"status={self.status}, retry_after_s={self.retry_after_s:.3f})")

    def retry_after_header(self) -> str:
        """Retry-After in whole seconds (at least 1), as HTTP wants it."""
        return str(max(1, math.ceil(self.retry_after_s)))


_new_decision = object.__new__


def _decision_types(names: list[str]) -> list[tuple[type[Decision], type[Decision], type[Decision]]]:
    """Per class: the Decision subclasses of an admission, a class-bucket refusal and a tenant-bucket refusal,
    with every field but the tenant, the time and Retry-After fixed as class attributes, so the inline path
    stores two or three fields per decision instead of fourteen."""
    out = []
    for i, name in enumerate(names):
        fixed = {"klass": name, "class_index": i, "__module__": __name__, "__qualname__": "Decision"}
        refused = dict(fixed, admitted=False, status=429, released=True, probe=None)
        out.append((type("Decision", (Decision,), fixed),
                    type("Decision", (Decision,), dict(refused, reason="rate")),
                    type("Decision", (Decision,), dict(refused, reason="tenant_rate"))))
    return out


class _Waiter:
    __slots__ = ("fut", "loop", "decision", "handle")

    def __init__(self, fut: asyncio.Future, loop: asyncio.AbstractEventLoop, decision: Decision) -> None:
        self.fut = fut
        self.loop = loop
        self.decision = decision
        self.handle: asyncio.TimerHandle | None = None


class Guard:
    """Admission control for one service. Thread-safe; the async API queues, the sync one never waits."""

    def __init__(self, cfg: GuardConfig, clock: Callable[[], float] = time.monotonic, buckets: Any = None) -> None:
        self.cfg = cfg
        self._clock = clock
        now = clock()
        self._names = cfg.class_names()
        n = len(self._names)
        self._shares = [c.share for c in cfg.classes]
        self._timeouts = [c.queue_timeout_s for c in cfg.classes]
        self._deadlines = [c.deadline_s or 0.0 for c in cfg.classes]
        # per class with a deadline, its admitted decisions in admission (so deadline) order; released ones
        # leave when they reach the front
        self._held: list[deque[Decision]] = [deque() for _ in range(n)]
        self._next_expiry = math.inf
        self._expiry_timer: asyncio.TimerHandle | None = None
        self.expired_total = [0] * n
        # requests a data path stopped at their deadline, by where they stood (_deadline.stop), and its log lines
        self.deadline_total = dict.fromkeys(DEADLINE_REASONS, 0)
        self._deadline_lines: Any = None  # made by _deadline.stop when first needed
        self._expiry_logged_at = -math.inf
        self._expiry_logged_n = 0
        self._classifier = Classifier(cfg)
        self._class_cache = self._classifier.cache
        self._class_header = cfg.classify.header
        self._tenant_header = cfg.classify.tenant_header
        self._tokens = cfg.classify.cost == "tokens"  # the cost needs the body: classify() does it all
        self.limiter = AdaptiveLimit(cfg.controller, cfg.signals, now)
        self._adaptive = cfg.controller.mode != "fixed"
        self.breaker = Breaker(cfg.breaker)
        self.buckets: Any = buckets if buckets is not None else LocalBuckets(cfg.classes)
        self._async_buckets = hasattr(self.buckets, "atake")
        self._local_buckets = isinstance(self.buckets, LocalBuckets)
        self._take = self.buckets.take
        self._lock = threading.Lock()
        self.inflight = [0] * n
        self.inflight_total = 0
        # the most in flight at once since the start, per class and in all (what the shares and the limit allowed)
        self.inflight_peak = [0] * n
        self.inflight_total_peak = 0
        self._reserved = [0] * n  # reserved slots per class at the limit _reserved_at (see _shares)
        self._reserved_at = math.nan
        self._queues: list[deque[_Waiter]] = [deque() for _ in range(n)]
        self.queued_total = 0
        self._next_refresh = now + _REFRESH_S
        fb = cfg.breaker.fallback
        self._degrade, self._target = (("model", fb[6:]) if fb.startswith("model:") else
                                       ("upstream", fb[9:]) if fb.startswith("upstream:") else
                                       ("cached", "") if fb == "cached" else ("", ""))
        # metrics
        self.admitted_total = [0] * n
        self.queued_count_total = [0] * n
        # refusals per (class, reason) as list items: a list item is the cheapest counter to bump per request
        self._shed_n = [0] * (n * len(_REASONS))
        self.queue_wait_sum_s = [0.0] * n
        self.queue_wait_count = [0] * n
        self._cache: dict[str, tuple[bytes, str]] = {}
        # acquire()'s inline paths: cost 1 (a token cost needs the body parsed), local or Redis buckets, no
        # deadline to keep
        if not self._tokens and not any(self._deadlines):
            if self._local_buckets:
                self.acquire = _inline_acquire(self)  # type: ignore[method-assign,assignment]
            elif hasattr(self.buckets, "take"):
                self.acquire = _inline_acquire_shared(self)  # type: ignore[method-assign,assignment]

    @classmethod
    def from_config(cls, cfg: GuardConfig) -> Guard:
        """A guard with Redis-shared buckets when the config names a Redis, local ones otherwise."""
        if cfg.redis.url:
            from ._redis import RedisBuckets

            return cls(cfg, buckets=RedisBuckets(cfg))
        return cls(cfg)

    @property
    def shed_total(self) -> dict[tuple[int, str], int]:
        """Refusals so far per (class index, reason), for the reasons that occurred."""
        r = len(_REASONS)
        return {(i // r, _REASONS[i % r]): v for i, v in enumerate(self._shed_n) if v}

    # -- the decision --------------------------------------------------------------------------
    def acquire(self, info: RequestInfo) -> Decision:
        """Decide now (never waits): admitted, or shed with status and Retry-After. Never raises.

        With cost 1 the guard replaces this method by `_inline_acquire`'s function (`_inline_acquire_shared`'s
        with Redis buckets), which decides the common case itself, with the same result, and hands the rest to
        `_acquire`."""
        try:
            return self._acquire(info, self._clock())
        except Exception:  # noqa: BLE001 - the guard runs inside the user's service and must not break it
            log.exception("gpuscope guard: decision failed; admitting this request")
            return Decision(True, "", "", 1.0, released=True)

    def _acquire(self, info: RequestInfo, now: float) -> Decision:
        d = self._pre(info, now)
        if d.reason != "admitted":
            return d
        idx = d.class_index
        if self._local_buckets:  # no I/O: the whole decision under one lock
            with self._lock:
                if not self._runnable(idx):
                    return self._shed(d, "concurrency", self._concurrency_retry_s())
                wait, why = self._take(idx, d.tenant, d.cost, now, self.limiter.rate_factor)
                if wait:
                    return self._shed(d, why, wait)
                self._admit(d)
            return d
        return self._acquire_shared(d, now)

    def _acquire_shared(self, d: Decision, now: float) -> Decision:
        """The rest of a decision with shared (Redis) buckets: their I/O outside the lock."""
        idx = d.class_index
        lock = self._lock
        lock.acquire()
        try:
            if not self._runnable(idx):
                return self._shed(d, "concurrency", self._concurrency_retry_s())
        finally:
            lock.release()
        wait, why = self.buckets.take(idx, d.tenant, d.cost, now, self.limiter.rate_factor)  # Redis: I/O
        lock.acquire()
        try:
            if wait:
                return self._shed(d, why, wait)  # under the lock: it counts the refusal
            if not self._runnable(idx):  # another thread took the slot meanwhile
                return self._shed(d, "concurrency", self._concurrency_retry_s())
            self._admit(d)
        finally:
            lock.release()
        return d

    async def acquire_async(self, info: RequestInfo) -> Decision:
        """Decide, waiting in the priority queue (up to the class's queue_timeout_s) when the limit is full."""
        try:
            d = self._pre(info, self._clock())
            if d.reason != "admitted":
                return d
            if self._async_buckets:
                wait, why = await self.buckets.atake(d.class_index, d.tenant, d.cost, d.start_s,
                                                     self.limiter.rate_factor)
            else:
                wait, why = self.buckets.take(d.class_index, d.tenant, d.cost, d.start_s, self.limiter.rate_factor)
            if wait:
                return self._shed(d, why, wait)
            loop = asyncio.get_running_loop()
            with self._lock:
                if self._runnable(d.class_index) and (self._guaranteed(d.class_index)
                                                      or not self._higher_waiting(d.class_index)):
                    self._admit(d)
                    return d
                w = self._enqueue(d, loop)
                if w is None:
                    return d  # shed: queue full of higher-priority work
            return await w.fut
        except Exception:  # noqa: BLE001
            log.exception("gpuscope guard: decision failed; admitting this request")
            return Decision(True, "", "", 1.0, released=True)

    def _pre(self, info: RequestInfo, now: float) -> Decision:
        # Runs once per request: one clock read, the class from the classifier's cache (a dict lookup on
        # (path, class header)), the breaker by one attribute while it passes, and the Decision's fields
        # stored directly (a slotted object without the __init__ call: measurably cheaper at this rate).
        if now >= self._next_refresh:
            self._next_refresh = now + _REFRESH_S
            self.limiter.refresh(now)
        if now >= self._next_expiry:
            with self._lock:
                self._expire(now)
        h = info.headers
        if info.klass is None and not self._tokens:
            idx = self._class_cache.get((info.path, h.get(self._class_header)), -1)
            if idx < 0:
                idx = self._classifier.index_of(info.path, h.get(self._class_header))
            tenant = info.tenant
            if tenant is None:
                tenant = h.get(self._tenant_header, "")
            cost = 1.0
        else:
            idx, tenant, cost = self._classifier.classify(info)
        d = _new_decision(Decision)
        d.admitted = True
        d.klass = self._names[idx]
        d.tenant = tenant
        d.cost = cost
        d.class_index = idx
        d.start_s = now
        d.reason = "admitted"
        d.released = False
        d.status = 200
        d.retry_after_s = 0.0
        d.queued_s = 0.0
        d.degrade = ""
        d.target = ""
        if self.breaker.passing:
            d.probe = "pass"
        else:
            token = self.breaker.allow(now)
            if token is None:
                d.probe = None
                if self._degrade in ("model", "upstream"):
                    d.degrade, d.target = self._degrade, self._target
                else:
                    d.degrade = self._degrade
                    return self._shed(d, "breaker_open", self.breaker.retry_after_s(now), status=503)
            d.probe = token
        if self.limiter.rate_factor <= 0.0:
            return self._shed(d, "gpu_saturated", self.cfg.signals.interval_s * self.cfg.controller.consecutive)
        return d

    def _effective_limit(self) -> float:
        f = self.limiter.rate_factor
        return self.limiter.limit * f if f < 1.0 else self.limiter.limit

    def _runnable(self, idx: int) -> bool:
        """Room under the limit (for any class: a share is a first claim on freed slots, never one over it)."""
        limit = self.limiter.limit
        f = self.limiter.rate_factor
        if f < 1.0:
            limit *= f
        return self.inflight_total < limit

    def reserved(self) -> list[int]:
        """The slots reserved per class at the limit in force (recomputed when it moves)."""
        limit = self._effective_limit()
        if limit != self._reserved_at:
            self._reserved = reserved_slots(self._shares, limit)
            self._reserved_at = limit
        return self._reserved

    def _guaranteed(self, idx: int) -> bool:
        return self.inflight[idx] < self.reserved()[idx]

    def _higher_waiting(self, idx: int) -> bool:
        return self.queued_total > 0 and any(self._queues[i] for i in range(idx + 1))

    def _admit(self, d: Decision) -> None:
        idx = d.class_index
        d.inflight_at = total = self.inflight_total
        n = self.inflight[idx] = self.inflight[idx] + 1
        self.inflight_total = total = total + 1
        if n > self.inflight_peak[idx]:
            self.inflight_peak[idx] = n
        if total > self.inflight_total_peak:
            self.inflight_total_peak = total
        self.admitted_total[idx] += 1
        deadline = self._deadlines[idx]
        if deadline:
            d.deadline_s = self._clock() + deadline
            self._held[idx].append(d)
            if d.deadline_s < self._next_expiry:
                self._next_expiry = d.deadline_s

    def _expire(self, now: float) -> None:
        """Take back the slots of requests past their deadline, then serve the queue. Holds the lock."""
        nxt = math.inf
        freed = False
        for held in self._held:
            while held and (held[0].released or held[0].deadline_s <= now):
                d = held.popleft()
                if d.released:
                    continue
                self._take_back(d, now)
                freed = True
            if held and held[0].deadline_s < nxt:
                nxt = held[0].deadline_s
        self._next_expiry = nxt
        if freed:
            if now >= self._expiry_logged_at + 10.0:  # at most one line per 10 s, with the count since the last
                log.warning("gpuscope guard: %d requests held their slot past their class's deadline_s; slots taken "
                            "back", sum(self.expired_total) - self._expiry_logged_n)
                self._expiry_logged_at, self._expiry_logged_n = now, sum(self.expired_total)
            if self.queued_total > 0:
                self._dispatch()

    def _take_back(self, d: Decision, now: float) -> None:
        """An admitted request's slot back at its deadline: a drop for the limiter. Holds the lock."""
        idx = d.class_index
        d.released = True
        d.expired = True
        inflight = self.inflight_total
        self.inflight[idx] -= 1
        self.inflight_total -= 1
        self.expired_total[idx] += 1
        if d.probe == "probe":  # a probe that never answered is a failed one (and frees its probe slot)
            self.breaker.record("probe", 504, self._deadlines[idx], True, now)
        if self._adaptive:
            self.limiter.observe(self._deadlines[idx], inflight, True, now, d.inflight_at)

    def expire(self, d: Decision) -> bool:
        """Take an admitted request's slot back now, as at its deadline: for a data path that stopped the request
        there (the proxy's timer may fire a little before the guard's clock says so). Counted in expired_total,
        a drop for the limiter, no outcome for the breaker but a probe's failure; its later release does
        nothing. False when it was released (or expired) already."""
        try:
            with self._lock:
                if d.released or not d.admitted:
                    return False
                self._take_back(d, self._clock())
                if self.queued_total > 0:
                    self._dispatch()
            return True
        except Exception:  # noqa: BLE001
            log.exception("gpuscope guard: expire failed")
            return False

    def _arm_expiry(self, loop: asyncio.AbstractEventLoop) -> None:
        """A timer at the next deadline while requests wait: with no arrival and no release nothing else looks.
        Holds the lock."""
        if self._next_expiry == math.inf or (self._expiry_timer is not None and not self._expiry_timer.cancelled()):
            return
        self._expiry_timer = loop.call_later(max(0.0, self._next_expiry - self._clock()), self._expiry_tick, loop)

    def _expiry_tick(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._expiry_timer = None
            self._expire(self._clock())
            if self.queued_total > 0:
                self._arm_expiry(loop)

    def _shed(self, d: Decision, reason: str, retry_after_s: float, status: int = 429) -> Decision:
        d.admitted = False
        d.reason = reason
        d.status = status
        d.retry_after_s = retry_after_s
        d.released = True
        self._shed_n[d.class_index * len(_REASONS) + _REASONS.index(reason)] += 1
        if reason != "breaker_open":
            if d.probe == "probe":
                self.breaker.cancel(d.probe)  # a shed probe never reached the upstream: its slot is free again
            d.probe = None
        return d

    def _concurrency_retry_s(self) -> float:
        # a slot frees in about one typical latency; the gradient's latest window mean is the best estimate
        return max(0.1, self.limiter.typical_latency_s() or 1.0)

    # -- the queue ---------------------------------------------------------------------------------
    def _enqueue(self, d: Decision, loop: asyncio.AbstractEventLoop) -> _Waiter | None:
        idx = d.class_index
        if self.queued_total >= self.cfg.queue_max:
            victim = self._newest_lower_waiter(idx)
            if victim is None:
                self._shed(d, "queue_full", self._concurrency_retry_s())
                return None
            self._drop_waiter(victim, "evicted")
        w = _Waiter(loop.create_future(), loop, d)
        self._queues[idx].append(w)
        self.queued_total += 1
        self.queued_count_total[idx] += 1
        timeout = self._timeouts[idx]
        w.handle = loop.call_later(timeout, self._on_timeout, w)
        if self._next_expiry != math.inf:
            self._arm_expiry(loop)
        return w

    def _newest_lower_waiter(self, idx: int) -> _Waiter | None:
        for i in range(len(self._queues) - 1, idx, -1):
            q = self._queues[i]
            while q:
                w = q[-1]
                if not w.fut.done():
                    return w
                q.pop()  # its client went away (cancelled)
                self.queued_total -= 1
        return None

    def _drop_waiter(self, w: _Waiter, reason: str) -> None:
        q = self._queues[w.decision.class_index]
        try:
            q.remove(w)
        except ValueError:
            return
        self.queued_total -= 1
        if w.handle is not None:
            w.handle.cancel()
        d = w.decision
        self._shed(d, reason, self._concurrency_retry_s())
        d.queued_s = self._clock() - d.start_s
        w.loop.call_soon_threadsafe(_resolve, w.fut, d, None)

    def _on_timeout(self, w: _Waiter) -> None:
        with self._lock:
            if not w.fut.done():
                self._drop_waiter(w, "queue_timeout")

    def _dispatch(self) -> None:
        """Give freed slots to waiters: classes under their share first, then by priority. Holds the lock."""
        while self.queued_total > 0:
            w = self._pick()
            if w is None:
                return
            d = w.decision
            self._queues[d.class_index].popleft()
            self.queued_total -= 1
            if w.handle is not None:
                w.handle.cancel()
            self._admit(d)
            d.queued_s = self._clock() - d.start_s
            self.queue_wait_sum_s[d.class_index] += d.queued_s
            self.queue_wait_count[d.class_index] += 1
            w.loop.call_soon_threadsafe(_resolve, w.fut, d, self)

    def _pick(self) -> _Waiter | None:
        for q in self._queues:
            while q and q[0].fut.done():  # its client went away (cancelled)
                q.popleft()
                self.queued_total -= 1
        if self.inflight_total >= self._effective_limit():
            return None
        reserved = self.reserved()
        for i, q in enumerate(self._queues):
            if q and self.inflight[i] < reserved[i]:
                return q[0]
        for q in self._queues:
            if q:
                return q[0]
        return None

    # -- outcomes ----------------------------------------------------------------------------------
    def release(self, d: Decision, status: int = 200, latency_s: float | None = None, timed_out: bool = False,
                ttft_s: float | None = None) -> None:
        """The end of an admitted request: its HTTP status, latency (default: since admission), whether it
        timed out, and its time to first token. Releasing twice, or a shed decision, does nothing."""
        try:
            if d.released:
                return
            d.released = True
            now = self._clock()
            if latency_s is None:
                latency_s = now - d.start_s - d.queued_s
            sample = ttft_s if ttft_s is not None and self.cfg.controller.signal == "ttft" else latency_s
            dropped = timed_out or status in (429, 503)
            lock = self._lock
            lock.acquire()  # acquire/release rather than `with`: half the cost of the with-statement on 3.11
            try:
                inflight = self.inflight_total
                self.inflight[d.class_index] -= 1
                self.inflight_total -= 1
                self.breaker.record(d.probe, status, latency_s, timed_out, now)
                # a fixed limit takes no samples (the call spared); a client's 499 says nothing of the service,
                # and an error's latency (other than an overload's 503) nothing of its capacity
                if self._adaptive and status != 499 and (status < 500 or dropped):
                    self.limiter.observe(sample, inflight, dropped, now, d.inflight_at)
                if now >= self._next_expiry:
                    self._expire(now)
                if self.queued_total > 0:
                    self._dispatch()
            finally:
                lock.release()
        except Exception:  # noqa: BLE001
            log.exception("gpuscope guard: release failed")

    def _slot_back(self, idx: int) -> None:
        """A dispatched waiter that had already gone (cancelled): its slot returns."""
        with self._lock:
            self.inflight[idx] -= 1
            self.inflight_total -= 1
            self._dispatch()

    def observe_gpu(self, signal: GpuSignal) -> None:
        """Feed a GPU/service reading (the poller does this; tests and custom integrations may too)."""
        with self._lock:
            self.limiter.observe_signal(signal)
            self._dispatch()

    # -- the cached-response fallback -------------------------------------------------------------
    def cache_put(self, key: str, body: bytes, content_type: str) -> None:
        if len(body) <= self.cfg.breaker.cache_bytes:
            if len(self._cache) >= 1024 and key not in self._cache:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = (body, content_type)

    def cache_get(self, key: str) -> tuple[bytes, str] | None:
        return self._cache.get(key)

    def now(self) -> float:
        return self._clock()


class _Plans:
    """The inline paths' classification: per class one tuple of everything a decision needs, found by the class
    header's value (when it names a class, the path does not matter) or, without the header, by the path. Both
    caches are keyed by client-chosen strings and bounded as the classifier's cache is."""

    def __init__(self, g: Guard) -> None:
        self._classifier = g._classifier
        self.plans: list[tuple] = []
        per_class = g.buckets.per_class() if g._local_buckets else [(None, None)] * len(g._names)
        for idx, ((cb, tb), types) in enumerate(zip(per_class, _decision_types(g._names), strict=True)):
            # what both inline paths need, then what only the local one needs (the buckets' constants)
            common = (idx, *types, idx * len(_REASONS) + _REASONS.index("rate"),
                      idx * len(_REASONS) + _REASONS.index("tenant_rate"))
            self.plans.append((common, cb is not None, cb.one_s if cb else 0.0, cb.tau_s if cb else 0.0,
                               tb._tat if tb else None, tb.one_s if tb else 0.0, tb.tau_s if tb else 0.0, tb))
        self.by_header = {name: self.plans[self._classifier.header_class(name)] for name in g._names}
        self.by_path: dict[str, tuple] = {}

    def miss(self, path: str, header_value: str | None) -> tuple | None:
        """The plan of a request the caches do not know yet, now cached; None: a header value that names no class
        (its class depends on the path too: the general path decides those)."""
        c = self._classifier
        if header_value is not None:
            i = c.header_class(header_value)
            if i < 0:
                return None
            cache, key = self.by_header, header_value
        else:
            i = c.index_of(path, None)
            cache, key = self.by_path, path
        if len(cache) >= c._max_cached:  # read here, on a miss: tests lower it
            cache.clear()
        plan = cache[key] = self.plans[i]
        return plan


def _inline_acquire(g: Guard) -> Callable[[RequestInfo], Decision]:
    """Guard.acquire for its common case with local buckets, as a closure over the guard's state: cost 1, no
    override, the breaker closed, the full rate, no refresh due, and a class known from the class header
    or the path alone. Everything else goes to `g._acquire`, which decides it the same way.

    This runs once per request and costs what its bytecode costs, so it is written for CPython: the state
    is in closure cells (cheaper than attributes on self), each class's constants are one tuple unpacked at
    once, a class bucket's TAT is a list item, decisions come from per-class subclasses with the fixed fields
    as class attributes, and the lock is taken by bound methods fetched once. The arithmetic is
    LocalBuckets.take's at factor 1, operation for operation (a property test holds the two paths together).
    The lock stays: a GCRA update is a read, a computation and a write, and two threads interleaved there
    would both admit on one TAT (tests/test_guard_threads.py catches that)."""
    clock = g._clock
    breaker = g.breaker
    limiter = g.limiter
    inflight = g.inflight
    peak = g.inflight_peak
    admitted = g.admitted_total
    shed = g._shed_n
    take_lock = g._lock.acquire
    drop_lock = g._lock.release
    class_tat = g.buckets.class_tat
    class_header = g._class_header
    tenant_header = g._tenant_header
    general = g._acquire
    new = _new_decision
    inf = math.inf
    plans = _Plans(g)
    by_header, by_path, miss = plans.by_header, plans.by_path, plans.miss

    def acquire(info: RequestInfo) -> Decision:
        try:
            now = clock()
            if now >= g._next_refresh or info.klass is not None or not breaker.passing \
                    or limiter.rate_factor != 1.0:
                return general(info, now)
            h = info.headers
            hv = h.get(class_header)
            plan = by_header.get(hv) if hv is not None else by_path.get(info.path)
            if plan is None:
                plan = miss(info.path, hv)
                if plan is None:
                    return general(info, now)
            (idx, Admitted, RateRefused, TenantRefused, rate_key, tenant_key), \
                has_class, c_one, c_tau, tats, t_one, t_tau, tb = plan
            tenant = info.tenant
            if tenant is None:
                tenant = h.get(tenant_header, "")
            take_lock()
            try:
                if g.inflight_total >= limiter.limit:
                    d = Decision(True, Admitted.klass, tenant, 1.0, idx, now)
                    d.probe = "pass"
                    return g._shed(d, "concurrency", g._concurrency_retry_s())
                if has_class:
                    ctat = class_tat[idx]
                    if ctat < now:
                        ctat = now
                    cnew = ctat + c_one
                    over = cnew - now - c_tau
                    if over > _EPS_S:
                        shed[rate_key] += 1
                        d = new(RateRefused)
                        d.tenant = tenant
                        d.start_s = now
                        d.retry_after_s = over
                        return d
                if tats is not None:
                    try:
                        ttat = tats[tenant]  # a subscript, not .get(): no call on the common path
                    except KeyError:
                        if len(tats) >= tb._max_keys:
                            tb._evict(now)
                        ttat = -inf
                    if ttat < now:
                        ttat = now
                    tnew = ttat + t_one
                    over = tnew - now - t_tau
                    if over > _EPS_S:
                        shed[tenant_key] += 1
                        d = new(TenantRefused)
                        d.tenant = tenant
                        d.start_s = now
                        d.retry_after_s = over
                        return d
                    tats[tenant] = tnew
                if has_class:
                    class_tat[idx] = cnew
                found = g.inflight_total
                n = inflight[idx] = inflight[idx] + 1
                g.inflight_total = found + 1
                if n > peak[idx]:
                    peak[idx] = n
                if found >= g.inflight_total_peak:
                    g.inflight_total_peak = found + 1
                admitted[idx] += 1
            finally:
                drop_lock()
            d = new(Admitted)
            d.tenant = tenant
            d.start_s = now
            d.inflight_at = found
            return d
        except Exception:  # noqa: BLE001 - the guard runs inside the user's service and must not break it
            log.exception("gpuscope guard: decision failed; admitting this request")
            return Decision(True, "", "", 1.0, released=True)

    acquire.__doc__ = Guard.acquire.__doc__
    acquire.caches = (by_header, by_path)  # type: ignore[attr-defined]  # for tests: both stay bounded
    return acquire


def _inline_acquire_shared(g: Guard) -> Callable[[RequestInfo], Decision]:
    """Guard.acquire for its common case with shared (Redis) buckets: as `_inline_acquire`, with the buckets'
    I/O outside the lock. A concurrency check without the lock first (two reads: a slot that looks taken sends
    the request to the general path, which checks again under the lock), then the buckets, then under the lock
    the decisive check and the admission, or the refusal's count. The round trip costs some 20 µs of CPU, so
    what this saves (about 1 µs of the general path's calls) is what keeps a decision near a bare round trip."""
    clock = g._clock
    breaker = g.breaker
    limiter = g.limiter
    inflight = g.inflight
    peak = g.inflight_peak
    admitted = g.admitted_total
    shed = g._shed_n
    take_lock = g._lock.acquire
    drop_lock = g._lock.release
    take = g.buckets.take
    class_header = g._class_header
    tenant_header = g._tenant_header
    general = g._acquire
    new = _new_decision
    plans = _Plans(g)
    by_header, by_path, miss = plans.by_header, plans.by_path, plans.miss

    def acquire(info: RequestInfo) -> Decision:
        try:
            now = clock()
            if now >= g._next_refresh or info.klass is not None or not breaker.passing \
                    or limiter.rate_factor != 1.0:
                return general(info, now)
            h = info.headers
            hv = h.get(class_header)
            plan = by_header.get(hv) if hv is not None else by_path.get(info.path)
            if plan is None:
                plan = miss(info.path, hv)
                if plan is None:
                    return general(info, now)
            idx, Admitted, RateRefused, TenantRefused, rate_key, tenant_key = plan[0]
            if g.inflight_total >= limiter.limit:
                return general(info, now)
            tenant = info.tenant
            if tenant is None:
                tenant = h.get(tenant_header, "")
            wait, why = take(idx, tenant, 1.0, now)  # Redis: I/O, outside the lock
            take_lock()
            try:
                if wait:
                    if why == "rate":
                        shed[rate_key] += 1
                        d = new(RateRefused)
                    else:
                        shed[tenant_key] += 1
                        d = new(TenantRefused)
                    d.retry_after_s = wait
                else:
                    if g.inflight_total >= limiter.limit:
                        d = Decision(True, Admitted.klass, tenant, 1.0, idx, now)  # another thread took the slot
                        d.probe = "pass"
                        return g._shed(d, "concurrency", g._concurrency_retry_s())
                    found = g.inflight_total
                    n = inflight[idx] = inflight[idx] + 1
                    g.inflight_total = found + 1
                    if n > peak[idx]:
                        peak[idx] = n
                    if found >= g.inflight_total_peak:
                        g.inflight_total_peak = found + 1
                    admitted[idx] += 1
                    d = new(Admitted)
                    d.inflight_at = found
            finally:
                drop_lock()
            d.tenant = tenant
            d.start_s = now
            return d
        except Exception:  # noqa: BLE001 - the guard runs inside the user's service and must not break it
            log.exception("gpuscope guard: decision failed; admitting this request")
            return Decision(True, "", "", 1.0, released=True)

    acquire.__doc__ = Guard.acquire.__doc__
    return acquire


def _resolve(fut: asyncio.Future, d: Decision, guard: Guard | None) -> None:
    if fut.done():  # the waiter was cancelled (client went away) after it got a slot: give it back
        if guard is not None and d.admitted:
            d.released = True
            guard._slot_back(d.class_index)
        return
    fut.set_result(d)
