"""Verdicts over a past time range, read from the store: `gpuscope diagnose --since 1h`.

The range is cut into windows (at least `min_window` long, at most `max_windows` of them); each
window gets its verdicts as if it had been watched live, and equal neighbours merge into spans.
Series come from the finest tier that keeps the point count bounded (raw 10 Hz for short ranges,
the 1 s / 1 min rollups for long ones), so a day's diagnosis costs about what ten minutes' does.

A GPU that fell off the bus is `gpu_lost` from the moment it was (its first `gpu_healthy` = 0 sample)
until it answers again: a window in which it was lost says what it did before, then `gpu_lost`.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..catalog import CLOCK_EVENT_REASONS
from ..errors import Unavailable
from . import SERIES, GpuWindow, ProcessView, Verdict, diagnose
from .driverapi import over as driver_calls
from .thresholds import DEFAULT, Thresholds

_REASON_BIT = {name: bit for bit, name in CLOCK_EVENT_REASONS.items()}
#: Counters read as their last value per bucket; everything else as the bucket mean.
_LAST = ("gpu_ecc_uncorrected_errors_total", "gpu_row_remap_pending", "gpu_row_remap_failure")


class NoData(Unavailable, LookupError):
    """The range holds no GPU samples; the message is one sentence."""


@dataclass
class Span:
    gpu: str
    kind: str
    start_ns: int
    end_ns: int
    severity: str
    summary: str  # of the span's first window
    windows: int = 1
    primary: bool = True
    recommendations: list[str] = field(default_factory=list)


@dataclass
class RangeDiagnosis:
    start_ns: int
    end_ns: int
    step_s: float
    window_s: float
    spans: list[Span]
    overall: list[Verdict]  # the whole range as one window
    simulated: str | None = None

    def share(self) -> dict[str, dict[str, float]]:
        """Per GPU, the share of the diagnosed time each primary verdict held."""
        out: dict[str, dict[str, float]] = {}
        for s in self.spans:
            if s.primary:
                d = out.setdefault(s.gpu, {})
                d[s.kind] = d.get(s.kind, 0.0) + (s.end_ns - s.start_ns)
        for d in out.values():
            total = sum(d.values()) or 1.0
            for k in d:
                d[k] /= total
        return out


def _step(span_ns: int, max_points: int = 3000, finest_s: float = 0.1) -> float:
    """At most `max_points` per series; a step within 4x of a rollup tier's resolution is raised to it,
    so a day is read from the 1-minute rollups (1,440 points) rather than decoded from the 1-second
    ones (86,400), which made a day's diagnosis take 1.4 s instead of a fraction of that."""
    step = max(finest_s, span_ns / 1e9 / max_points)
    for tier_s in (3600.0, 60.0):
        if step * 4 > tier_s:
            return max(step, tier_s)
    return step


