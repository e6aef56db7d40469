"""Shared GCRA buckets in Redis for guards on several replicas: one atomic Lua script per decision.

The script checks the class bucket and the tenant bucket together and stores both TATs only when both
conform, so a refusal costs nothing. It reads Redis's own clock (TIME), so replicas whose clocks
disagree still share one time line; TATs are microseconds since the epoch and expire when full.
Both keys carry one hash tag ({class}) so the script also runs on Redis Cluster.

Redis unreachable, or gone mid-run: the decision falls back at once to local buckets with each rate
divided by `redis.replicas` (so N replicas together keep about the global rate), a warning is logged
once, `fallback_active` turns on (gpuscope_guard_redis_fallback), and Redis is tried again every
`redis.retry_s`; when it answers, the shared buckets are used again and that is logged too.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from ._bucket import LocalBuckets
from ._config import GuardConfig

__all__ = ["RedisBuckets"]

log = logging.getLogger("gpuscope.guard")

GCRA_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
local tats = {}
for i = 1, #KEYS do
  local interval = tonumber(ARGV[2 * i])
  local tau = tonumber(ARGV[2 * i + 1])
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  if tat < now then tat = now end
  local new = tat + math.min(cost, tau / interval) * interval
  local over = new - now - tau
  if over > 0 then return {i, math.floor(over) + 1} end
  tats[i] = new
end
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], string.format('%.0f', tats[i]), 'PX', math.floor((tats[i] - now) / 1000) + 1)
end
return {0, 0}
"""

_US = 1e6


class RedisBuckets:
    """Per-class and per-tenant GCRA buckets shared through Redis, with a local fallback."""

    def __init__(self, cfg: GuardConfig) -> None:
        import redis
        import redis.asyncio

        r = cfg.redis
        self._errors = (redis.RedisError, OSError)
        self._sync = redis.Redis.from_url(r.url, socket_timeout=r.timeout_s, socket_connect_timeout=r.timeout_s)
        self._async = redis.asyncio.Redis.from_url(r.url, socket_timeout=r.timeout_s,
                                                  socket_connect_timeout=r.timeout_s)
        self._sha = hashlib.sha1(GCRA_LUA.encode()).hexdigest()  # what Redis names the script by
        self._noscript = redis.exceptions.NoScriptError
        self._local = LocalBuckets(cfg.classes, rate_divisor=r.replicas)
        self._divisor = r.replicas
        self._retry_s = r.retry_s
        self._retry_at = 0.0
        self.fallback_active = False
        self.url = r.url
        p = r.prefix
        # per class: (class key or None, its interval_us, tau_us), (tenant key prefix or None, interval_us, tau_us)
        self._spec: list[tuple[Any, Any]] = []
        for c in cfg.classes:
            ck = (f"{p}:{{{c.name}}}", _US / c.rate, _US / c.rate * (c.burst if c.burst is not None else c.rate)) \
                if c.rate else None
            tk = (f"{p}:{{{c.name}}}:t:", _US / c.tenant_rate,
                  _US / c.tenant_rate * (c.tenant_burst if c.tenant_burst is not None else c.tenant_rate)) \
                if c.tenant_rate else None
            self._spec.append((ck, tk))

    def _call(self, idx: int, tenant: str, cost: float, factor: float) -> tuple[list[Any], list[str]] | None:
        """The EVALSHA arguments (numkeys, keys, args) and the refusal reason of each key; None: no bucket."""
        ck, tk = self._spec[idx]
        if ck is None and tk is None:
            return None
        keys: list[Any] = []
        args: list[Any] = [repr(float(cost))]
        why: list[str] = []
        if ck is not None:
            keys.append(ck[0])
            args += (repr(ck[1] / factor), repr(ck[2]))
            why.append("rate")
        if tk is not None:
            keys.append(tk[0] + tenant)
            args += (repr(tk[1] / factor), repr(tk[2]))
            why.append("tenant_rate")
        return ["EVALSHA", self._sha, len(keys), *keys, *args], why

    def take(self, idx: int, tenant: str, cost: float, now: float, factor: float = 1.0) -> tuple[float, str]:
        call = self._call(idx, tenant, cost, factor)
        if call is None:
            return 0.0, ""
        if self.fallback_active and now < self._retry_at:
            return self._local.take(idx, tenant, cost, now, factor)
        try:
            # execute_command with the SHA, not redis-py's Script object: that wrapper costs about a fifth of a
            # loopback round trip; a Redis that lost its scripts (restart, SCRIPT FLUSH) gets it loaded again
            try:
                which, over_us = self._sync.execute_command(*call[0])
            except self._noscript:
                self._sync.script_load(GCRA_LUA)
                which, over_us = self._sync.execute_command(*call[0])
        except self._errors as e:
            self._failed(e, now)
            return self._local.take(idx, tenant, cost, now, factor)
        return self._answer(call[1], which, over_us)

    async def atake(self, idx: int, tenant: str, cost: float, now: float, factor: float = 1.0) -> tuple[float, str]:
        call = self._call(idx, tenant, cost, factor)
        if call is None:
            return 0.0, ""
        if self.fallback_active and now < self._retry_at:
            return self._local.take(idx, tenant, cost, now, factor)
        try:
            try:
                which, over_us = await self._async.execute_command(*call[0])
            except self._noscript:
                await self._async.script_load(GCRA_LUA)
                which, over_us = await self._async.execute_command(*call[0])
        except self._errors as e:
            self._failed(e, now)
            return self._local.take(idx, tenant, cost, now, factor)
        return self._answer(call[1], which, over_us)

    def _answer(self, why: list[str], which: int, over_us: int) -> tuple[float, str]:
        if self.fallback_active:
            self.fallback_active = False
            log.warning("gpuscope guard: Redis at %s answers again; shared buckets are back", self.url)
        if which == 0:
            return 0.0, ""
        return over_us / _US, why[int(which) - 1]

    def _failed(self, e: BaseException, now: float) -> None:
        self._retry_at = now + self._retry_s
        if not self.fallback_active:
            self.fallback_active = True
            log.warning("gpuscope guard: Redis at %s failed (%s); using local buckets at 1/%d of the rates until "
                        "it answers", self.url, type(e).__name__, self._divisor)

    def close(self) -> None:
        try:
            self._sync.close()
        except self._errors:
            pass

    async def aclose(self) -> None:
        try:
            await self._async.aclose()
        except self._errors:
            pass
