"""The dashboard's Backend inside the agent: the sampler's latest snapshot for now, the store for the past.

    add_ui_routes(app, AgentBackend(agent))

Nothing here calls NVML. Store reads and diagnoses run on the default executor so a long range
never stalls the event loop (and with it the scrapes).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..sampler import Sampler
    from ..store import Store

from .._version import __version__
from ..viewmodel import GPU_METRICS, from_snapshot, gpu_key
from .backend import BackendError, RangeQuery

VERDICT_WINDOW_S = 10.0   # the verdicts on the overview hold over the last 10 s
VERDICT_EVERY_S = 2.0     # and are recomputed at most this often, however many pages watch
META_EVERY_S = 10.0
MAX_EVENTS = 5000         # newest first kept in one timeline answer
# What the sampler really stores as events (sources/*): the timeline shows these.
TIMELINE_EVENTS = ("xid", "ecc", "clock_events", "gpu_lost", "process_start", "process_stop", "guard")


class Alerts(Protocol):
    """The agent's alert service, as the dashboard reads it."""

    def alerts(self) -> dict[str, Any]:
        """{'firing': [...], 'pending': [...], 'resolved': [...]}, each alert a dict."""
        ...


class AgentView(Protocol):
    """What the dashboard reads of a running agent (gpuscope.agent.Agent is one): its sampler for now, its
    store for the past, its alert service when alerts are on (None when they are off)."""

    sampler: Sampler
    store: Store
    alerts: Alerts | None


def with_for(alerts: dict[str, Any]) -> dict[str, Any]:
    """Each alert with its rule's `for` (for_s, seconds): a pending alert is then told as 'pending for
    2 min of the 30 min it must hold', not with the summary written for when it fires ('... for 30 min')."""
    for_s = {r.get("name"): r.get("for_s") for r in alerts.get("rules", []) if isinstance(r, dict)}
    out = dict(alerts)
    for state in ("firing", "pending", "resolved"):
        if state in alerts:
            out[state] = [{**a, "for_s": for_s.get(a.get("rule"))} for a in alerts[state]]
    return out


