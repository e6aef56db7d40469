"""GCRA token buckets: one theoretical arrival time (TAT) per key, no I/O.

Emission interval `T = 1/rate`, tolerance `tau = T * burst`. A request of cost c at time `now` gives
`TAT' = max(TAT, now) + c*T`; it conforms iff `TAT' - now <= tau`, and then TAT' is stored. This is a
token bucket of capacity `burst` refilled at `rate`: over any interval of length t the admitted cost is
at most `rate*t + burst`. A cost over the burst is charged as the burst (it could never conform otherwise).

    >>> b = Gcra(rate=2.0, burst=2.0)
    >>> [b.take("k", 1.0, now=0.0) for _ in range(3)]
    [0.0, 0.0, 0.5]

`take` returns 0.0 when admitted, else the seconds until the same request would conform (Retry-After).
Times are monotonic seconds supplied by the caller, so a wall-clock jump cannot refill a bucket.
"""

from __future__ import annotations

import math

__all__ = ["Gcra", "LocalBuckets"]

_EPS_S = 1e-9


class Gcra:
    """Local GCRA buckets keyed by string; a bucket's parameters are fixed at construction."""

    __slots__ = ("interval_s", "tau_s", "rate", "burst", "cap", "one_s", "_tat", "_max_keys")

    def __init__(self, rate: float, burst: float | None = None, max_keys: int = 100_000) -> None:
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate, 1.0))
        self.interval_s = 1.0 / self.rate
        self.tau_s = self.interval_s * self.burst
        self.cap = self.tau_s / self.interval_s  # the most a request is charged at the full rate (the burst)
        self.one_s = (self.cap if self.cap < 1.0 else 1.0) * self.interval_s  # what cost 1 adds to a TAT then
        self._tat: dict[str, float] = {}
        self._max_keys = max_keys  # tenants are user-chosen strings: bound the memory they can take

    def take(self, key: str, cost: float, now: float, factor: float = 1.0) -> float:
        """Admit `cost` at `now` (0.0) or return the seconds to wait; `factor` scales the rate (0 < factor <= 1)."""
        wait = self.peek(key, cost, now, factor)
        if wait == 0.0:
            self.commit(key, cost, now, factor)
        return wait

    def peek(self, key: str, cost: float, now: float, factor: float = 1.0) -> float:
        interval = self.interval_s / factor
        tat = self._tat.get(key, now)
        if tat < now:
            tat = now
        # A request costing more than the burst could never conform: it costs the whole burst instead, so it
        # runs once the bucket is full (a long prompt is slow to admit, not refused for ever).
        over = tat + min(cost, self.tau_s / interval) * interval - now - self.tau_s
        return over if over > _EPS_S else 0.0  # float rounding must not refuse a request that is due

    def commit(self, key: str, cost: float, now: float, factor: float = 1.0) -> None:
        tat = self._tat.get(key, now)
        if tat < now:
            tat = now
        if len(self._tat) >= self._max_keys and key not in self._tat:
            self._evict(now)
        interval = self.interval_s / factor
        self._tat[key] = tat + min(cost, self.tau_s / interval) * interval

    def _evict(self, now: float) -> None:
        # A key whose TAT is in the past is a full bucket: forgetting it changes no decision.
        for k in [k for k, t in self._tat.items() if t <= now]:
            del self._tat[k]
        if len(self._tat) >= self._max_keys:  # every key is in debt: drop the oldest half (bounded memory wins)
            for k in list(self._tat)[: self._max_keys // 2]:
                del self._tat[k]


class LocalBuckets:
    """Per-class and per-tenant GCRA buckets for the classes of a config; `rate_divisor` splits the rates
    between replicas when these stand in for shared Redis buckets.

    A class bucket has one key, so its TAT is a float in `class_tat` (indexed by class; -inf is a full
    bucket, as a missing key is) rather than a one-key dict: a list index is the cheapest lookup there is,
    and the guard's inline decision path reads it once per request."""

    __slots__ = ("_class", "_tenant", "class_tat")

    def __init__(self, classes: list, rate_divisor: float = 1.0) -> None:
        d = float(rate_divisor)
        self._class = [Gcra(c.rate / d, (c.burst if c.burst is not None else c.rate) / d) if c.rate else None
                       for c in classes]
        self._tenant = [Gcra(c.tenant_rate / d, (c.tenant_burst if c.tenant_burst is not None else c.tenant_rate) / d)
                        if c.tenant_rate else None for c in classes]
        self.class_tat = [-math.inf] * len(classes)

    def per_class(self) -> list[tuple[Gcra | None, Gcra | None]]:
        """(class bucket's parameters, tenant buckets) per class, for a caller that inlines take(); the class
        bucket's TAT is `class_tat[idx]`."""
        return list(zip(self._class, self._tenant, strict=True))

    def take(self, idx: int, tenant: str, cost: float, now: float, factor: float = 1.0) -> tuple[float, str]:
        """(0.0, '') when both the class and the tenant bucket admit `cost`; else (wait_s, 'rate' | 'tenant_rate').
        The GCRA of Gcra.peek/commit, inlined for both buckets (this runs once per request); at the full
        rate (factor 1) the emission interval and the cost cap are the ones computed at construction, so the
        arithmetic is the same as Gcra's, operation for operation."""
        cb = self._class[idx]
        tb = self._tenant[idx]
        if cb is None:
            if tb is None:
                return _ADMIT
        else:
            ctat = self.class_tat[idx]
            if ctat < now:
                ctat = now
            if factor == 1.0:
                interval = cb.interval_s
                cap = cb.cap
            else:
                interval = cb.interval_s / factor
                cap = cb.tau_s / interval
            # see Gcra.peek: cost is capped at the burst
            cnew = ctat + (cap if cap < cost else cost) * interval
            over = cnew - now - cb.tau_s
            if over > _EPS_S:
                return over, "rate"
        if tb is not None:
            tats = tb._tat
            ttat = tats.get(tenant, now)
            if ttat < now:
                ttat = now
            if factor == 1.0:
                interval = tb.interval_s
                cap = tb.cap
            else:
                interval = tb.interval_s / factor
                cap = tb.tau_s / interval
            tnew = ttat + (cap if cap < cost else cost) * interval
            over = tnew - now - tb.tau_s
            if over > _EPS_S:
                return over, "tenant_rate"
            if len(tats) >= tb._max_keys and tenant not in tats:
                tb._evict(now)
            tats[tenant] = tnew
        if cb is not None:
            self.class_tat[idx] = cnew
        return _ADMIT


_ADMIT = (0.0, "")
