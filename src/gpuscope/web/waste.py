"""The dashboard's waste view: `gpuscope fleet report` over the dashboard's Prometheus, live.

    view = WasteView("http://prometheus:9090", timeout_s=10)
    since_s, by = waste_params(request.query)          # BadRequest: one sentence, a 400
    doc = await view.answer(since_s, by)               # {"report": <the --json document>, "gpus": {...}, ...}

The report's client is synchronous: it runs on this view's own threads, never on the event loop. One answer
per (range, grouping) is kept CACHE_TTL_S, and a request that comes while the same one is being computed
waits for it, so several open pages cost one report. A request waits at most `deadline_s`: past it, a
504 sentence, while the report goes on and lands in the cache for the next refresh. At most MAX_RUNNING
reports run at once (a 503 past that).

`gpus` names each group's GPUs as the dashboard keys them ('hostname/gpu'), so that a row opens their
pages (/ui/?gpu=node-a/0,node-a/1): the report counts a group's GPUs but does not list them, so one more
query asks the server which GPUs carried the group's labels over the range, with the report's own rule for
a group's name (its labels joined by '/', '(none)' where the last is empty).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..errors import UserError
from ..http.responses import BadRequest
from ..timeparse import TimeError, parse_duration
from .backend import BackendError

if TYPE_CHECKING:
    from ..fleet import Prices

__all__ = ["CACHE_TTL_S", "DEADLINE_S", "MAX_SINCE_S", "MIN_SINCE_S", "NEEDS_PROMETHEUS", "WasteView",
           "waste_params"]

DEFAULT_SINCE, DEFAULT_BY = "24h", "namespace"
#: The range: from a minute (a few scrapes at the usual 15 s) to 31 days (longer ranges are the CLI's job).
MIN_SINCE_S, MAX_SINCE_S = 60.0, 31 * 86400.0
CACHE_TTL_S = 30.0       # the page refreshes every 60 s; pages opened together share one report
MAX_CACHED = 16          # answers kept (range x grouping); the oldest goes first
MAX_RUNNING = 2          # reports computed at once; each runs a few queries at a time of its own
DEADLINE_S = 60.0        # the longest a request waits for a report (it goes on past that)
NONE = "(none)"
NEEDS_PROMETHEUS = ("The waste view reads the whole fleet from Prometheus: run `gpuscope dashboard --prometheus URL` "
                    "against the server that scrapes the agents.")


def waste_params(q: Mapping[str, str]) -> tuple[float, str]:
    """(since in seconds, grouping) from /ui/api/waste's parameters; BadRequest (one sentence) for anything else."""
    for k in q:
        if k not in ("since", "by"):
            raise BadRequest(f"{k!r} is not a parameter of /ui/api/waste: it takes since (such as 24h) and by "
                             "(namespace, pod, job, user, node or model).")
    from ..fleet import DIMENSIONS  # the groupings of `gpuscope fleet report --by`

    by = q.get("by", DEFAULT_BY)
    if by not in DIMENSIONS:
        shown = by if len(by) <= 40 else by[:40] + "..."
        raise BadRequest(f"by must be one of {', '.join(DIMENSIONS)}, not {shown!r}.")
    text = q.get("since", DEFAULT_SINCE)
    if len(text) > 40:
        raise BadRequest(f"since {text[:40] + '...'!r} is not a duration such as 90m, 24h or 7d.")
    try:
        since = parse_duration(text, "since")
    except TimeError as e:
        raise BadRequest(str(e)) from None
    if since < MIN_SINCE_S:
        raise BadRequest(f"since must be at least 1m (the report needs a few scrapes), not {text!r}.")
    if since > MAX_SINCE_S:
        raise BadRequest(f"since must be at most 31d, not {text!r}; for longer ranges use "
                         "`gpuscope fleet report --since`.")
    return since, by


def _span(seconds: float) -> str:
    for unit, s in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= s and seconds % s == 0:
            return f"{seconds / s:g}{unit}"
    return f"{seconds:g}s"


