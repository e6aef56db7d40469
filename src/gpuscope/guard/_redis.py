"""Shared GCRA buckets in Redis for guards on several replicas: one atomic Lua script per decision.

The script checks the class bucket and the tenant bucket together and stores both TATs only when both
conform, so a refusal costs nothing. It reads Redis's own clock (TIME), so replicas whose clocks
disagree still share one time line; TATs are microseconds since the epoch. A tenant's key expires once its
bucket is full (at most tau after its last admission); a class's key (one per class) does not expire.
Both keys carry one hash tag ({class}) so the script also runs on Redis Cluster.

Redis unreachable, or gone mid-run: the decision falls back at once to local buckets with each rate
divided by `redis.replicas` (so N replicas together keep about the global rate), a warning is logged
once, `fallback_active` turns on (gpuscope_guard_redis_fallback), and Redis is tried again every
`redis.retry_s`; when it answers, the shared buckets are used again and that is logged too.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
from typing import Any

from .._redact import redact_url
from ._bucket import LocalBuckets
from ._config import GuardConfig

__all__ = ["RedisBuckets"]

log = logging.getLogger("gpuscope.guard")

# ARGV per key: the TAT increment of this request (cost, capped at the burst, times the emission interval, both
# in microseconds; the client computes it with the same arithmetic), tau, and the key's time to live in
# milliseconds ('' for a class key). The reply is one integer, parsed as cheaply as INCR's: 0 admitted, else
# (microseconds to wait) * 4 + the index of the refusing key (1 class, 2 tenant; 1 when the tenant bucket is the
# only one).
#
# What Redis spends on it (INFO commandstats, Redis 7.0): each redis.call costs about 0.6-1.5 µs, and each Lua
# number handed to a command costs about 0.9 µs more (Redis formats it with %.17g), so the script makes only the
# calls it must (TIME, one MGET of both keys -- one hash tag, one slot --, a SET per key) and hands over one
# number per key, the new TAT (whole or not, the formatting costs the same). The time to live is a constant string from the client: the stored TAT is at most
# `now + tau`, so a key that lives tau (rounded up) past its last admission outlives its debt and expires only
# when its bucket is full. A class key has no expiry at all (one key per class, so no memory to bound), which
# saves its SET the PX as well.
GCRA_LUA = """
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local n = #KEYS
local tats = redis.call('MGET', unpack(KEYS))
for i = 1, n do
  local tat = tonumber(tats[i]) or now
  if tat < now then tat = now end
  local new = tat + ARGV[3 * i - 2]
  local over = new - now - ARGV[3 * i - 1]
  if over > 0 then return (math.floor(over) + 1) * 4 + i end
  tats[i] = new
end
for i = 1, n do
  local ttl = ARGV[3 * i]
  if ttl == '' then
    redis.call('SET', KEYS[i], tats[i])
  else
    redis.call('SET', KEYS[i], tats[i], 'PX', ttl)
  end
end
return 0
"""

_US = 1e6
_ADMIT = (0.0, "")


def resp_bulk(arg: bytes) -> bytes:
    """One argument as a RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def resp_command(*parts: bytes) -> bytes:
    """A command from parts that are already RESP bulk strings (resp_bulk): what redis-py's packer sends,
    without its per-argument type checks and encoding."""
    return b"*%d\r\n%s" % (len(parts), b"".join(parts))


# Bumped in a forked child: a RawConnection opened before the fork must not be used by both processes. A
# counter read per call instead of os.getpid(), which is a system call on every call (glibc no longer caches it).
_fork_generation = [0]


def _after_fork_in_child() -> None:
    _fork_generation[0] += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


