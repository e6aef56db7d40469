"""Events from other processes: POST /api/v1/events (token), e.g. the guard's breaker and shedding changes.

A body is one event or a list of at most MAX_EVENTS, at most MAX_BODY_BYTES:

    {"kind": "guard", "type": "breaker_open", "severity": "critical", "message": "upstream circuit opened",
     "source": "guard@web-1", "labels": {"from": "closed"}, "time": 1764473000.5}

`time` (unix seconds) is optional (default: now) and may not lie more than MAX_FUTURE_S ahead. Only
kind 'guard' is taken: the hardware kinds (xid, ecc, ...) come from NVML alone, so a client cannot
fake one. An accepted event becomes an `Event(kind='guard', gpu=None, message, data={type, severity,
source, labels})` handed to the sampler, so it travels as the agent's own events do: the next
snapshot, the event history and the store, and GET /api/v1/events?kind=guard.

Each source may post RATE_PER_SOURCE events a second (bursts of MAX_EVENTS), all sources together
RATE_TOTAL; past that the whole request is refused with 429 and Retry-After, so no client floods the store.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from typing import Any

from aiohttp import web

from .._choices import did_you_mean
from .._files import kind_of
from .._records import Event
from .._text import valid_text
from ..http.responses import BadRequest, error_response, json_response
from ._face import AgentFace

MAX_EVENTS = 100
MAX_BODY_BYTES = 64 << 10
MAX_MESSAGE_CHARS = 500
MAX_LABELS = 16
MAX_NAME_CHARS = 64          # type, label names
MAX_SOURCE_CHARS = 128
MAX_LABEL_VALUE_CHARS = 256
MAX_FUTURE_S = 300.0         # clocks differ a little between hosts; more is a mistake
MAX_PAST_S = 86_400.0        # a sender queues seconds, not days: older is a wrong clock or unit
RATE_PER_SOURCE = 20.0       # events per second
RATE_TOTAL = 200.0           # events per second, all sources together
MAX_SOURCES = 1000           # sources tracked by the limiter (the fullest buckets are forgotten first)
SEVERITIES = ("info", "warning", "critical")
FIELDS = ("kind", "type", "severity", "message", "source", "labels", "time")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*", re.ASCII)



class RateLimiter:
    """Token buckets per source and for all sources: `take({source: n})` is all or nothing and answers the
    seconds to wait (0.0: taken)."""

    def __init__(self, per_source: float = RATE_PER_SOURCE, total: float = RATE_TOTAL, burst: float = MAX_EVENTS,
                 clock: Any = time.monotonic) -> None:
        self.per_source, self.total, self.burst = per_source, total, burst
        self.total_burst = max(burst, total)
        self.clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # source -> (tokens, at)
        self._all = (self.total_burst, clock())

    @staticmethod
    def _level(bucket: tuple[float, float], rate: float, cap: float, now: float) -> float:
        tokens, at = bucket
        return min(cap, tokens + (now - at) * rate)

    def take(self, wanted: dict[str, int]) -> float:
        with self._lock:
            now = self.clock()
            levels = {s: self._level(self._buckets.get(s, (self.burst, now)), self.per_source, self.burst, now)
                      for s in wanted}
            all_level = self._level(self._all, self.total, self.total_burst, now)
            wait = max([(n - levels[s]) / self.per_source for s, n in wanted.items()]
                       + [(sum(wanted.values()) - all_level) / self.total])
            if wait > 0:
                return wait
            if len(self._buckets) + len(wanted) > MAX_SOURCES:
                # forget the sources that have been quiet longest: a forgotten one starts with a full burst
                for s, _ in sorted(self._buckets.items(), key=lambda kv: kv[1][1])[:len(wanted)]:
                    del self._buckets[s]
            for s, n in wanted.items():
                self._buckets[s] = (levels[s] - n, now)
            self._all = (all_level - sum(wanted.values()), now)
            return 0.0


def parse_events(doc: Any, now_s: float) -> list[Event]:
    """The events of a request body (decoded JSON); BadRequest with one sentence naming the field."""
    single = isinstance(doc, dict)
    items = [doc] if single else doc
    if not isinstance(items, list):
        raise BadRequest('The body must be one event (a JSON object) or a list of them, e.g. {"kind": "guard", '
                              '"type": "breaker_open", "severity": "warning", "message": "...", "source": "guard"}.')
    if not items:
        raise BadRequest("The list of events is empty.")
    if len(items) > MAX_EVENTS:
        raise BadRequest(f"{len(items)} events in one request is too many (at most {MAX_EVENTS}).")
    return [_event(item, "" if single else f"events[{i}].", now_s) for i, item in enumerate(items)]


def _text(ev: dict[str, Any], key: str, where: str, limit: int, pattern: re.Pattern[str] | None = None) -> str:
    v = ev.get(key)
    if not isinstance(v, str) or not v.strip():
        raise BadRequest(f"{where}{key} must be a non-empty string.")
    if len(v) > limit:
        raise BadRequest(f"{where}{key} is {len(v)} characters long; at most {limit} are taken.")
    if pattern is not None and not pattern.fullmatch(v):
        raise BadRequest(f"{where}{key} must be a name of letters, digits, '_', '.' and '-', not {v!r}.")
    if not v.isprintable():
        raise BadRequest(f"{where}{key} must not contain control characters.")
    return v


def _event(ev: Any, where: str, now_s: float) -> Event:
    if not isinstance(ev, dict):
        raise BadRequest(f"{where.rstrip('.') or 'The event'} must be a JSON object, not {kind_of(ev)}.")
    unknown = sorted(str(k) for k in ev if k not in FIELDS)
    if unknown:
        raise BadRequest(f"{where}{unknown[0]} is not an event field; "
                         + did_you_mean(unknown[0], FIELDS, f"an event has {', '.join(FIELDS)}."))
    if ev.get("kind") != "guard":
        raise BadRequest(f"{where}kind must be 'guard' (the only kind other processes may post), "
                              f"not {ev.get('kind')!r}.")
    etype = _text(ev, "type", where, MAX_NAME_CHARS, _NAME)
    severity = ev.get("severity")
    if severity not in SEVERITIES:
        raise BadRequest(f"{where}severity must be one of {', '.join(SEVERITIES)}, not {severity!r}.")
    message = ev.get("message")
    if isinstance(message, str) and len(message) > MAX_MESSAGE_CHARS:
        raise BadRequest(f"{where}message is {len(message)} characters long; at most {MAX_MESSAGE_CHARS} "
                              "are taken.")
    if not isinstance(message, str) or not message.strip():
        raise BadRequest(f"{where}message must be a non-empty string.")
    source = _text(ev, "source", where, MAX_SOURCE_CHARS)
    labels = ev.get("labels", {})
    if not isinstance(labels, dict):
        raise BadRequest(f"{where}labels must be an object of strings, such as {{\"class\": \"batch\"}}.")
    if len(labels) > MAX_LABELS:
        raise BadRequest(f"{where}labels has {len(labels)} entries; at most {MAX_LABELS} are taken.")
    for k, v in labels.items():
        if len(k) > MAX_NAME_CHARS or not _NAME.fullmatch(k):
            raise BadRequest(f"{where}labels has the key {k[:80]!r}; a label name is letters, digits, '_', "
                                  f"'.' and '-', at most {MAX_NAME_CHARS} characters.")
        if not isinstance(v, str) or len(v) > MAX_LABEL_VALUE_CHARS:
            raise BadRequest(f"{where}labels.{k} must be a string of at most {MAX_LABEL_VALUE_CHARS} "
                                  "characters.")
    t = ev.get("time", now_s)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise BadRequest(f"{where}time must be a number of unix seconds, not {t!r}.")
    if t > now_s + MAX_FUTURE_S:
        raise BadRequest(f"{where}time is {t - now_s:.0f} s in the future; at most {MAX_FUTURE_S:.0f} s "
                              "ahead is taken (is the sender's clock right?).")
    if t < now_s - MAX_PAST_S:
        raise BadRequest(f"{where}time is more than a day in the past; send unix seconds, not milliseconds "
                              "or a stale queue.")
    # JSON may carry lone surrogates ("\ud800"): made valid text here, once, for the store and every reader.
    return Event(int(t * 1e9), "guard", None, valid_text(message),
                 {"type": etype, "severity": severity, "source": source,
                  "labels": {k: valid_text(v) for k, v in labels.items()}})


def hand_to_sampler(sampler: Any, events: list[Event]) -> None:
    """Queue events for the sampler's next tick, as its own sources do: from there they reach the snapshot,
    the event history and the store. Under the sampler's tick lock, so none falls between two ticks."""
    sampler.add_events(events)