def windows_from_store(store: Any, start_ns: int, end_ns: int, step_s: float | None = None) -> list[GpuWindow]:
    """Per GPU, the diagnosis series over [start_ns, end_ns) at `step_s` (chosen when None)."""
    step = step_s or _step(end_ns - start_ns)
    step_ns = max(1, round(step * 1e9))
    n = max(1, math.ceil((end_ns - start_ns) / step_ns))
    grid: dict[str, dict[str, np.ndarray]] = {}

    def put(gpu: str, key: str, ts: np.ndarray, vals: np.ndarray) -> None:
        cols = grid.setdefault(gpu, {})
        col = cols.setdefault(key, np.full(n, np.nan))
        idx = ((ts - start_ns) // step_ns).astype(np.int64)
        ok = (idx >= 0) & (idx < n)
        col[idx[ok]] = vals[ok]

    for key in SERIES:
        if key == "gpu_clock_event_reasons":
            continue
        for r in store.query(key, start_ns, end_ns, step, agg="last" if key in _LAST else "mean"):
            put(r.labels.get("gpu", ""), key, np.asarray(r.timestamps_ns), np.asarray(r.values, dtype=float))
    # Throttle reasons from the throttled-seconds counters: exact at any step, unlike a mean of bitmasks.
    masks: dict[str, np.ndarray] = {}
    for r in store.query("gpu_throttle_seconds_total", start_ns, end_ns, step, agg="last"):
        bit = _REASON_BIT.get(r.labels.get("reason", ""))
        gpu = r.labels.get("gpu", "")
        if bit is None or len(r) < 2:
            continue
        ts, vals = np.asarray(r.timestamps_ns), np.asarray(r.values, dtype=float)
        dt = np.diff(ts) / 1e9
        on = np.diff(vals) >= 0.5 * dt
        m = masks.setdefault(gpu, np.zeros(n, dtype=np.int64))
        idx = ((ts[1:] - start_ns) // step_ns).astype(np.int64)
        ok = (idx >= 0) & (idx < n)
        m[idx[ok & on]] |= bit
    for gpu, m in masks.items():
        if gpu in grid:
            grid[gpu]["gpu_clock_event_reasons"] = m.astype(float)
    # Lost or not: the worst of each step (a GPU lost inside a step is lost in it).
    for r in store.query("gpu_healthy", start_ns, end_ns, step, agg="min"):
        put(r.labels.get("gpu", ""), "gpu_healthy", np.asarray(r.timestamps_ns), np.asarray(r.values, dtype=float))

    node = store.node()
    ident = {str(g.label if hasattr(g, "label") else g.index): g for g in node.get("gpus", [])}
    procs = _processes(store, start_ns, end_ns, step)
    events: dict[str, list[Any]] = {}
    for e in store.events(start_ns, end_ns):
        events.setdefault(str(e.gpu), []).append(e)
    out = []
    for gpu in sorted(grid, key=lambda g: (len(g), g)):
        cols = grid[gpu]
        have = np.zeros(n, dtype=bool)
        for k, c in cols.items():
            if k != "gpu_clock_event_reasons":  # derived from counters: zero where nothing was sampled
                have |= ~np.isnan(c)
        rows = np.nonzero(have)[0]
        if not len(rows):
            continue
        times = [(start_ns + int(i) * step_ns) / 1e9 for i in rows]
        series = {k: [None if math.isnan(v) else float(v) for v in cols[k][rows]] if k in cols else [None] * len(rows)
                  for k in (*SERIES, _HEALTHY)}
        health = [h for h in series[_HEALTHY] if h is not None]
        g = ident.get(gpu)
        out.append(_StoreWindow(gpu, times, series,
                             memory_total_bytes=float(g.memory_total_bytes) if g is not None else None,
                             sm_clock_max_hertz=g.sm_clock_max_hertz if g is not None else None,
                             healthy=not health or health[-1] != 0.0,  # as live: the state at the end
                             processes=[v for ps in procs.get(gpu, []) if (v := _view(ps, -math.inf, math.inf))],
                             events=events.get(gpu, []), name=g.name if g is not None else "",
                             process_series=procs.get(gpu, [])))
    return out


#: ProcessView attribute -> the per-process series it is read from; GPU memory is the most in the window.
_PROCESS_SERIES = (("gpu_memory_bytes", "gpu_process_memory_used_bytes"), ("cpu_cores", "process_cpu_cores"),
                   ("thread_cpu_max_ratio", "process_thread_cpu_max_ratio"), ("threads_busy", "process_threads_busy"),
                   ("sm_ratio", "gpu_process_sm_active_ratio"), ("utilization_ratio", "gpu_process_utilization_ratio"))
#: The eBPF probes' counters (ProcessRecord attribute -> series), read as each step's last value: their rates over a
#: slice are ProcessView.driver (driverapi.over), from its first and last reads.
_DRIVER_SERIES = (("cuda_launches", "process_cuda_launches_total"),
                  ("cuda_graph_launches", "process_cuda_graph_launches_total"),
                  ("cuda_syncs", "process_cuda_syncs_total"), ("cuda_sync_seconds", "process_cuda_sync_seconds_total"),
                  ("cuda_h2d_bytes", "process_cuda_h2d_bytes_total"), ("cuda_d2h_bytes", "process_cuda_d2h_bytes_total"),
                  ("cuda_d2d_bytes", "process_cuda_d2d_bytes_total"),
                  ("cuda_other_copy_bytes", "process_cuda_other_copy_bytes_total"))
_DRIVER_ATTRS = frozenset(attr for attr, _ in _DRIVER_SERIES)


@dataclass
class _ProcessSeries:
    """One process of a GPU over the range: its series, as (seconds, values) per ProcessView attribute."""

    pid: int
    name: str
    cols: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


@dataclass
class _StoreWindow(GpuWindow):
    """A GPU's window read from the store, with its processes' series: a slice of it holds the processes seen
    in the slice, with their figures over the slice."""

    process_series: list[_ProcessSeries] = field(default_factory=list)


def _view(ps: _ProcessSeries, a: float, b: float) -> ProcessView | None:
    """The process over [a, b) seconds: medians (GPU memory: the most), None where it has no sample there."""
    v = ProcessView(ps.pid, ps.name)
    seen = False
    for attr, (ts, vals) in ps.cols.items():
        if attr in _DRIVER_ATTRS:
            continue
        keep = vals[(ts >= a) & (ts < b)]
        if not len(keep):
            continue
        seen = True
        value = float(keep.max() if attr == "gpu_memory_bytes" else np.median(keep))
        setattr(v, attr, int(value + 0.5) if attr == "threads_busy" else value)
        if attr == "gpu_memory_bytes":
            inside = (ts >= a) & (ts < b)
            v.memory = [(float(t), float(x)) for t, x in zip(ts[inside], vals[inside], strict=True)]
    v.driver = _driver(ps, a, b)
    return v if seen else None


def _driver(ps: _ProcessSeries, a: float, b: float) -> Any:
    """The process's driver call rates over [a, b) from its probe counters' first and last steps there, or None."""
    cols = ps.cols.get("cuda_launches")
    if cols is None:
        return None
    inside = np.flatnonzero((cols[0] >= a) & (cols[0] < b))
    if len(inside) < 2:
        return None
    ends = []
    for t in (cols[0][inside[0]], cols[0][inside[-1]]):
        rec = SimpleNamespace(**dict.fromkeys(_DRIVER_ATTRS))
        for attr in _DRIVER_ATTRS:
            ts, vals = ps.cols.get(attr, (None, None))
            if ts is not None and (hit := np.flatnonzero(ts == t)).size:
                setattr(rec, attr, float(vals[hit[0]]))
        ends.append((float(t), rec))
    return driver_calls(ends)


_HEALTHY = "gpu_healthy"
#: One window's verdicts, each with the [from, to) ns it covers.
Covered = list[tuple[Verdict, int, int]]


def _lost(w: GpuWindow, step: float) -> list[tuple[float, float]]:
    """[from, to) seconds during which the GPU was lost: from its first gpu_healthy = 0 step to the
    next step where it answers (a reset, a new agent), or one step past its last sample."""
    out: list[tuple[float, float]] = []
    since = last = None
    for t, h in zip(w.times, w.series.get(_HEALTHY) or [], strict=False):
        if h is None:
            continue
        last = t
        if h == 0.0 and since is None:
            since = t
        elif h != 0.0 and since is not None:
            out.append((since, t))
            since = None
    if since is not None and last is not None:
        out.append((since, last + step))
    return out


def _outside(w: GpuWindow, lost: list[tuple[float, float]]) -> GpuWindow:
    """The window without its samples and events in the `lost` intervals: what the GPU did while it answered."""
    def out(t: float) -> bool:
        return not any(x <= t < y for x, y in lost)

    keep = [out(t) for t in w.times]
    return replace(w, times=[t for t, k in zip(w.times, keep, strict=True) if k],
                   series={n: [v for v, k in zip(vs, keep, strict=True) if k] for n, vs in w.series.items()},
                   events=[e for e in w.events if out(e.time_ns / 1e9)], healthy=True)


def _diagnose_window(windows: list[GpuWindow], a_ns: int, b_ns: int, th: Thresholds, step: float) -> Covered:
    """One window's verdicts, each with the [from, to) ns it covers. A GPU lost inside the window is
    diagnosed on what it did before it was lost, and is gpu_lost from that moment."""
    a, b = a_ns / 1e9, b_ns / 1e9
    cut: list[GpuWindow] = []
    lost_parts: list[tuple[GpuWindow, int, int]] = []
    covers: dict[str, tuple[int, int]] = {}
    for w in windows:
        c = _slice(w, a, b)
        lost = [(x, y) for x, y in _lost(w, step) if x < b and y > a]
        if lost:
            x0, y1 = max(a_ns, int(lost[0][0] * 1e9)), min(b_ns, int(lost[-1][1] * 1e9))
            lost_parts.append((replace(_slice(w, x0 / 1e9, y1 / 1e9), healthy=False), x0, y1))
            c = _outside(c, lost)
            covers[w.gpu] = (a_ns, x0) if x0 > a_ns else (y1, b_ns)
        else:
            c.healthy = True  # lost only later, if at all
        if c.times:
            cut.append(c)
    out = [(v, *covers.get(v.gpu, (a_ns, b_ns))) for v in (diagnose(cut, th) if cut else [])]
    for lw, x0, y1 in lost_parts:
        out.extend((v, x0, y1) for v in diagnose([lw], th))
    return out


def _processes(store: Any, start_ns: int, end_ns: int, step: float) -> dict[str, list[_ProcessSeries]]:
    """Per GPU, the processes seen in the range with their CPU, busy threads, SM share and GPU memory series."""
    found: dict[tuple[str, str], _ProcessSeries] = {}
    queries = [(attr, metric, "mean") for attr, metric in _PROCESS_SERIES] + [
        (attr, metric, "last") for attr, metric in _DRIVER_SERIES]
    for attr, metric, agg in queries:
        for r in store.query(metric, start_ns, end_ns, step, agg=agg):
            gpu, pid = r.labels.get("gpu", ""), r.labels.get("pid", "")
            if not pid.isdigit():
                continue
            ts, vals = np.asarray(r.timestamps_ns, dtype=float) / 1e9, np.asarray(r.values, dtype=float)
            ok = ~np.isnan(vals)
            if not ok.any():
                continue
            ps = found.setdefault((gpu, pid), _ProcessSeries(int(pid), r.labels.get("process", "")))
            ps.cols[attr] = (ts[ok], vals[ok])
    out: dict[str, list[_ProcessSeries]] = {}
    for (gpu, _), ps in sorted(found.items(), key=lambda kv: (kv[0][0], int(kv[0][1]))):
        out.setdefault(gpu, []).append(ps)
    return out


def _slice(w: GpuWindow, a: float, b: float) -> GpuWindow:
    """The window's part in [a, b) seconds, with the processes seen there (their figures over it)."""
    i0, i1 = bisect_left(w.times, a), bisect_left(w.times, b)  # times are sorted: [a, b)
    procs = w.processes
    if isinstance(w, _StoreWindow):
        procs = [v for v in (_view(ps, a, b) for ps in w.process_series) if v is not None]
    return GpuWindow(w.gpu, w.times[i0:i1], {k: v[i0:i1] for k, v in w.series.items()}, w.memory_total_bytes,
                     w.sm_clock_max_hertz, w.healthy, procs,
                     [e for e in w.events if a <= e.time_ns / 1e9 < b], w.name)


def diagnose_range(store: Any, start_ns: int, end_ns: int, *, min_window_s: float = 10.0, max_windows: int = 60,
                   thresholds: Thresholds = DEFAULT) -> RangeDiagnosis:
    """Verdict spans over [start_ns, end_ns) from the store, and one verdict set for the whole range."""
    if end_ns <= start_ns:
        raise NoData("The range is empty: its end is not after its start.")
    span_s = (end_ns - start_ns) / 1e9
    window_s = max(min_window_s, span_s / max_windows)
    step = _step(end_ns - start_ns)
    windows = windows_from_store(store, start_ns, end_ns, step)
    if not windows:
        raise NoData("The store holds no GPU samples in that range; widen it or check that the agent was running.")
    th = _for_step(thresholds, step)
    spans: list[Span] = []
    t = start_ns / 1e9
    while t < end_ns / 1e9 - 1e-9:
        b = min(end_ns / 1e9, t + window_s)
        _merge(spans, _diagnose_window(windows, int(t * 1e9), int(b * 1e9), th, step))
        t = b
    overall = diagnose(windows, th)
    return RangeDiagnosis(start_ns, end_ns, step, window_s, spans, overall, store.node().get("simulated"))


def _for_step(th: Thresholds, step: float) -> Thresholds:
    if step * th.min_samples > th.min_window_s:  # coarse rollups: fewer, wider samples are still a steady state
        return Thresholds(**{**th.__dict__, "min_samples": max(3, int(th.min_window_s / step))})
    return th


def _merge(spans: list[Span], verdicts: list[tuple[Verdict, int, int]]) -> None:
    """Add one window's verdicts, each with the [a, b) ns it covers, to the spans: a verdict equal to
    its GPU's last span extends it."""
    for v, a_ns, b_ns in verdicts:
        if not v.primary and v.severity == "info":
            continue
        last = next((s for s in reversed(spans) if s.gpu == v.gpu and s.primary == v.primary), None)
        if last is not None and last.kind == v.kind and last.end_ns >= a_ns - 1:
            last.end_ns, last.windows = b_ns, last.windows + 1
        else:
            spans.append(Span(v.gpu, v.kind, a_ns, b_ns, v.severity, v.summary, 1, v.primary,
                              list(v.recommendations)))


# Window lengths of a timeline: round numbers, so the same windows come back when the range moves on.
_NICE_WINDOWS_S = (10, 15, 30, 60, 120, 300, 600, 900, 1200, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


class WindowCache:
    """Verdicts of timeline windows that are over. Their samples no longer change, so a dashboard that
    asks again (a reload, a second viewer, a range that moved on by a minute) reads and diagnoses only
    the windows it has not seen; a day's timeline costs what its newest window does.

    Each window length keeps its `per_length` most recently used windows: a timeline shows about 60 of
    one length, so more serves nobody and only grows the agent (a dashboard left open on a 15-minute range
    adds 240 windows of eight GPUs' verdicts an hour, which a cache bounded by count alone kept for days).
    """

    def __init__(self, per_length: int = 256) -> None:
        self.per_length = per_length
        self._by_length: dict[tuple[int, float], OrderedDict[int, Covered]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(d) for d in self._by_length.values())

    def get(self, key: tuple[int, int, float]) -> Covered | None:
        a, b, step = key
        with self._lock:
            d = self._by_length.get((b - a, step))
            v = d.get(a) if d is not None else None
            if v is not None:
                d.move_to_end(a)  # type: ignore[union-attr]
            return v

    def put(self, key: tuple[int, int, float], verdicts: Covered) -> None:
        """Keep a window's verdicts as the timeline draws them: without the evidence and the processes' own
        verdicts under a shared GPU's (a node of 100 processes held about 15 of those per GPU and window: a
        soak's cache grew 54 MB an hour until it was full)."""
        a, b, step = key
        slim = [(replace(v, evidence={}, processes=[]), x, y) for v, x, y in verdicts]
        with self._lock:
            d = self._by_length.setdefault((b - a, step), OrderedDict())
            d[a] = slim
            d.move_to_end(a)
            while len(d) > self.per_length:
                d.popitem(last=False)


def timeline(store: Any, start_ns: int, end_ns: int, *, cache: WindowCache | None = None,
             settled_ns: int | None = None, max_windows: int = 60, min_window_s: float = 10.0,
             thresholds: Thresholds = DEFAULT) -> list[Span]:
    """Verdict spans over [start_ns, end_ns) in windows aligned to the clock (a round length, at most
    about `max_windows` of them), for a timeline to draw. Windows that ended before `settled_ns`
    (default: 10 s ago, past the store's flushes) are taken from `cache` when it has them and kept
    there; only the others are read and diagnosed. Spans are cut to the range."""
    if end_ns <= start_ns:
        raise NoData("The range is empty: its end is not after its start.")
    want = max(min_window_s, (end_ns - start_ns) / 1e9 / max_windows)
    window_s = next((w for w in _NICE_WINDOWS_S if w >= want), math.ceil(want / 86400) * 86400)
    w_ns = int(window_s * 1e9)
    step = _step(w_ns * max_windows)
    th = _for_step(thresholds, step)
    settled = settled_ns if settled_ns is not None else time.time_ns() - 10_000_000_000
    bounds = [(a, min(a + w_ns, end_ns)) for a in range(start_ns // w_ns * w_ns, end_ns, w_ns)]
    found: dict[int, Covered] = {}
    if cache is not None:
        for a, b in bounds:
            if b == a + w_ns and b <= settled and (v := cache.get((a, b, step))) is not None:
                found[a] = v
    todo = [(a, b) for a, b in bounds if a not in found]
    i = 0
    while i < len(todo):  # contiguous runs of windows to read: one store read each
        j = i
        while j + 1 < len(todo) and todo[j + 1][0] == todo[j][1]:
            j += 1
        run_a, run_b = todo[i][0], todo[j][1]
        windows = windows_from_store(store, run_a, run_b, step)
        for a, b in todo[i:j + 1]:
            found[a] = _diagnose_window(windows, a, b, th, step)
            if cache is not None and b == a + w_ns and b <= settled:
                cache.put((a, b, step), found[a])
        i = j + 1
    spans: list[Span] = []
    for a, _b in bounds:
        _merge(spans, found[a])
    for sp in spans:
        sp.start_ns, sp.end_ns = max(sp.start_ns, start_ns), min(sp.end_ns, end_ns)
    return spans


def range_as_dict(r: RangeDiagnosis) -> dict[str, Any]:
    """JSON-ready: the range, its spans, the share of each verdict per GPU, the whole-range verdicts."""
    return {"start": r.start_ns / 1e9, "end": r.end_ns / 1e9, "step_s": r.step_s, "window_s": r.window_s,
            "simulated": r.simulated, "share": r.share(),
            "spans": [{**asdict(s), "start": s.start_ns / 1e9, "end": s.end_ns / 1e9} for s in r.spans],
            "verdicts": [asdict(v) for v in r.overall]}