class RawConnection:
    """One redis-py connection taken from a client's pool and used directly: a packed command out, one reply
    back, without the client's per-command work (pool get/release, packing, hooks). Only one thread uses it
    at a time (`lock`, taken without waiting; a caller that cannot take it goes through the client). A
    forked child takes a connection of its own: the parent's socket must not be shared."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.lock = threading.Lock()
        self._conn: Any = None
        self._generation = -1

    def call(self, packed: bytes) -> Any:
        """Send one packed command and return its reply, or raise redis-py's error. redis-py closes the
        connection itself on a failed send or read (the next call reconnects); an error reply leaves it in step."""
        conn = self._conn
        if conn is None or self._generation != _fork_generation[0]:
            conn = self._conn = self._client.connection_pool.get_connection()
            self._generation = _fork_generation[0]
        conn.send_packed_command((packed,), check_health=False)
        return conn.read_response()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.disconnect()
            self._client.connection_pool.release(self._conn)
            self._conn = None


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
        self.url = redact_url(r.url, keep_path=True)  # shown in logs: never the password
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
        # The sync path sends pre-encoded bytes on one connection it holds: per class, the command up to the
        # tenant key, the tenant key's prefix, and the arguments of a cost-1 request at the full rate; per call
        # only the tenant key (and other arguments, for another cost or rate) are encoded. The bytes are those
        # redis-py would send for `_call`'s arguments.
        self._raw = RawConnection(self._sync)
        self._packed: list[tuple[bytes, bytes | None, bytes, list[str]] | None] = []
        for idx, (ck, tk) in enumerate(self._spec):
            if ck is None and tk is None:
                self._packed.append(None)
                continue
            nkeys = (ck is not None) + (tk is not None)
            # EVALSHA, the SHA, numkeys, the keys, an increment, a tau and a time to live per key
            head = b"*%d\r\n" % (3 + 4 * nkeys) + b"".join(
                [resp_bulk(b"EVALSHA"), resp_bulk(self._sha.encode()), resp_bulk(b"%d" % nkeys)]
                + ([resp_bulk(ck[0].encode())] if ck is not None else []))
            args1 = b"".join(resp_bulk(a.encode()) for a in self._args(idx, 1.0, 1.0))
            why = (["rate"] if ck is not None else []) + (["tenant_rate"] if tk is not None else [])
            self._packed.append((head, tk[0].encode() if tk is not None else None, args1, why))

    def _args(self, idx: int, cost: float, factor: float) -> list[str]:
        """ARGV: per key, the TAT increment (cost capped at the burst, times the interval) and tau, in µs, and
        the key's time to live in ms ('' for the class key: it does not expire)."""
        out: list[str] = []
        for i, b in enumerate(self._spec[idx]):
            if b is not None:
                interval = b[1] / factor
                ttl = "" if i == 0 else str(math.ceil(b[2] / 1000) + 1)
                out += (repr(min(cost, b[2] / interval) * interval), repr(b[2]), ttl)
        return out

    def _call(self, idx: int, tenant: str, cost: float, factor: float) -> tuple[list[Any], list[str]] | None:
        """The EVALSHA arguments (numkeys, keys, args) and the refusal reason of each key; None: no bucket."""
        ck, tk = self._spec[idx]
        if ck is None and tk is None:
            return None
        keys = ([ck[0]] if ck is not None else []) + ([tk[0] + tenant] if tk is not None else [])
        why = (["rate"] if ck is not None else []) + (["tenant_rate"] if tk is not None else [])
        return ["EVALSHA", self._sha, len(keys), *keys, *self._args(idx, cost, factor)], why

    def take(self, idx: int, tenant: str, cost: float, now: float, factor: float = 1.0) -> tuple[float, str]:
        # Once per request, so `pack` and `_answer` are written out here (a call each saved).
        spec = self._packed[idx]
        if spec is None:
            return _ADMIT
        if self.fallback_active and now < self._retry_at:
            return self._local.take(idx, tenant, cost, now, factor)
        head, tenant_prefix, args, why = spec
        if cost != 1.0 or factor != 1.0:
            args = b"".join(resp_bulk(a.encode()) for a in self._args(idx, cost, factor))
        if tenant_prefix is None:
            packed = head + args
        else:
            key = tenant_prefix + tenant.encode()
            packed = b"%s$%d\r\n%s\r\n%s" % (head, len(key), key, args)  # one formatting: the tenant key's bulk
        try:
            # one EVALSHA, sent as bytes on a held connection: redis-py's execute_command costs about as much
            # client CPU again as the round trip's own system calls. A Redis that lost its scripts (restart,
            # SCRIPT FLUSH) gets it loaded again.
            try:
                raw = self._raw
                if raw.lock.acquire(False):
                    try:
                        reply = raw.call(packed)
                    finally:
                        raw.lock.release()
                else:
                    reply = self._send_pooled(packed)
            except self._noscript:
                self._sync.script_load(GCRA_LUA)
                reply = self._send(packed)
        except self._errors as e:
            self._failed(e, now)
            return self._local.take(idx, tenant, cost, now, factor)
        if self.fallback_active:
            self._recovered()
        if reply == 0:
            return _ADMIT
        return (reply >> 2) / _US, why[(reply & 3) - 1]

    def pack(self, idx: int, tenant: str, cost: float, factor: float) -> bytes:
        """The EVALSHA of one decision as RESP bytes: the same bytes redis-py packs from `_call`'s arguments
        (and that `take` sends)."""
        spec = self._packed[idx]
        assert spec is not None
        head, tenant_prefix, args, _ = spec
        if cost != 1.0 or factor != 1.0:
            args = b"".join(resp_bulk(a.encode()) for a in self._args(idx, cost, factor))
        if tenant_prefix is None:
            return head + args
        key = tenant_prefix + tenant.encode()
        return b"%s$%d\r\n%s\r\n%s" % (head, len(key), key, args)

    def _send(self, packed: bytes) -> Any:
        raw = self._raw
        if raw.lock.acquire(False):
            try:
                return raw.call(packed)
            finally:
                raw.lock.release()
        return self._send_pooled(packed)

    def _send_pooled(self, packed: bytes) -> Any:
        pool = self._sync.connection_pool  # another thread holds the connection: take one from the pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command((packed,), check_health=False)
            return conn.read_response()
        finally:
            pool.release(conn)

    async def atake(self, idx: int, tenant: str, cost: float, now: float, factor: float = 1.0) -> tuple[float, str]:
        call = self._call(idx, tenant, cost, factor)
        if call is None:
            return _ADMIT
        if self.fallback_active and now < self._retry_at:
            return self._local.take(idx, tenant, cost, now, factor)
        try:
            try:
                reply = await self._async.execute_command(*call[0])
            except self._noscript:
                await self._async.script_load(GCRA_LUA)
                reply = await self._async.execute_command(*call[0])
        except self._errors as e:
            self._failed(e, now)
            return self._local.take(idx, tenant, cost, now, factor)
        return self._answer(call[1], reply)

    def _answer(self, why: list[str], reply: int) -> tuple[float, str]:
        if self.fallback_active:
            self._recovered()
        if reply == 0:
            return _ADMIT
        return (reply >> 2) / _US, why[(reply & 3) - 1]

    def _recovered(self) -> None:
        self.fallback_active = False
        log.warning("gpuscope guard: Redis at %s answers again; shared buckets are back", self.url)

    def _failed(self, e: BaseException, now: float) -> None:
        self._retry_at = now + self._retry_s
        if not self.fallback_active:
            self.fallback_active = True
            log.warning("gpuscope guard: Redis at %s failed (%s); using local buckets at 1/%d of the rates until "
                        "it answers", self.url, type(e).__name__, self._divisor)

    def close(self) -> None:
        try:
            with self._raw.lock:
                self._raw.close()
            self._sync.close()
        except self._errors:
            pass

    async def aclose(self) -> None:
        try:
            await self._async.aclose()
        except self._errors:
            pass
