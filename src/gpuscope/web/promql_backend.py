"""The dashboard's Backend over a Prometheus server: every GPU of every agent it scrapes, one UI.

    backend = PrometheusBackend("http://prometheus:9090")
    ov = await backend.overview()        # gpuscope.viewmodel's overview shape, source 'prometheus'
    await backend.close()

It reads what `gpuscope agent` exports on /metrics (canonical names). A GPU's key is its `hostname`
label (the target's `instance` when there is none) + '/' + its `gpu` label, so a fleet's GPUs never
collide. Each request is a few PromQL queries sent together (POST, so long selectors never hit a URL
limit); a Prometheus that is down, slow, or answers something else than its JSON API is a
BackendError (503 unreachable or timed out, 502 anything else) with one sentence naming the server.

What Prometheus cannot give that the agent can: values at the scrape interval, not the sampler's
100 ms; verdicts only as gpu_verdict's kind and confidence (no evidence, summary or advice: the page
gets a summary made from the kind); processes only as the agent exported them (its top processes per
GPU, the rest summed into one 'other' row; no full command line, start time or parent pid); no
resolved alerts (Prometheus's API lists only pending and firing ones).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

import aiohttp

from .. import timeparse
from .._redact import redact_url
from .._version import __version__
from ..catalog import decode_clock_event_reasons
from ..promql import BadLabelName, label_matcher, quote, regex_alternation, selector
from ..viewmodel import _BENIGN_REASONS, GPU_METRICS, gpu_key, merge
from .backend import BackendError, RangeQuery
from .waste import WasteView

if TYPE_CHECKING:
    from ..fleet import Prices

__all__ = ["PrometheusBackend", "label_matcher", "quote"]

# Verdict kinds that come beside the primary one (gpuscope.diagnose: made with primary=False).
SIDE_KINDS = frozenset({"throttled", "power_capped", "memory_growth", "hardware", "imbalance", "anomaly",
                        "peer_outlier"})
# gpu_verdict carries no severity: each kind's usual one, as the diagnose rules give it.
SEVERITY = {"tensor_cores_unused": "warning", "memory_access_bound": "warning", "transfer_bound": "warning",
            "launch_or_sync_bound": "warning", "input_starved": "warning", "launch_bound": "warning",
            "sync_bound": "warning", "host_bound": "warning", "idle_allocated": "warning",
            "underutilized": "warning", "throttled": "warning", "memory_growth": "warning", "hardware": "critical",
            "gpu_lost": "critical", "imbalance": "warning", "anomaly": "warning", "peer_outlier": "warning"}
VERDICT_WINDOW = "30s"     # the window the agent always exports gpu_verdict for (alerts.engine.VERDICT_WINDOW_S)
PROCESS_METRICS = {"gpu_process_memory_used_bytes": "gpu_memory_bytes", "gpu_process_sm_active_ratio": "sm_ratio",
                   "process_cpu_cores": "cpu_cores", "process_resident_memory_bytes": "rss_bytes"}
CHARTABLE = re.compile(r"(gpu|process|host)_[A-Za-z0-9_:]+")
NOT_CHARTED = frozenset({"gpu_info", "gpu_verdict"})
MAX_POINTS = 11_000        # Prometheus refuses a range query with more points per series
TIMELINE_POINTS = 1000     # the timeline's grid: fine enough for spans, cheap for a fleet
MAX_EVENTS = 5000
MAX_PROCESS_EVENTS = 1000  # process start/stop on a busy fleet would drown the rest
DEFAULT_RESOLUTION_S = 15.0
OVERVIEW_TTL_S = 1.0       # every open page streams the overview each second: they share one
META_TTL_S = 30.0          # api.py asks for meta on every range request

_METRIC = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_BENIGN_RE = "|".join(sorted(_BENIGN_REASONS))
_AGG = {"mean": ("avg", "avg_over_time"), "max": ("max", "max_over_time"), "min": ("min", "min_over_time"),
        "last": ("max", "last_over_time")}


# -- PromQL text: quote, regex_alternation, label_matcher and selector live in gpuscope.promql --------
def _duration(seconds: float) -> str:
    """A PromQL duration, whole milliseconds (Prometheus takes no fractions)."""
    return f"{max(1, round(seconds * 1000))}ms"


def parse_duration(text: str) -> float | None:
    """Seconds of a Prometheus duration such as '15s' or '1m30s' (gpuscope.timeparse's grammar); None when
    it is not one."""
    try:
        return timeparse.parse_duration(text or "")
    except timeparse.TimeError:
        return None


# -- answers ---------------------------------------------------------------------------------------
def _host(labels: dict[str, str]) -> str:
    return labels.get("hostname") or labels.get("instance") or ""


def _key(labels: dict[str, str]) -> str | None:
    gpu = labels.get("gpu")
    return None if gpu is None else gpu_key(_host(labels), gpu)


def _number(text: Any) -> float | None:
    try:
        v = float(text)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _instant(result: Any) -> list[tuple[dict[str, str], float | None, float]]:
    """(labels, value, time in seconds) of an instant vector."""
    out = []
    for r in result if isinstance(result, list) else []:
        try:
            t, v = r["value"]
            out.append((dict(r.get("metric", {})), _number(v), float(t)))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _grid(result: Any, start_s: float, step_s: float, n: int) -> list[tuple[dict[str, str], list[float | None]]]:
    """A range query's matrix laid on the grid start + i*step (n points); missing points are None."""
    out = []
    for r in result if isinstance(result, list) else []:
        vals: list[float | None] = [None] * n
        for pair in r.get("values", []) if isinstance(r, dict) else []:
            try:
                i = round((float(pair[0]) - start_s) / step_s)
            except (TypeError, ValueError, IndexError):
                continue
            if 0 <= i < n:
                vals[i] = _number(pair[1])
        out.append((dict(r.get("metric", {})), vals))
    return out


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split()).rstrip(".")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _epoch_s(text: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _alert(a: dict[str, Any], for_s: dict[str, float] | None = None) -> dict[str, Any]:
    """A Prometheus alert in the agent's alert shape (alerts.engine.Alert.to_dict), with its rule's `for` in
    seconds (for_s) where the rules API gave it: a pending alert is told as how long it has held of that."""
    labels = {str(k): str(v) for k, v in (a.get("labels") or {}).items()}
    fp = hashlib.sha256(json.dumps(sorted(labels.items())).encode()).hexdigest()[:16]
    rule = labels.get("alertname", "")
    return {"rule": rule, "fingerprint": fp, "state": a.get("state", ""), "labels": labels,
            "annotations": dict(a.get("annotations") or {}), "value": _number(a.get("value")),
            "active_at": _epoch_s(a.get("activeAt")), "fired_at": None, "resolved_at": None,
            "for_s": (for_s or {}).get(rule)}


def _rule_durations(data: Any) -> dict[str, float]:
    """Alerting rule name -> its `for` (seconds), from /api/v1/rules?type=alert ('duration')."""
    out: dict[str, float] = {}
    for group in (data or {}).get("groups", []) if isinstance(data, dict) else []:
        for r in group.get("rules", []) if isinstance(group, dict) else []:
            d = _number(r.get("duration")) if isinstance(r, dict) else None
            if isinstance(r, dict) and isinstance(r.get("name"), str) and d is not None and d > 0:
                out[r["name"]] = d
    return out


def _summary(confidence: float | None, window: str) -> str:
    conf = "" if confidence is None else f"{confidence:.0%} confidence "
    return f"{conf}over the last {window or 'window'} (from gpu_verdict: the agent has the evidence)."


class PrometheusBackend:
    """Backend over Prometheus's HTTP API. `headers` go with every request (e.g. Authorization), the waste
    view's too (`waste`: the fleet report over this server, priced by `prices`)."""

    source = "prometheus"

    def __init__(self, url: str, *, timeout: float = 10, headers: dict[str, str] | None = None,
                 prices: Prices | None = None) -> None:
        self.url = url.rstrip("/")
        self.shown = redact_url(self.url)
        self.timeout = float(timeout)
        self.headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._overview: tuple[float, dict[str, Any]] | None = None
        self._meta: tuple[float, dict[str, Any]] | None = None
        self._rules: tuple[float, dict[str, float]] | None = None
        self.waste = WasteView(self.url, timeout_s=self.timeout, prices=prices, headers=self.headers)

    # -- HTTP ------------------------------------------------------------------------------------
    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # A session belongs to the loop it was made in; a backend reused from another loop
            # (a test, a second asyncio.run) gets a fresh one.
            self._session = aiohttp.ClientSession(headers=self.headers,
                                                  timeout=aiohttp.ClientTimeout(total=self.timeout))
            self._loop = loop
        return self._session

    async def api(self, path: str, params: dict[str, str] | list[tuple[str, str]] | None = None, *,
                  post: bool = False) -> Any:
        """`data` of Prometheus's answer to GET (or form POST) `path`; BackendError for anything else."""
        where = f"Prometheus at {self.shown}"
        try:
            session = self._client()
            if post:
                req = session.post(self.url + path, data=params)
            else:
                req = session.get(self.url + path, params=params)
            async with req as r:
                status, body = r.status, await r.read()
        except TimeoutError:
            raise BackendError(503, f"{where} did not answer {path} within {self.timeout:g} s.") from None
        except aiohttp.ClientConnectorError as e:
            why = getattr(e.os_error, "strerror", None) or "connection failed"
            raise BackendError(503, f"{where} cannot be reached: {why}.") from None
        except (aiohttp.InvalidURL, ValueError):
            raise BackendError(502, f"{where} is not a URL aiohttp can send to.") from None
        except aiohttp.ClientError as e:
            raise BackendError(502, f"{where} broke off its answer to {path} ({type(e).__name__}).") from None
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
            doc = None
        if isinstance(doc, dict) and doc.get("status") == "success" and status < 400:
            return doc.get("data")
        if isinstance(doc, dict) and doc.get("error"):
            raise BackendError(503 if status == 503 else 502,
                               f"{where} refused {path} (HTTP {status}): {_one_line(doc['error'])}.")
        raise BackendError(503 if status == 503 else 502,
                           f"{where} answered {path} with HTTP {status} and no Prometheus API JSON: the URL is "
                           "not a Prometheus server, or a proxy in front of it wants credentials.")

    async def query(self, promql: str) -> Any:
        """An instant query's result list."""
        data = await self.api("/api/v1/query", {"query": promql}, post=True)
        return data.get("result", []) if isinstance(data, dict) else []

    async def query_range(self, promql: str, start_s: float, end_s: float, step_s: float) -> Any:
        data = await self.api("/api/v1/query_range", {"query": promql, "start": f"{start_s:.3f}",
                                                      "end": f"{end_s:.3f}", "step": f"{step_s:.3f}"}, post=True)
        return data.get("result", []) if isinstance(data, dict) else []

    async def check(self) -> int:
        """That the server answers PromQL; the number of gpu_info series it has now."""
        return len(await self.query("gpu_info"))

    async def close(self) -> None:
        self.waste.close()
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    # -- now -------------------------------------------------------------------------------------
    async def overview(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._overview is not None and now - self._overview[0] < OVERVIEW_TTL_S:
            return self._overview[1]
        ov = await self._build_overview()
        self._overview = (time.monotonic(), ov)
        return ov

    async def _build_overview(self) -> dict[str, Any]:
        names = "|".join(GPU_METRICS)
        procs = "|".join(PROCESS_METRICS)
        queries = {
            "values": f'{{__name__=~"{names}"}}',
            "info": "gpu_info",
            "healthy": "gpu_healthy",
            "mask": "gpu_clock_event_reasons",
            # Without the bitmask (an older agent, a relabelled metric): a reason counter that grew
            # between its last two scrapes is active now.
            "throttle": f'irate(gpu_throttle_seconds_total{{reason!~"{_BENIGN_RE}"}}[5m]) > 0',
            "verdict": "gpu_verdict",
            "procs": f'{{__name__=~"{procs}"}}',
            # Targets that exported GPUs within the hour and fail to be scraped now: their GPUs are missing.
            "down": "(up == 0) and on (job, instance) max by (job, instance) (last_over_time(gpu_info[1h]))",
        }
        keys = list(queries)
        answers = await asyncio.gather(*(self.query(q) for q in queries.values()), self.api("/api/v1/alerts"),
                                       return_exceptions=True)
        got: dict[str, Any] = dict(zip(keys, answers[:-1], strict=True))
        if isinstance(got["values"], BaseException):  # the server is down or refuses the main query
            raise got["values"] if isinstance(got["values"], BackendError) else BackendError(
                502, f"Prometheus at {self.shown} could not be read: {type(got['values']).__name__}.")
        errors = [f"{k}: {v.message}" for k, v in got.items() if isinstance(v, BackendError)]
        gpus: dict[str, dict[str, Any]] = {}

        def gpu(labels: dict[str, str]) -> dict[str, Any] | None:
            key = _key(labels)
            if key is None:
                return None
            g = gpus.get(key)
            if g is None:
                g = gpus[key] = {"key": key, "host": _host(labels), "gpu": labels["gpu"], "uuid": "", "name": "",
                                 "healthy": True, "simulated": None, "values": dict.fromkeys(GPU_METRICS),
                                 "throttle": [], "verdict": None, "side": []}
            g["uuid"] = g["uuid"] or labels.get("uuid", "")
            g["name"] = g["name"] or labels.get("model", "")
            g["simulated"] = g["simulated"] or labels.get("simulated")
            return g

        def rows(name: str) -> list[tuple[dict[str, str], float | None, float]]:
            v = got[name]
            return [] if isinstance(v, BaseException) else _instant(v)

        newest = 0.0
        for labels, _, _ in rows("info"):
            gpu(labels)
        for labels, v, t in rows("values"):
            g = gpu(labels)
            name = labels.get("__name__", "")
            if g is not None and name in g["values"]:
                g["values"][name] = v
                newest = max(newest, t)
        for labels, v, _ in rows("healthy"):
            g = gpu(labels)
            if g is not None and v is not None:
                g["healthy"] = v >= 0.5
        masked = set()
        for labels, v, _ in rows("mask"):
            g = gpu(labels)
            if g is not None and v is not None:
                masked.add(g["key"])
                g["throttle"] = [r for r in decode_clock_event_reasons(int(v)) if r not in _BENIGN_REASONS]
        for labels, _, _ in rows("throttle"):
            g = gpu(labels)
            reason = labels.get("reason")
            if g is not None and reason and g["key"] not in masked and reason not in g["throttle"]:
                g["throttle"].append(reason)
        self._verdicts(gpus, rows("verdict"))
        processes = self._processes(rows("procs"))
        for labels, _, _ in rows("down"):
            errors.append(f"Prometheus cannot scrape {labels.get('instance', '?')} (job {labels.get('job', '?')}) "
                          "now: its GPUs are missing here.")
        alerts = answers[-1]
        if isinstance(alerts, BaseException):
            errors.append(f"alerts: {getattr(alerts, 'message', type(alerts).__name__)}")
            alerts = {}
        durations = await self._rule_for()
        mapped = [_alert(a, durations) for a in (alerts or {}).get("alerts", []) if isinstance(a, dict)]
        ov = merge([{"gpus": list(gpus.values()), "processes": processes,
                     "alerts": {"firing": [a for a in mapped if a["state"] == "firing"],
                                "pending": [a for a in mapped if a["state"] == "pending"]},
                     "errors": errors}], self.source)
        ov["simulated"] = next((g["simulated"] for g in ov["gpus"] if g["simulated"]), None)
        ov["time_ns"] = int(newest * 1e9) if newest else time.time_ns()
        return ov

    @staticmethod
    def _verdicts(gpus: dict[str, dict[str, Any]], rows: list[tuple[dict[str, str], float | None, float]]) -> None:
        """Per GPU, the highest-confidence primary verdict and every side verdict; the 30 s window the
        agent always exports is preferred, else the shortest window there is."""
        by_key: dict[str, dict[str, list[tuple[str, float]]]] = {}
        for labels, v, _ in rows:
            key, kind = _key(labels), labels.get("kind")
            if key in gpus and kind and v is not None:
                by_key.setdefault(key, {}).setdefault(labels.get("window", ""), []).append((kind, v))
        for key, windows in by_key.items():
            window = VERDICT_WINDOW if VERDICT_WINDOW in windows else min(
                windows, key=lambda w: parse_duration(w) or math.inf)
            found = windows[window]
            primary = [(c, k) for k, c in found if k not in SIDE_KINDS]
            if primary:
                conf, kind = max(primary)
                gpus[key]["verdict"] = {"kind": kind, "severity": SEVERITY.get(kind, "info"), "confidence": conf,
                                        "summary": _summary(conf, window)}
            gpus[key]["side"] = [{"kind": k, "severity": SEVERITY.get(k, "info"), "summary": _summary(c, window)}
                                 for k, c in sorted(found) if k in SIDE_KINDS]

    @staticmethod
    def _processes(rows: list[tuple[dict[str, str], float | None, float]]) -> list[dict[str, Any]]:
        procs: dict[tuple[str, str, str], dict[str, Any]] = {}
        for labels, v, _ in rows:
            field = PROCESS_METRICS.get(labels.get("__name__", ""))
            gpu, pid = labels.get("gpu"), labels.get("pid")
            if field is None or gpu is None or pid is None:
                continue
            host = _host(labels)
            p = procs.get((host, gpu, pid))
            if p is None:
                other = pid == "other"
                if not other and not pid.isdigit():
                    continue
                name = "other" if other else labels.get("process", "")
                # The agent sums the processes beyond its top_processes per GPU into pid="other":
                # one row, pid 0, so the GPU's memory still adds up.
                p = procs[(host, gpu, pid)] = {
                    "key": f"{host}/{pid}/{gpu}", "host": host, "gpu_key": gpu_key(host, gpu), "gpu": gpu,
                    "pid": 0 if other else int(pid), "user": labels.get("user", ""), "name": name,
                    "command": "(the other processes on this GPU, summed by the agent)" if other else name,
                    "gpu_memory_bytes": None, "sm_ratio": None, "cpu_cores": None, "rss_bytes": None,
                    "container": labels.get("container", ""), "pod": labels.get("pod", ""),
                    "namespace": labels.get("namespace", ""), "started_at": None, "ppid": None}
            p[field] = v
        return list(procs.values())

    async def alerts(self) -> dict[str, Any]:
        data = await self.api("/api/v1/alerts")
        durations = await self._rule_for()
        mapped = [_alert(a, durations) for a in (data or {}).get("alerts", []) if isinstance(a, dict)]
        return {"firing": [a for a in mapped if a["state"] == "firing"],
                "pending": [a for a in mapped if a["state"] == "pending"],
                "resolved": [], "enabled": True}

    async def _rule_for(self) -> dict[str, float]:
        """The alerting rules' `for` durations, asked again every META_TTL_S; {} when the rules API fails (the
        alerts are still shown, told without their `for`)."""
        now = time.monotonic()
        if self._rules is not None and now - self._rules[0] < META_TTL_S:
            return self._rules[1]
        try:
            got = _rule_durations(await self.api("/api/v1/rules", {"type": "alert"}))
        except BackendError:
            got = {}
        self._rules = (now, got)
        return got

    # -- the past --------------------------------------------------------------------------------
    async def meta(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._meta is not None and now - self._meta[0] < META_TTL_S:
            return self._meta[1]
        answers: tuple[Any, ...] = await asyncio.gather(
            self.api("/api/v1/label/__name__/values", [("match[]", '{__name__=~"(gpu|process|host)_.+"}')]),
            self.query("max by (hostname, instance, gpu, model, job, simulated) (last_over_time(gpu_info[1h]))"),
            self.api("/api/v1/targets", {"state": "active"}),
            return_exceptions=True)
        names, info, targets = answers
        for r in (names, info):
            if isinstance(r, BaseException):
                raise r
        gpus: dict[str, dict[str, Any]] = {}
        jobs, simulated = set(), None
        for labels, _, _ in _instant(info):
            key = _key(labels)
            if key is not None:
                gpus.setdefault(key, {"key": key, "host": _host(labels), "gpu": labels["gpu"],
                                      "name": labels.get("model", "")})
                jobs.add(labels.get("job"))
                simulated = simulated or labels.get("simulated")
        metrics = {n for n in names or [] if isinstance(n, str) and CHARTABLE.fullmatch(n)} - NOT_CHARTED
        meta = {"source": self.source, "simulated": simulated, "version": __version__, "prometheus": self.shown,
                "gpus": [gpus[k] for k in sorted(gpus, key=lambda k: (gpus[k]["host"], _gpu_order(gpus[k]["gpu"])))],
                # GPU metrics always (a fresh server has none yet), like the agent's own dashboard.
                "metrics": sorted(metrics | set(GPU_METRICS)),
                "resolution_s": _scrape_interval(targets, jobs), "oldest_ns": None}
        self._meta = (time.monotonic(), meta)
        return meta

    async def _resolution(self) -> float:
        try:
            return float((await self.meta())["resolution_s"])
        except BackendError:
            return DEFAULT_RESOLUTION_S

    async def range(self, q: RangeQuery) -> dict[str, Any]:
        if not _METRIC.fullmatch(q.metric):
            raise BackendError(400, f"{q.metric!r} is not a metric name.")
        if q.end_ns <= q.start_ns or not q.step_s > 0:
            raise BackendError(400, "The range is empty or its step is not positive.")
        start_s, end_s = q.start_ns / 1e9, q.end_ns / 1e9
        step = max(float(q.step_s), 0.001, (end_s - start_s) / (MAX_POINTS - 1))
        resolution = await self._resolution()
        try:
            matchers = [label_matcher(k, str(v)) for k, v in sorted(q.labels.items())]
        except BadLabelName as e:
            raise BackendError(400, str(e)) from None
        wanted = set(q.gpus)
        if wanted:
            matchers.append(label_matcher("gpu", regex_alternation(_gpu_label(k) for k in wanted), "=~"))
        sel = selector(q.metric, matchers)
        outer, over_time = _AGG.get(q.agg, _AGG["mean"])
        if q.metric.endswith("_total"):
            # A counter is charted as its per-second rate. rate() needs two samples in its window:
            # 2 x step makes each point cover its whole step (no increase between points is lost),
            # and at least 4 scrape intervals (1 m at the usual 15 s) keeps a sample lost to a late
            # scrape from leaving a gap. The step's mean, max or min of a rate is the rate.
            inner = f"rate({sel}[{_duration(max(2 * step, 4 * resolution))}])"
        else:
            # Over the step, so a mean is the step's mean; never narrower than two scrapes, or a
            # step finer than the scrape interval would fall between samples and chart as gaps.
            inner = f"{over_time}({sel}[{_duration(max(step, 2 * resolution))}])"
        # Without job, uuid and model: one agent scraped by two jobs charts once.
        promql = f"{outer} without (job, uuid, model) ({inner})"
        n = int((end_s - start_s) // step) + 1
        result = await self.query_range(promql, start_s, end_s, step)
        series: list[dict[str, Any]] = []
        simulated = None
        for labels, values in _grid(result, start_s, step, n):
            key = _key(labels)
            if wanted and key not in wanted:
                continue
            simulated = labels.pop("simulated", None) or simulated
            labels.pop("__name__", None)
            if "hostname" in labels:
                labels.pop("instance", None)
            series.append({"gpu_key": key, "labels": labels,
                           "timestamps_ns": [int(round((start_s + i * step) * 1e9)) for i in range(n)],
                           "values": values})
        series.sort(key=lambda s: (s["gpu_key"] or "", sorted(s["labels"].items())))
        return {"metric": q.metric, "start_ns": q.start_ns, "end_ns": q.end_ns, "step_s": step, "agg": q.agg,
                "simulated": simulated, "series": series}

    async def timeline(self, start_ns: int, end_ns: int, gpus: tuple[str, ...] = ()) -> dict[str, Any]:
        if end_ns <= start_ns:
            raise BackendError(400, "The range is empty: end must be after start.")
        start_s, end_s = start_ns / 1e9, end_ns / 1e9
        resolution = await self._resolution()
        step = max(resolution, (end_s - start_s) / (TIMELINE_POINTS - 1))
        n = int((end_s - start_s) // step) + 1
        wanted = set(gpus)
        m = [label_matcher("gpu", regex_alternation(_gpu_label(k) for k in wanted), "=~")] if wanted else []
        queries = {
            "verdict": selector("gpu_verdict", m),
            "xid": selector("gpu_xid_events_total", m),
            "ecc": selector("gpu_ecc_events_total", m),
            "throttle": selector("gpu_throttle_seconds_total", [*m, f'reason!~"{_BENIGN_RE}"']),
            "healthy": selector("gpu_healthy", m),
            "procs": selector("gpu_process_memory_used_bytes", [*m, 'pid!="other"']),
        }
        answers = await asyncio.gather(*(self.query_range(q, start_s, end_s, step) for q in queries.values()))
        grids = {}
        for name, result in zip(queries, answers, strict=True):
            grids[name] = [(lab, vals) for lab, vals in _grid(result, start_s, step, n)
                           if not wanted or _key(lab) in wanted]

        def t_ns(i: int) -> int:
            return int(round((start_s + i * step) * 1e9))

        spans = _spans(grids["verdict"], n, step, t_ns, end_ns)
        events: list[dict[str, Any]] = []
        for kind, name in (("xid", "xid"), ("ecc", "ecc")):
            for labels, vals in grids[name]:
                for i, inc in _increases(vals):
                    events.append({"time_ns": t_ns(i), "kind": kind, "gpu_key": _key(labels),
                                   "message": _event_message(kind, labels), "count": int(round(inc))})
        for labels, vals in grids["throttle"]:
            active_before = None
            for i, inc in _deltas(vals):
                active = inc > 0
                if active and active_before is False:
                    events.append({"time_ns": t_ns(i), "kind": "clock_events", "gpu_key": _key(labels),
                                   "message": f"Clock event on GPU {labels.get('gpu')}: {labels.get('reason')}",
                                   "count": 1})
                active_before = active
        for labels, vals in grids["healthy"]:
            before = None
            for i, v in enumerate(vals):
                if v is None:
                    continue
                if before is not None and before >= 0.5 > v:
                    events.append({"time_ns": t_ns(i), "kind": "gpu_lost", "gpu_key": _key(labels),
                                   "message": f"GPU {labels.get('gpu')} is lost (gpu_healthy went to 0)", "count": 1})
                before = v
        events.extend(_process_events(grids["procs"], n, t_ns)[-MAX_PROCESS_EVENTS:])
        events.sort(key=lambda e: e["time_ns"])
        return {"spans": spans, "events": events[-MAX_EVENTS:]}


# -- helpers of the backend ------------------------------------------------------------------------
def _gpu_label(key: str) -> str:
    """The gpu label of a GPU key 'host/gpu': all after the host, so a MIG key 'host/0/mig3' gives '0/mig3'
    (not 'mig3', which matched nothing)."""
    return key.split("/", 1)[-1]


def _gpu_order(label: str) -> tuple[int, str]:
    head = label.split("/", 1)[0]
    return (int(head), label) if head.isdigit() else (1 << 30, label)


def _scrape_interval(targets: Any, jobs: set[Any]) -> float:
    """The shortest scrape interval of the targets that export GPUs (any target's when none is known)."""
    if isinstance(targets, BaseException) or not isinstance(targets, dict):
        return DEFAULT_RESOLUTION_S
    found = []
    for t in targets.get("activeTargets", []):
        if not isinstance(t, dict) or (jobs and (t.get("labels") or {}).get("job") not in jobs):
            continue
        s = parse_duration(str(t.get("scrapeInterval", "")))
        if s:
            found.append(s)
    return min(found) if found else DEFAULT_RESOLUTION_S


def _deltas(vals: list[float | None]) -> list[tuple[int, float]]:
    """(index, increase since the previous present point) of a counter; a drop is a reset, so the
    increase is the new value (as Prometheus's own increase() counts it)."""
    out, prev = [], None
    for i, v in enumerate(vals):
        if v is None:
            continue
        if prev is not None:
            out.append((i, v - prev if v >= prev else v))
        prev = v
    return out


def _increases(vals: list[float | None]) -> list[tuple[int, float]]:
    """Where an event counter grew. A series that first shows up inside the range (not at its first
    point) was created by its first events: its value is their count."""
    out = [(i, d) for i, d in _deltas(vals) if d > 0]
    first = next((i for i, v in enumerate(vals) if v is not None), None)
    if first is not None and first > 0 and (vals[first] or 0) > 0:
        out.insert(0, (first, float(vals[first] or 0)))
    return out


def _event_message(kind: str, labels: dict[str, str]) -> str:
    gpu = labels.get("gpu")
    if kind == "xid":
        from ..sources.events import XID_MEANING

        code = labels.get("xid", "?")
        meaning = XID_MEANING.get(int(code), "see NVIDIA's XID catalog") if code.isdigit() else "unknown code"
        return f"XID {code} on GPU {gpu}: {meaning}"
    return f"{labels.get('type', 'unknown')} ECC error on GPU {gpu}"


def _spans(grid: list[tuple[dict[str, str], list[float | None]]], n: int, step: float, t_ns: Any,
           end_ns: int) -> list[dict[str, Any]]:
    """Contiguous runs of the same primary verdict per GPU (highest confidence at each point)."""
    by_key: dict[str, dict[str, list[tuple[str, list[float | None]]]]] = {}
    for labels, vals in grid:
        key, kind = _key(labels), labels.get("kind")
        if key is not None and kind and kind not in SIDE_KINDS:
            by_key.setdefault(key, {}).setdefault(labels.get("window", ""), []).append((kind, vals))
    spans = []
    for key, windows in sorted(by_key.items()):
        window = VERDICT_WINDOW if VERDICT_WINDOW in windows else min(
            windows, key=lambda w: parse_duration(w) or math.inf)
        series = windows[window]
        runs: list[list[Any]] = []  # [kind, first index, last index, best confidence]
        for i in range(n):
            here = [(v, kind) for kind, vals in series if (v := vals[i]) is not None]
            if not here:
                continue
            conf, kind = max(here)
            if runs and runs[-1][0] == kind and runs[-1][2] == i - 1:
                runs[-1][2], runs[-1][3] = i, max(runs[-1][3], conf)
            else:
                runs.append([kind, i, i, conf])
        for kind, first, last, conf in runs:
            spans.append({"gpu_key": key, "kind": kind, "severity": SEVERITY.get(kind, "info"),
                          "start_ns": t_ns(first), "end_ns": min(end_ns, t_ns(last) + int(step * 1e9)),
                          "summary": _summary(conf, window)})
    return spans


def _process_events(grid: list[tuple[dict[str, str], list[float | None]]], n: int, t_ns: Any) -> list[dict[str, Any]]:
    """A process series that appears after the range's first point started then, one that ends before
    its last point stopped (Prometheus marks a series that leaves a scrape stale at once). A process
    that moves in or out of the agent's top processes per GPU looks the same: that is the price of
    bounded cardinality."""
    out = []
    for labels, vals in grid:
        present = [i for i, v in enumerate(vals) if v is not None]
        if not present:
            continue
        who = f"{labels.get('process', '?')} (pid {labels.get('pid')}, user {labels.get('user', '?')})"
        gpu = labels.get("gpu")
        if present[0] > 0:
            out.append({"time_ns": t_ns(present[0]), "kind": "process_start", "gpu_key": _key(labels),
                        "message": f"{who} started on GPU {gpu}", "count": 1})
        if present[-1] < n - 1:
            out.append({"time_ns": t_ns(present[-1] + 1), "kind": "process_stop", "gpu_key": _key(labels),
                        "message": f"{who} left GPU {gpu}", "count": 1})
    out.sort(key=lambda e: e["time_ns"])
    return out
