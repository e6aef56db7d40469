"""The agent's HTTP surface: /metrics for Prometheus and /api/v1/* for people and tools.

Scrapes and API reads never call NVML: they read the sampler's latest snapshot or the store.
Bound to loopback, reads are open; bound beyond it, every request needs the bearer token but the probes
(/healthz and /readyz), which then answer only alive/ready and a reason naming no file or error. Nothing
here changes state but POST /api/v1/trace (trace_api.py) and POST /api/v1/events (events_api.py), which
require the token wherever bound.
Every bad request ends in a 4xx with a JSON body {"error": "one sentence"}.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import asdict
from typing import Any

from aiohttp import web

from .._choices import no_such_gpu
from .._version import __version__
from ..export.exposition import MODES as NAMINGS
from ..http.auth import AGENT_TOKEN_HINT, PROBE_PATHS, access, probe_only
from ..http.responses import BadRequest, error_response, json_errors, json_response
from ..timeparse import parse_duration, parse_time
from ._face import AgentFace

log = logging.getLogger("gpuscope.agent.http")

MAX_POINTS = 100_000  # per series in one range query
AGGS = ("mean", "max", "min", "last", "count", "sum")

__all__ = ["Api", "BadRequest", "make_app"]

_PERCENTILE = re.compile(r"p([0-9]+(?:\.[0-9]+)?)", re.ASCII)


def _clean(values: Any) -> list[float | None]:
    return [None if (v is None or v != v or v in (math.inf, -math.inf)) else float(v) for v in values]


class Api:
    """Handlers. `agent` provides: sampler, store, token, loopback_only, naming, top_processes,
    render_metrics(mode) -> bytes, status() -> dict."""

    def __init__(self, agent: AgentFace) -> None:
        self.agent = agent

    # -- routes --------------------------------------------------------------------------------
    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/", self.index)
        r.add_get("/metrics", self.metrics)
        r.add_get("/api/v1/", self.index)
        r.add_get("/api/v1/status", self.status)
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/api/v1/latest", self.latest)
        r.add_get("/api/v1/capabilities", self.capabilities)
        r.add_get("/api/v1/series", self.series)
        r.add_get("/api/v1/labels", self.labels)
        r.add_get("/api/v1/query_range", self.query_range)
        r.add_get("/api/v1/events", self.events)
        r.add_get("/api/v1/diagnose", self.diagnose)
        r.add_get("/api/v1/alerts", self.alerts)

    async def index(self, request: web.Request) -> web.Response:
        if request.path == "/" and _prefers_html(request.headers.get("Accept", "")):
            raise web.HTTPFound("/ui/")  # a browser gets the dashboard, tools keep the JSON index
        return json_response({
            "gpuscope": __version__,
            "simulated": self.agent.sampler.simulated,
            "endpoints": {
                "/metrics": "Prometheus exposition (?naming=canonical|dcgm|canonical,dcgm)",
                "/api/v1/status": "agent status, sampler overhead, store statistics and health",
                "/healthz": "liveness: 200 while the agent answers (no token needed: a probe)",
                "/readyz": "readiness: 200 while the store can write, else 503 with the reason (no token needed: "
                           "a probe; the details need it)",
                "/api/v1/latest": "the latest snapshot: GPUs, processes, host, events",
                "/api/v1/capabilities": "per GPU and metric: supported, and why not",
                "/api/v1/series": "stored series (?metric=NAME&LABEL=VALUE)",
                "/api/v1/labels": "label names and their values",
                "/api/v1/query_range": "?metric=NAME&start=-1h&end=now&step=1s&agg=mean|max|min|last|count|sum|p50|p99"
                                       "&LABEL=VALUE",
                "/api/v1/events": "?start=-1h&end=now&kind=xid&gpu=0; POST (token): one event of kind guard, "
                                  "or a list of them",
                "/api/v1/diagnose": "verdicts over the last ?window=30s (the in-memory history), or over a past "
                                    "?start=&end= range from the store (spans, share, overall)",
                "/api/v1/alerts": "firing, pending and recently resolved alerts, the rules and the notifiers",
                "/api/v1/trace": "POST {\"duration\": \"5s\", \"pids\": [..]} (token): ask the processes started "
                                 "with gpuscope trace --on-demand to trace",
                "/api/v1/traces": "the traces they wrote or refused; /api/v1/traces/ID/kernels: kernel statistics",
                "/api/v1/autotrace": "the windows the agent started itself (verdict flips, the schedule), their "
                                     "outcome, verdicts and findings; how a program opts in",
                "/api/v1/profile": "GPU time by launching stack of the traces that ended ?since=1h (&job=J), "
                                   "?format=pprof|speedscope|json",
                "/ui/": "the web dashboard",
            },
        })

    async def metrics(self, request: web.Request) -> web.Response:
        mode = request.query.get("naming", self.agent.naming)
        if mode not in NAMINGS:  # canonical,dcgm: both in one exposition, for DCGM dashboards and ours at once
            raise BadRequest(f"naming must be canonical, dcgm or canonical,dcgm, not {mode!r}.")
        body = self.agent.render_metrics(mode)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def status(self, request: web.Request) -> web.Response:
        return json_response(await asyncio.get_running_loop().run_in_executor(None, self.agent.status))

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: the agent answers."""
        return json_response({"alive": True})

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: 200 while the store can write, else 503 with why and since when (Store.health()); to a
        probe without the token (beyond loopback), only whether and a reason that names no file or error."""
        health = self.agent.store.health()
        body = public_readiness(health) if probe_only(request) else health
        return json_response(body, status=200 if health["healthy"] else 503)

    async def latest(self, request: web.Request) -> web.Response:
        snap = self.agent.sampler.latest()
        if snap is None:
            return error_response(503, "The sampler has not produced a snapshot yet; try again in a second.")
        return json_response(asdict(snap))

    async def capabilities(self, request: web.Request) -> web.Response:
        caps = self.agent.sampler.capabilities()
        return json_response({gpu: {m: {"supported": c.supported, "reason": c.reason} for m, c in per.items()}
                      for gpu, per in caps.items()})

    async def series(self, request: web.Request) -> web.Response:
        q = dict(request.query)
        metric = q.pop("metric", None)
        self._check_labels(q)
        store = self.agent.store
        res = await asyncio.get_running_loop().run_in_executor(None, lambda: store.series(metric, **q))
        return json_response({"series": res})

    async def labels(self, request: web.Request) -> web.Response:
        return json_response({"labels": await asyncio.get_running_loop().run_in_executor(None, self.agent.store.labels)})

    def _check_labels(self, q: dict[str, str]) -> None:
        for k in q:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise BadRequest(f"{k!r} is not a label name.")

    async def query_range(self, request: web.Request) -> web.Response:
        q = dict(request.query)
        metric = q.pop("metric", None)
        if not metric:
            raise BadRequest("metric is required, e.g. /api/v1/query_range?metric=gpu_sm_active_ratio&start=-1h.")
        now = time.time()
        start = parse_time(q.pop("start", "-1h"), now, "start")
        end = parse_time(q.pop("end", "now"), now, "end")
        step = parse_duration(q.pop("step", "1s"), "step")
        agg = q.pop("agg", "mean")
        q.pop("format", None)
        if end <= start:
            raise BadRequest("end must be after start.")
        m = _PERCENTILE.fullmatch(agg)
        if agg not in AGGS and not (m and 0 < float(m.group(1)) < 100):
            raise BadRequest(f"agg must be one of {', '.join(AGGS)} or a percentile such as p99, not {agg!r}.")
        points = (end - start) / 1e9 / step
        if points > MAX_POINTS:
            raise BadRequest(f"{points:.0f} points per series is too many (at most {MAX_POINTS}); use a larger step.")
        self._check_labels(q)
        store = self.agent.store

        def run() -> list[Any]:
            return store.query(metric, start, end, step, agg, labels=q or None)

        results = await asyncio.get_running_loop().run_in_executor(None, run)
        if not results and "gpu" in q:  # a GPU that is not there is no "no data": name the GPUs there are
            known = (await asyncio.get_running_loop().run_in_executor(None, store.labels)).get("gpu", [])
            if q["gpu"] not in known:
                raise BadRequest(no_such_gpu(q["gpu"], known, "this agent"))
        return json_response({
            "metric": metric, "start_ns": start, "end_ns": end, "step_s": step, "agg": agg,
            "simulated": self.agent.sampler.simulated,
            "series": [{"labels": r.labels, "timestamps_ns": [int(t) for t in r.timestamps_ns],
                        "values": _clean(r.values)} for r in results],
        })

    async def events(self, request: web.Request) -> web.Response:
        q = request.query
        now = time.time()
        start = parse_time(q.get("start", "-1h"), now, "start")
        end = parse_time(q.get("end", "now"), now, "end")
        if end <= start:
            raise BadRequest("end must be after start.")
        store = self.agent.store
        evs = await asyncio.get_running_loop().run_in_executor(
            None, lambda: store.events(start, end, kind=q.get("kind"), gpu=q.get("gpu")))
        if not evs and q.get("gpu"):  # as for query_range: a GPU that is not there is not "no events"
            known = (await asyncio.get_running_loop().run_in_executor(None, store.labels)).get("gpu", [])
            if q["gpu"] not in known:
                raise BadRequest(no_such_gpu(q["gpu"], known, "this agent"))
        return json_response({"events": [asdict(e) for e in evs]})


    async def diagnose(self, request: web.Request) -> web.Response:
        from ..diagnose import diagnose, windows_from_snapshots

        if "start" in request.query or "end" in request.query:  # a past range, from the store
            from ..diagnose.history import NoData, diagnose_range, range_as_dict

            now = time.time()
            start = parse_time(request.query.get("start", "-1h"), now, "start")
            end = parse_time(request.query.get("end", "now"), now, "end")
            if end <= start:
                raise BadRequest("end must be after start.")
            store = self.agent.store
            try:
                result = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: diagnose_range(store, start, end))
            except NoData as e:
                raise BadRequest(str(e)) from None
            return json_response(range_as_dict(result))
        window = parse_duration(request.query.get("window", "30s"), "window")
        sampler = self.agent.sampler
        held = len(sampler.history) * sampler.config.interval
        if window > max(held, 1.0) * 1.5 and window > 600:
            raise BadRequest(f"window is longer than the {held:.0f} s of history the agent keeps in memory.")

        def run() -> list[Any]:
            cutoff = time.time_ns() - int(window * 1e9)
            snaps = [s for s in list(sampler.history) if s.time_ns >= cutoff]
            verdicts = diagnose(windows_from_snapshots(snaps))
            tracker = self.agent.baselines
            if tracker is not None and tracker.findings:  # against each GPU's own history (every 30 s)
                from ..diagnose import Verdict
                from ..diagnose.baseline import as_verdicts

                verdicts.extend(as_verdicts(tracker.findings, Verdict))
            return verdicts

        verdicts = await asyncio.get_running_loop().run_in_executor(None, run)
        return json_response({"window_s": window, "simulated": sampler.simulated, "verdicts": [asdict(v) for v in verdicts]})


    async def alerts(self, request: web.Request) -> web.Response:
        svc = self.agent.alerts
        if svc is None:
            return json_response({"enabled": False, "firing": [], "pending": [], "resolved": [], "rules": []})
        return json_response({"enabled": True, "simulated": self.agent.sampler.simulated, **svc.alerts()})


def public_readiness(health: dict[str, Any]) -> dict[str, Any]:
    """What /readyz tells a caller without the token: healthy, and a reason in words of its own (the store's
    reason quotes its error, which may name the data directory's files)."""
    if health.get("healthy"):
        return {"healthy": True, "reason": None}
    if health.get("flush_thread_alive") is False:
        reason = "the store's flush thread has stopped"
    elif health.get("failing_for_seconds") is not None:
        reason = (f"the store cannot write (for {health['failing_for_seconds']:.0f} s); the agent's status "
                  "(/api/v1/status, with the token) says why")
    elif health.get("last_flush_age_seconds") is not None:
        reason = f"no flush of the store has completed for {health['last_flush_age_seconds']:.0f} s"
    else:
        reason = "the store is not ready; the agent's status (/api/v1/status, with the token) says why"
    return {"healthy": False, "reason": reason}


def _prefers_html(accept: str) -> bool:
    """True when an Accept header ranks text/html above application/json, as browsers' page loads do
    (`*/*` ranks both alike, so curl and scripts keep getting JSON)."""
    weights: dict[str, float] = {}
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        weight = 1.0
        for p in params:
            if p.startswith("q="):
                try:
                    weight = float(p[2:])
                except ValueError:
                    weight = 0.0
        weights[media.lower()] = max(weights.get(media.lower(), 0.0), weight)
    html = max(weights.get("text/html", 0.0), weights.get("text/*", 0.0))
    return html > max(weights.get("application/json", 0.0), weights.get("application/*", 0.0))


def make_app(agent: AgentFace, max_request_bytes: int = 65536, *, streams_per_client: int | None = None,
             stream_stall_s: float | None = None) -> web.Application:
    """The agent's app: its API, traces, events and the dashboard, behind the kit's access rule (loopback
    Host names; the token beyond loopback and for changes) and its JSON errors."""
    from ..web.api import add_ui_routes
    from ..web.local import AgentBackend
    from .autotrace import register as register_autotrace
    from .events_api import register as register_events
    from .profile_api import register as register_profiles
    from .trace_api import register as register_traces

    api = Api(agent)
    guard = access(token=agent.token, loopback_only=agent.loopback_only, server="agent", token_hint=AGENT_TOKEN_HINT,
                   token_path=agent.token_path, probe_paths=PROBE_PATHS)
    errors = json_errors(server="agent", not_found="No such endpoint: {path}; see /api/v1/ for the list.", log=log)
    app = web.Application(middlewares=[errors, guard], client_max_size=max_request_bytes)
    api.routes(app)
    register_traces(app, agent)
    register_events(app, agent)
    register_profiles(app, agent)
    register_autotrace(app, agent)
    add_ui_routes(app, AgentBackend(agent), streams_per_client=streams_per_client, stream_stall_s=stream_stall_s)
    return app
