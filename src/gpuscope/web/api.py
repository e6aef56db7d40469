"""The dashboard's HTTP surface over any Backend: the page (/ui/), its assets and /ui/api/*.

    add_ui_routes(app, backend)            # into an existing app (the agent's), which guards it
    make_ui_app(backend, token=..., loopback_only=True, token_path="...")   # a standalone app

Endpoints (GET, JSON; every bad request is a 4xx with {"error": "one sentence"}):
/ui/api/overview, /ui/api/meta, /ui/api/range?metric=&start=-1h&end=now&step=auto&agg=mean&gpu=host/0,
/ui/api/timeline?start=&end=&gpu=, /ui/api/alerts, /ui/api/stream?interval=1s (server-sent events,
`event: overview` every interval) and /ui/api/waste?since=24h&by=namespace (the fleet report, for the page
/ui/waste; only over a backend with a `waste` view, gpuscope.web.waste: Prometheus's).

Browsers cannot send an Authorization header on a page load or from EventSource, so beyond loopback
the page is opened once as /ui/?token=TOKEN: the answer is a redirect that drops the token from the
URL and sets an HttpOnly, SameSite=Strict cookie derived from the token, which `authorized` accepts
for reads. The token itself never reaches the page.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import socket
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from ..http.auth import access
from ..http.limits import Limits
from ..http.responses import BadRequest, dumps, error_response, json_errors, json_response
from ..http.serve import stats_of
from ..timeparse import TimeError, parse_duration, parse_time
from .backend import Backend, BackendError, RangeQuery
from .waste import NEEDS_PROMETHEUS, waste_params

log = logging.getLogger("gpuscope.web")

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
# uPlot comes from npm (`make web`), never copied into the repository; the wheel carries these two files.
VENDOR_DIR = HERE / "node_modules" / "uplot" / "dist"
VENDOR_FILES = {"uPlot.iife.min.js": "application/javascript", "uPlot.min.css": "text/css"}
STATIC_FILES = {"app.js": "application/javascript", "waste.js": "application/javascript", "app.css": "text/css",
                "favicon.svg": "image/svg+xml"}
PAGES = {"/ui/": "index.html", "/ui/waste": "waste.html"}

AGGS = ("mean", "max", "min", "last")
MAX_STREAMS = 32
STREAM_SNDBUF_BYTES = 64 << 10
MAX_POINTS = 10_000          # per series in one range request
AUTO_POINTS = 1000           # what step=auto aims at
MAX_RANGE_S = 400 * 86400.0
# Steps step=auto picks from, so that neighbouring ranges share buckets (and the store's rollups align).
_NICE_STEPS_S = (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
                 43200, 86400)
_LABEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The page loads nothing from anywhere else; nothing may frame it.
CSP = "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"

BACKEND_KEY = web.AppKey("gpuscope_ui_backend", object)
STREAMS_KEY = web.AppKey("gpuscope_ui_streams", set)
PEERS_KEY = web.AppKey("gpuscope_ui_streams_per_peer", dict)
LIMITS_KEY = web.AppKey("gpuscope_ui_limits", Limits)
STALLED_KEY = web.AppKey("gpuscope_ui_streams_stalled", list)  # [count]
STOP_KEY = web.AppKey("gpuscope_ui_stop", asyncio.Event)
INTERVAL_KEY = web.AppKey("gpuscope_ui_interval", float)


# -- request parsing -------------------------------------------------------------------------------
def auto_step(span_s: float, resolution_s: float) -> float:
    """The smallest nice step giving at most ~AUTO_POINTS points, never finer than the data."""
    want = max(span_s / AUTO_POINTS, resolution_s)
    for s in _NICE_STEPS_S:
        if s >= want - 1e-12:
            return float(s)
    return float(math.ceil(want / 86400) * 86400)


def _time_range(q: Any, now: float, default_start: str = "-1h") -> tuple[int, int]:
    start = parse_time(q.get("start", default_start), now, "start")
    end = parse_time(q.get("end", "now"), now, "end")
    if end <= start:
        raise BadRequest("The range is empty: end must be after start.")
    if (end - start) / 1e9 > MAX_RANGE_S:
        raise BadRequest("The range is longer than 400 days; choose a shorter one.")
    return start, end


def _gpus(q: Any, meta: dict[str, Any]) -> tuple[str, ...]:
    raw = q.get("gpu", "")
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    known = {g["key"] for g in meta.get("gpus", [])}
    for k in keys:
        if k not in known:
            raise BackendError(404, f"There is no GPU {k!r} here; known GPUs: {', '.join(sorted(known)) or 'none yet'}.")
    return keys


def range_query(q: Any, meta: dict[str, Any], now: float) -> RangeQuery:
    """A RangeQuery from /ui/api/range's parameters, checked against the backend's meta."""
    params = dict(q)
    metric = params.pop("metric", "")
    if not metric:
        raise BadRequest("metric is required, e.g. /ui/api/range?metric=gpu_sm_active_ratio&start=-1h.")
    if metric not in meta.get("metrics", []):
        raise BadRequest(f"{metric!r} is not a metric this dashboard can chart.")
    start, end = _time_range(params, now)
    params.pop("start", None)
    params.pop("end", None)
    span_s = (end - start) / 1e9
    resolution = float(meta.get("resolution_s") or 1.0)
    step_text = params.pop("step", "auto")
    step = auto_step(span_s, resolution) if step_text == "auto" else parse_duration(step_text, "step")
    if span_s / step > MAX_POINTS:
        raise BadRequest(f"That step gives {span_s / step:.0f} points per series (at most {MAX_POINTS}); "
                         "use a larger step or step=auto.")
    agg = params.pop("agg", "mean")
    if agg not in AGGS:
        raise BadRequest(f"agg must be one of {', '.join(AGGS)}, not {agg!r}.")
    gpus = _gpus(params, meta)
    params.pop("gpu", None)
    for k in params:
        if not _LABEL.fullmatch(k):
            raise BadRequest(f"{k!r} is not a label name.")
    return RangeQuery(metric, start, end, step, agg, gpus, params)


# -- handlers --------------------------------------------------------------------------------------
def _backend(request: web.Request) -> Backend:
    return request.app[BACKEND_KEY]  # type: ignore[return-value]


async def _answer(coro: Any) -> web.Response:
    try:
        return json_response(await coro)
    except BackendError as e:
        return error_response(e.status, e.message)
    except (BadRequest, TimeError) as e:
        return error_response(400, str(e))


async def overview(request: web.Request) -> web.Response:
    return await _answer(_backend(request).overview())


async def meta(request: web.Request) -> web.Response:
    return await _answer(_backend(request).meta())


async def alerts(request: web.Request) -> web.Response:
    return await _answer(_backend(request).alerts())


async def range_(request: web.Request) -> web.Response:
    backend = _backend(request)

    async def run() -> dict[str, Any]:
        q = range_query(request.query, await backend.meta(), time.time())
        return await backend.range(q)

    return await _answer(run())


async def timeline(request: web.Request) -> web.Response:
    backend = _backend(request)

    async def run() -> dict[str, Any]:
        start, end = _time_range(request.query, time.time())
        gpus = _gpus(request.query, await backend.meta())
        return await backend.timeline(start, end, gpus)

    return await _answer(run())


async def waste(request: web.Request) -> web.Response:
    """The fleet report over the backend's Prometheus (gpuscope.web.waste); over the agent's own backend, the
    sentence that says where the view lives."""
    view = getattr(_backend(request), "waste", None)
    if view is None:
        return error_response(404, NEEDS_PROMETHEUS)

    async def run() -> dict[str, Any]:
        since_s, by = waste_params(request.query)
        return await view.answer(since_s, by)

    return await _answer(run())


async def stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events: `event: overview` with the overview JSON every `interval` (0.25-10 s); a
    comment line when nothing changed, so proxies and the browser see the connection alive.

    At most MAX_STREAMS on the server and `streams_per_client` per peer address (a 429 past it); a
    client that reads nothing for `stream_stall_s` (one write waiting that long) is cut off and gives
    its slot back."""
    try:
        interval = parse_duration(request.query.get("interval", ""), "interval") if "interval" in request.query \
            else request.app[INTERVAL_KEY]
    except TimeError as e:
        return error_response(400, str(e))
    if not 0.25 <= interval <= 10:
        return error_response(400, "interval must be between 250ms and 10s.")
    streams = request.app[STREAMS_KEY]
    per_peer: dict[str, int] = request.app[PEERS_KEY]
    limits: Limits = request.app[LIMITS_KEY]
    peer = request.remote or "?"
    stats = stats_of(request)
    if per_peer.get(peer, 0) >= limits.streams_per_client:
        if stats is not None:
            stats.count("streams_per_client")
        return error_response(429, f"Too many live dashboards ({limits.streams_per_client}) are open from {peer}, "
                                   "the most one client may hold; close one and reload.", {"Retry-After": "10"})
    if len(streams) >= MAX_STREAMS:
        if stats is not None:
            stats.count("streams_server_full")
        return error_response(503, f"Too many live dashboards ({MAX_STREAMS}) are open on this server; "
                                   "close one and reload.")
    stop = request.app[STOP_KEY]
    backend = _backend(request)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                       "X-Accel-Buffering": "no"})
    streams.add(resp)
    per_peer[peer] = per_peer.get(peer, 0) + 1

    async def write(data: bytes) -> None:
        # A client that stops reading blocks a write once the socket's buffers are full; bounded, so its
        # slot comes back (the kernel's buffer is kept small for streams: see _small_send_buffer).
        try:
            await asyncio.wait_for(resp.write(data), limits.stream_stall_s)
        except asyncio.TimeoutError:
            raise _Stalled from None

    try:
        await resp.prepare(request)
        _small_send_buffer(request)
        await write(f"retry: {int(max(interval, 1.0) * 2000)}\n: gpuscope overview stream\n\n".encode())
        last = None
        while not stop.is_set():
            try:
                data = await backend.overview()
                event = "overview"
            except BackendError as e:
                data, event = {"error": e.message}, "error"
            stamp = (event, data.get("time_ns"))
            if stamp == last:
                await write(b": keep-alive\n\n")
            else:
                await write(f"event: {event}\ndata: {dumps(data)}\n\n".encode())
                last = stamp
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass
    except _Stalled:  # one write waited stream_stall_s: the client reads nothing
        request.app[STALLED_KEY][0] += 1
        if stats is not None:
            stats.count("stream_stalled")
        log.info("a dashboard stream from %s read nothing for %g s; closed it", peer, limits.stream_stall_s)
        if request.transport is not None:
            request.transport.abort()  # close() would wait to flush what the client will never read
    except ConnectionResetError:
        pass  # the browser went away
    finally:
        streams.discard(resp)
        per_peer[peer] -= 1
        if not per_peer[peer]:
            del per_peer[peer]
    return resp