class WasteView:
    """The waste view over one Prometheus server. `timeout_s` bounds each query, `deadline_s` a request;
    `headers` go with every query (the dashboard's own, e.g. Authorization)."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, prices: Prices | None = None,
                 deadline_s: float = DEADLINE_S, ttl_s: float = CACHE_TTL_S,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 headers: dict[str, str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.headers = dict(headers or {})
        self.timeout_s = float(timeout_s)
        self.prices = prices
        self.deadline_s = float(deadline_s)
        self.ttl_s = float(ttl_s)
        self.clock, self.wall = clock, wall
        self.computed = 0  # reports computed (what a test reads: several pages, one report)
        self._done: dict[tuple[float, str], tuple[float, dict[str, Any]]] = {}
        self._running: dict[tuple[float, str], asyncio.Future[dict[str, Any]]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _compute(self, since_s: float, by: str) -> dict[str, Any]:
        """One report and its groups' GPUs (in a worker thread)."""
        from ..fleet import report
        end = self.wall()
        start = end - since_s
        doc = report(self.url, start, end, by, self.prices, timeout=self.timeout_s, headers=self.headers)
        return {"since": _span(since_s), "since_s": since_s, "by": by, "computed_at_s": end,
                "report": doc, "gpus": {g["group"]: g.get("gpu_keys", []) for g in doc.get("groups", [])}}

    def _finished(self, key: tuple[float, str], fut: asyncio.Future[dict[str, Any]]) -> None:
        if self._running.get(key) is fut:
            del self._running[key]
        if fut.cancelled() or fut.exception() is not None:
            return
        self.computed += 1
        self._done[key] = (self.clock(), fut.result())
        while len(self._done) > MAX_CACHED:
            self._done.pop(min(self._done, key=lambda k: self._done[k][0]))

    async def answer(self, since_s: float, by: str) -> dict[str, Any]:
        """The answer for the last `since_s` seconds grouped `by`: cached, shared, or computed now; a
        BackendError (one sentence) when it cannot be had."""
        key = (since_s, by)
        hit = self._done.get(key)
        if hit is not None and self.clock() - hit[0] < self.ttl_s:
            return {**hit[1], "age_s": round(self.clock() - hit[0], 3)}
        loop = asyncio.get_running_loop()
        fut = self._running.get(key)
        if fut is not None and fut.get_loop() is not loop:  # a view reused from another loop (a second asyncio.run)
            fut = None
        if fut is None:
            if len(self._running) >= MAX_RUNNING:
                raise BackendError(503, f"{MAX_RUNNING} fleet reports are being computed for other pages; "
                                        "try again in a minute.")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(MAX_RUNNING, thread_name_prefix="gpuscope-waste")
            fut = loop.run_in_executor(self._pool, self._compute, since_s, by)
            self._running[key] = fut
            fut.add_done_callback(lambda f, key=key: self._finished(key, f))
        try:
            # shield: one request's deadline leaves the report running for the others and the cache
            doc = await asyncio.wait_for(asyncio.shield(fut), self.deadline_s)
        except asyncio.TimeoutError:
            raise BackendError(504, f"The fleet report over the last {_span(since_s)} has not finished within "
                                    f"{self.deadline_s:g} s; it goes on, and the next refresh shows it (for long "
                                    "ranges load `gpuscope fleet rules` into Prometheus).") from None
        except UserError as e:  # the report's own sentences: no data there, the server unreachable or refusing
            raise BackendError(_status(e), str(e)) from None
        return {**doc, "age_s": 0.0}

    def close(self) -> None:
        """Stop taking reports; one still running ends with its current query (no wait here)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _status(e: UserError) -> int:
    """404: the server holds no gpuscope series in the range; 502: it refused the query; 503: it cannot be
    reached, did not answer in time or is not Prometheus; 500: the dashboard's own prices file names no price."""
    from ..fleet import NoFleetData, PricesError
    from ..promql import PromQLError, Refused

    if isinstance(e, NoFleetData):
        return 404
    if isinstance(e, Refused):
        return 502
    if isinstance(e, PromQLError):
        return 503
    if isinstance(e, PricesError):
        return 500
    return 502