class EventsApi:
    def __init__(self, agent: AgentFace) -> None:
        self.agent = agent
        self.limiter = RateLimiter()
        self.accepted_total = 0
        self.refused_rate_total = 0

    async def post(self, request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return error_response(413, f"The request body is {request.content_length} bytes; at most "
                                       f"{MAX_BODY_BYTES} are taken.")
        # The whole body, however many TCP segments it came in, up to the app's client_max_size (past it
        # aiohttp raises its 413): content.read(n) would return only what had arrived so far.
        body = await request.read()
        if len(body) > MAX_BODY_BYTES:
            return error_response(413, f"The request body is over {MAX_BODY_BYTES} bytes; at most {MAX_BODY_BYTES} "
                                       "are taken.")
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: '[' nested 30000 deep
            return error_response(400, "The body is not valid JSON.")
        try:
            events = parse_events(doc, time.time())
        except BadRequest as e:
            return error_response(400, str(e))
        wanted: dict[str, int] = {}
        for ev in events:
            wanted[ev.data["source"]] = wanted.get(ev.data["source"], 0) + 1
        wait_s = self.limiter.take(wanted)
        if wait_s > 0:
            self.refused_rate_total += len(events)
            resp = error_response(429, f"Too many events from {', '.join(sorted(wanted))[:200]}: at most "
                                       f"{RATE_PER_SOURCE:g} a second per source; retry in {wait_s:.1f} s.")
            resp.headers["Retry-After"] = str(max(1, math.ceil(wait_s)))
            return resp
        sampler = self.agent.sampler
        await asyncio.get_running_loop().run_in_executor(None, hand_to_sampler, sampler, events)
        self.accepted_total += len(events)
        return json_response({"accepted": len(events)}, status=202)


def register(app: web.Application, agent: AgentFace) -> None:
    app.router.add_post("/api/v1/events", EventsApi(agent).post)