class _Stalled(Exception):
    """A stream's write waited stream_stall_s."""


def _small_send_buffer(request: web.Request) -> None:
    """A stream sends a few kB a second: 64 KiB of kernel buffer is plenty, and a client that stops reading
    then blocks a write within seconds rather than after megabytes of autotuned buffer."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF_BYTES)
        except OSError:
            pass


# -- the page and its assets -----------------------------------------------------------------------
def _file(path: Path, content_type: str) -> web.StreamResponse:
    if not path.is_file():
        raise web.HTTPNotFound()
    return web.FileResponse(path, headers={"Content-Type": content_type, "Cache-Control": "no-cache",
                                           "X-Content-Type-Options": "nosniff"})


async def page(request: web.Request) -> web.StreamResponse:
    path = STATIC_DIR / PAGES[request.path]
    if not path.is_file():
        return error_response(500, f"The dashboard page is missing from this install ({path}); reinstall gpuscope.")
    return web.FileResponse(path, headers={"Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-cache",
                                           "Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                                           "Referrer-Policy": "no-referrer"})


async def static(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name not in STATIC_FILES:
        raise web.HTTPNotFound()
    return _file(STATIC_DIR / name, STATIC_FILES[name])


async def vendor(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name not in VENDOR_FILES:
        raise web.HTTPNotFound()
    if not (VENDOR_DIR / name).is_file():
        return error_response(404, "The chart library is missing: run `make web` "
                                   "(npm ci --prefix src/gpuscope/web --omit=dev).")
    return _file(VENDOR_DIR / name, VENDOR_FILES[name])


async def _redirect_to_page(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/ui/" + ("?" + request.query_string if request.query_string else ""))


def add_ui_routes(app: web.Application, backend: Backend, *, stream_interval_s: float = 1.0,
                  streams_per_client: int | None = None, stream_stall_s: float | None = None) -> None:
    """The page, its assets and /ui/api/* over `backend`; the app's own middleware guards them. Live
    streams end when the app shuts down, so a stopping server does not wait on open dashboards."""
    d = Limits()
    app[BACKEND_KEY] = backend
    app[STREAMS_KEY] = set()
    app[PEERS_KEY] = {}
    app[STALLED_KEY] = [0]
    app[LIMITS_KEY] = Limits(streams_per_client=streams_per_client or d.streams_per_client,
                             stream_stall_s=stream_stall_s or d.stream_stall_s).checked()
    app[STOP_KEY] = asyncio.Event()
    app[INTERVAL_KEY] = float(stream_interval_s)

    async def on_shutdown(app: web.Application) -> None:
        app[STOP_KEY].set()

    app.on_shutdown.append(on_shutdown)
    r = app.router
    r.add_get("/ui", _redirect_to_page)
    r.add_get("/ui/", page)
    r.add_get("/ui/waste", page)
    r.add_get("/ui/static/{name}", static)
    r.add_get("/ui/vendor/{name}", vendor)
    r.add_get("/ui/api/overview", overview)
    r.add_get("/ui/api/meta", meta)
    r.add_get("/ui/api/range", range_)
    r.add_get("/ui/api/timeline", timeline)
    r.add_get("/ui/api/alerts", alerts)
    r.add_get("/ui/api/stream", stream)
    r.add_get("/ui/api/waste", waste)


DASHBOARD_TOKEN_HINT = "the dashboard's token file (--token-file; see 'gpuscope dashboard --help')"


def make_ui_app(backend: Backend, *, token: str | None, loopback_only: bool, token_path: str = "",
                token_hint: str = DASHBOARD_TOKEN_HINT, stream_interval_s: float = 1.0,
                streams_per_client: int | None = None, stream_stall_s: float | None = None) -> web.Application:
    """A standalone dashboard app (for `gpuscope dashboard`) with the agent's access rule (gpuscope.http.auth);
    `/` opens the page, and the backend is closed with the app. `token_path` goes to the log only."""
    guard = access(token=token, loopback_only=loopback_only, server="dashboard", token_hint=token_hint,
                   token_path=token_path or None)
    errors = json_errors(server="dashboard", not_found="No such page: {path}; the dashboard is at /ui/.", log=log)
    app = web.Application(middlewares=[errors, guard])
    add_ui_routes(app, backend, stream_interval_s=stream_interval_s, streams_per_client=streams_per_client,
                  stream_stall_s=stream_stall_s)
    app.router.add_get("/", _redirect_to_page)

    async def close_backend(app: web.Application) -> None:
        await backend.close()

    app.on_cleanup.append(close_backend)
    return app