class AgentBackend:
    """Backend over a running Agent (its sampler, store and alert service)."""

    source = "agent"

    def __init__(self, agent: AgentView) -> None:
        self.agent = agent
        self._lock = threading.Lock()
        self._verdicts: tuple[float, list[Any]] = (0.0, [])
        self._overview: tuple[int, dict[str, Any]] | None = None
        self._meta: tuple[float, dict[str, Any]] | None = None
        from ..diagnose.history import WindowCache

        self._windows = WindowCache()  # verdicts of past timeline windows, shared by every page

    @property
    def host(self) -> str:
        return self.agent.sampler.hostname

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # -- now -------------------------------------------------------------------------------------
    def _current_verdicts(self) -> list[Any]:
        from ..diagnose import diagnose, windows_from_snapshots

        now = time.monotonic()
        if now - self._verdicts[0] < VERDICT_EVERY_S:
            return self._verdicts[1]
        cutoff = time.time_ns() - int(VERDICT_WINDOW_S * 1e9)
        snaps = [s for s in list(self.agent.sampler.history) if s.time_ns >= cutoff]
        verdicts = diagnose(windows_from_snapshots(snaps)) if snaps else []
        self._verdicts = (now, verdicts)
        return verdicts

    def _alerts_now(self) -> dict[str, Any]:
        svc = self.agent.alerts
        if svc is None:
            return {"firing": [], "pending": [], "resolved": []}
        return with_for(svc.alerts())

    def _build_overview(self) -> dict[str, Any]:
        sampler = self.agent.sampler
        snap = sampler.latest()
        if snap is None:
            return {"source": self.source, "simulated": sampler.simulated, "time_ns": time.time_ns(), "gpus": [],
                    "processes": [], "alerts": {"firing": [], "pending": []},
                    "errors": ["The sampler has not produced a snapshot yet."]}
        with self._lock:  # several pages share one overview per snapshot
            if self._overview is not None and self._overview[0] == snap.time_ns:
                return self._overview[1]
            ov = from_snapshot(snap, self._current_verdicts(), source=self.source, alerts=self._alerts_now(),
                               host=self.host)
            self._overview = (snap.time_ns, ov)
            return ov

    async def overview(self) -> dict[str, Any]:
        return await self._run(self._build_overview)

    async def alerts(self) -> dict[str, Any]:
        a = await self._run(self._alerts_now)
        return {"firing": a.get("firing", []), "pending": a.get("pending", []), "resolved": a.get("resolved", []),
                "enabled": self.agent.alerts is not None}

    # -- the past --------------------------------------------------------------------------------
    def _build_meta(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._meta is not None and now - self._meta[0] < META_EVERY_S:
            return self._meta[1]
        sampler, store = self.agent.sampler, self.agent.store
        stored = set(store.metrics())
        meta = {
            "source": self.source, "simulated": sampler.simulated, "version": __version__, "host": self.host,
            "gpus": [{"key": gpu_key(self.host, d.label), "host": self.host, "gpu": d.label,
                      "name": d.identity.name} for d in sampler.devices],
            # GPU metrics always (a fresh store has none yet), plus whatever else the store holds.
            "metrics": sorted(stored | set(GPU_METRICS)),
            "resolution_s": float(sampler.config.interval),
            "oldest_ns": store.stats().get("oldest_ns"),
        }
        self._meta = (now, meta)
        return meta

    async def meta(self) -> dict[str, Any]:
        return await self._run(self._build_meta)

    def _gpu_labels(self, keys: tuple[str, ...]) -> set[str]:
        prefix = self.host + "/"
        out = set()
        for k in keys:
            if not k.startswith(prefix):
                raise BackendError(404, f"There is no GPU {k!r} on {self.host}.")
            out.add(k[len(prefix):])
        return out

    def _query(self, q: RangeQuery) -> dict[str, Any]:
        wanted = self._gpu_labels(q.gpus)
        results = self.agent.store.query(q.metric, q.start_ns, q.end_ns, q.step_s, q.agg, labels=dict(q.labels) or None)
        series: list[dict[str, Any]] = []
        for r in results:
            gpu = r.labels.get("gpu")
            if wanted and gpu not in wanted:
                continue
            series.append({"gpu_key": gpu_key(self.host, gpu) if gpu is not None else None, "labels": r.labels,
                           "timestamps_ns": [int(t) for t in r.timestamps_ns],
                           "values": [None if v != v else float(v) for v in r.values]})
        series.sort(key=lambda s: (s["gpu_key"] or "", sorted(s["labels"].items())))
        return {"metric": q.metric, "start_ns": q.start_ns, "end_ns": q.end_ns, "step_s": q.step_s, "agg": q.agg,
                "simulated": self.agent.sampler.simulated, "series": series}

    async def range(self, q: RangeQuery) -> dict[str, Any]:
        from ..store import StoreError

        try:
            return await self._run(self._query, q)
        except StoreError as e:
            raise BackendError(400, str(e)) from None

    def _timeline(self, start_ns: int, end_ns: int, gpus: tuple[str, ...]) -> dict[str, Any]:
        from ..diagnose.history import NoData, timeline

        wanted = self._gpu_labels(gpus)
        store = self.agent.store
        try:
            spans = [s for s in timeline(store, start_ns, end_ns, cache=self._windows) if s.primary]
        except NoData:
            spans = []
        events = [e for e in store.events(start_ns, end_ns) if e.kind in TIMELINE_EVENTS]
        if wanted:
            spans = [s for s in spans if s.gpu in wanted]
            events = [e for e in events if e.gpu is None or str(e.gpu) in wanted]
        return {
            "spans": [{"gpu_key": gpu_key(self.host, s.gpu), "kind": s.kind, "severity": s.severity,
                       "start_ns": s.start_ns, "end_ns": s.end_ns, "summary": s.summary} for s in spans],
            "events": [{"time_ns": e.time_ns, "kind": e.kind,
                        "gpu_key": gpu_key(self.host, str(e.gpu)) if e.gpu is not None else None,
                        "message": e.message, "count": e.count} for e in events[-MAX_EVENTS:]],
        }

    async def timeline(self, start_ns: int, end_ns: int, gpus: tuple[str, ...] = ()) -> dict[str, Any]:
        return await self._run(self._timeline, start_ns, end_ns, gpus)

    async def close(self) -> None:
        """The agent owns the sampler and the store; nothing to release here."""
