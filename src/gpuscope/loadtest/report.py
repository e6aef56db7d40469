"""The `gpuscope loadtest` HTML report: one self-contained file (uPlot, CSS and data inline, nothing fetched).

Sections: the validity verdict first, then the run, the per-stage table (metric names as --metrics-as
says), the capacity search, and plots on one time axis with the stages as bands: latency over time
(from the intended and from the actual send), percentile curves (latency against 1/(1-p) on a log
axis, as HdrHistogram plots them), throughput against the offered rate, errors by class, TTFT and TPOT
for streams, and the GPU panels (SM activity, memory, power, throttling).

A run may hold a million requests: plots are bucketed on the server side of this module (p50, p99 and
the max per bucket, so the tail survives downsampling), a few hundred points per series, and the file
stays far below 10 MB. The records are read once, as a stream, into a few numbers per request
(`Columns`: about 50 bytes each, not the records themselves): the exact per-bucket percentiles and
percentile curves need every latency. Without uPlot (a checkout without `make web`) the tables are still there and
every plot says why it is empty.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any

import numpy as np

from .._version import __version__
from ..report.htmlpage import write_atomic
from .progress import offered_text
from .records import ERROR_CLASSES, GpuReading, RequestRecord

MAX_BUCKETS = 600       # points per time series
MAX_GPU_BUCKETS = 1500
CURVE_POINTS = 240      # points per percentile curve
MAX_CURVE_STAGES = 12   # per-stage percentile curves beyond this would be unreadable
PALETTE = ["#1f6fd1", "#d1343a", "#3a9d23", "#e08a00", "#7b4fc9", "#1f8a9e", "#c2399b", "#8a5a2b",
           "#5c6bc0", "#222222"]


def _e(v: Any) -> str:
    return escape("" if v is None else str(v), quote=True)


def _vendor() -> tuple[str, str] | None:
    """uPlot's minified JS and CSS (the files the wheel carries for the dashboard), or None."""
    from ..web.api import VENDOR_DIR

    try:
        return ((VENDOR_DIR / "uPlot.iife.min.js").read_text(encoding="utf-8"),
                (VENDOR_DIR / "uPlot.min.css").read_text(encoding="utf-8"))
    except OSError:
        return None


# -- downsampling ------------------------------------------------------------------------------------
def _edges(t0: float, t1: float, n: int) -> np.ndarray:
    return np.linspace(t0, t1 if t1 > t0 else t0 + 1.0, n + 1)


def _bucket(t: np.ndarray, v: np.ndarray, edges: np.ndarray, qs: Sequence[float] = (0.5, 0.99)
            ) -> dict[str, list[float | None]]:
    """Per bucket of `edges`: the quantiles `qs`, max, mean and count of v (None where a bucket is empty)."""
    n = len(edges) - 1
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, n - 1)
    order = np.lexsort((v, idx))
    vs = v[order]
    counts = np.bincount(idx, minlength=n)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    has = counts > 0
    out: dict[str, list[float | None]] = {"count": counts.astype(float).tolist()}

    def pick(pos: np.ndarray) -> list[float | None]:
        vals = vs[np.clip(pos, 0, max(0, len(vs) - 1))] if len(vs) else np.zeros(n)
        return [float(x) if h else None for x, h in zip(vals, has, strict=True)]

    for q in qs:
        # nearest rank: the smallest value with at least q of the bucket at or below it
        out[f"p{q * 100:g}"] = pick(starts + np.maximum(np.ceil(q * counts).astype(int) - 1, 0))
    out["max"] = pick(starts + counts - 1)
    sums = np.bincount(idx, weights=v, minlength=n)
    out["mean"] = [float(s / c) if c else None for s, c in zip(sums, counts, strict=True)]
    return out


def _centers(edges: np.ndarray) -> list[float]:
    return ((edges[:-1] + edges[1:]) / 2).round(4).tolist()


def _r(xs: Sequence[float | None], k: int = 3) -> list[float | None]:
    return [None if x is None or not math.isfinite(x) else round(x, k) for x in xs]


# -- the records, as columns -------------------------------------------------------------------------
ERROR_LEGEND_RECORDS = 200_000   # the error-class legend looks at the first records only
MAX_DETAILS = 64                 # distinct (class, sentence) pairs counted for the error table


class Columns:
    """What the plots use of each record (warm-up left out), gathered in one pass over a stream of records."""

    def __init__(self, records: Iterable[RequestRecord], metrics_as: str) -> None:
        from .stats import request_metrics

        self.count = 0
        self.first_t: float | None = None
        self.last_t = -math.inf
        # completed without error: intended, sent and end times and stage
        self.t_intended, self.t_sent, self.t_end, self.stage = array("d"), array("d"), array("d"), array("q")
        self.err_t, self.err_class = array("d"), array("H")     # failed: intended time, index in err_names
        self.err_names: list[str] = []
        self.legend: set[str] = set()                           # error classes among the first records
        self.details: dict[tuple[str, str], int] = {}           # (class, sentence): count, MAX_DETAILS kinds
        self.stream_t, self.ttft_ms, self.tpot_ms = array("d"), array("d"), array("d")
        nan = math.nan
        for r in records:
            if r.warmup:
                continue
            if self.first_t is None:
                self.first_t = r.t_intended
            self.last_t = max(self.last_t, r.t_intended)
            if r.error:
                if r.error not in self.err_names:
                    self.err_names.append(r.error)
                self.err_t.append(r.t_intended)
                self.err_class.append(self.err_names.index(r.error))
                if self.count < ERROR_LEGEND_RECORDS:
                    self.legend.add(r.error)
                key = (r.error, r.error_detail or "")
                if key in self.details or len(self.details) < MAX_DETAILS:
                    self.details[key] = self.details.get(key, 0) + 1
            if r.error is None and r.t_end is not None:
                self.t_intended.append(r.t_intended)
                self.t_sent.append(r.t_sent)
                self.t_end.append(r.t_end)
                self.stage.append(r.stage)
                if r.chunk_times:
                    m = request_metrics(r, metrics_as)
                    self.stream_t.append(r.t_intended)
                    self.ttft_ms.append(nan if (v := m["ttft"]) is None else v * 1000)
                    self.tpot_ms.append(nan if (v := m["tpot"]) is None else v * 1000)
            self.count += 1

    @staticmethod
    def np(a: array) -> np.ndarray:
        return np.frombuffer(a, dtype=np.int64 if a.typecode == "q" else float) if len(a) else np.empty(0)


# -- plots -------------------------------------------------------------------------------------------
def _plot(pid: str, title: str, kind: str, x: list[float], series: list[tuple[str, list[Any]]], ylabel: str,
          xlabel: str = "seconds since start", points: bool = False, note: str = "") -> dict[str, Any]:
    return {"id": pid, "title": title, "kind": kind, "xlabel": xlabel, "ylabel": ylabel, "points": points,
            "note": note, "series": [s for s, _ in series], "data": [x] + [_r(d) for _, d in series]}


def _latency_plots(cols: Columns, t0: float, t1: float, names: Mapping[str, str],
                   stages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    plots: list[dict[str, Any]] = []
    notes: list[str] = []
    n_done = len(cols.t_intended)
    nb = int(min(MAX_BUCKETS, max(10, cols.count // 20)))
    edges = _edges(t0, t1, nb)
    x = _centers(edges)
    if n_done:
        ti, ends = cols.np(cols.t_intended), cols.np(cols.t_end)
        lat = (ends - ti) * 1000
        svc = (ends - cols.np(cols.t_sent)) * 1000
        a, b = _bucket(ti, lat, edges), _bucket(ti, svc, edges)
        plots.append(_plot("latency", "Latency over time (by intended send time)", "time", x,
                           [("p50 from intended", a["p50"]), ("p99 from intended", a["p99"]),
                            ("max from intended", a["max"]), ("p99 from sent", b["p99"])], "ms"))
        # Percentile curves: latency against log10(1/(1-p)), the HdrHistogram view of the tail.
        top = min(6.0, math.log10(max(10, n_done)))
        xs = np.linspace(0.0, top, CURVE_POINTS)
        ps = 1 - 10 ** (-xs)
        groups = [("all, from intended", lat), ("all, from sent", svc)]
        if len(stages) <= MAX_CURVE_STAGES:
            st_of = cols.np(cols.stage)
            for st in stages:
                sel = lat[st_of == st["index"]]
                if len(sel) >= 2:
                    groups.append((f"stage {st['index']} {st.get('name', '')}".strip(), sel))
        curves = []
        for name, vals in groups:
            c = np.quantile(vals, ps)
            c[-1] = vals.max()  # each curve ends at its maximum, as HdrHistogram's do: the worst request shows
            curves.append((name, c))
        plots.append(_plot("percentiles", "Latency by percentile (from intended send unless said)", "pct",
                           xs.round(4).tolist(), [(n, c.tolist()) for n, c in curves], "ms", xlabel="percentile"))
    else:
        notes.append("No request completed: there is no latency to plot.")
    # Errors by class over time, per second.
    if len(cols.err_t):
        width = float(edges[1] - edges[0])
        err_t, err_class = cols.np(cols.err_t), np.frombuffer(cols.err_class, dtype=np.uint16)
        series = []
        for cls in sorted(cols.err_names):
            t = err_t[err_class == cols.err_names.index(cls)]
            counts = np.bincount(np.clip(np.searchsorted(edges, t, side="right") - 1, 0, nb - 1), minlength=nb)
            series.append((cls, (counts / width).tolist()))
        plots.append(_plot("errors", "Errors by class", "time", x, series, "errors/s"))
    else:
        notes.append("No request failed: the errors plot is left out.")
    # Streaming: TTFT and TPOT per request, as the summary defines them.
    if len(cols.stream_t):
        ts = cols.np(cols.stream_t)
        for vals_a, label, pid in ((cols.ttft_ms, "TTFT", "ttft"), (cols.tpot_ms, names.get("tpot_ms", "TPOT"), "tpot")):
            vals = cols.np(vals_a)
            ok = ~np.isnan(vals)
            if ok.any():
                bk = _bucket(ts[ok], vals[ok], edges)
                plots.append(_plot(pid, f"{label} over time", "time", x,
                                   [(f"{label} p50", bk["p50"]), (f"{label} p99", bk["p99"])], "ms"))
    return plots, notes


def _throughput_plot(stages: list[dict[str, Any]]) -> dict[str, Any] | None:
    rows = []
    for st in stages:
        s = st.get("stats") or {}
        offered = st.get("target_rate")
        key = offered if offered is not None else st.get("concurrency")
        # A ramp has no one offered load to plot its throughput against (the table shows its start -> end).
        if key is None or st.get("ramp_to") not in (None, offered) \
                or st.get("concurrency_end") not in (None, st.get("concurrency")):
            continue
        rows.append((float(key), s.get("request_throughput"), s.get("goodput"), offered is not None))
    if not rows:
        return None
    rows.sort(key=lambda r: r[0])
    open_loop = all(r[3] for r in rows)
    x = [r[0] for r in rows]
    series: list[tuple[str, list[Any]]] = [("achieved req/s", [r[1] for r in rows])]
    if any(r[2] is not None for r in rows):
        series.append(("goodput req/s", [r[2] for r in rows]))
    if open_loop:
        series.append(("offered (ideal)", x))
    return _plot("throughput", "Throughput against offered rate, per stage" if open_loop else
                 "Throughput against concurrency, per stage", "xy", x, series, "req/s",
                 xlabel="offered req/s" if open_loop else "concurrency", points=True)


def _capacity_plot(cap: Mapping[str, Any] | None) -> dict[str, Any] | None:
    trials = sorted((t for t in (cap or {}).get("trials") or [] if t.get("rate") is not None), key=lambda t: t["rate"])
    if not trials:
        return None
    x = [float(t["rate"]) for t in trials]
    series: list[tuple[str, list[Any]]] = [
        ("achieved req/s (passed)", [t.get("throughput") if t.get("passed") else None for t in trials]),
        ("achieved req/s (failed)", [None if t.get("passed") else t.get("throughput") for t in trials]),
        ("offered (ideal)", x)]
    return _plot("capacity", "Capacity search: achieved against offered rate per trial", "xy", x, series, "req/s",
                 xlabel="offered req/s", points=True)


def _gpu_plots(readings: Sequence[GpuReading], t0: float, t1: float) -> list[dict[str, Any]]:
    by_gpu: dict[str, list[GpuReading]] = {}
    for r in readings:
        by_gpu.setdefault(r.gpu, []).append(r)
    per = max(len(v) for v in by_gpu.values())
    nb = int(min(MAX_GPU_BUCKETS, max(10, per)))
    edges = _edges(t0, t1, nb)
    x = _centers(edges)
    plots = []
    spec = (("gpu_sm", "GPU SM activity", "%", lambda r: r.sm_active, 100.0, "mean"),
            ("gpu_util", "GPU NVML utilisation (any kernel running)", "%", lambda r: r.nvml_util, 100.0, "mean"),
            ("gpu_mem", "GPU memory used", "%", lambda r: r.mem_used_frac, 100.0, "max"),
            ("gpu_power", "GPU power", "W", lambda r: r.power_w, 1.0, "mean"),
            ("gpu_throttle", "GPU clocks held down (share of readings throttled)", "%",
             lambda r: 1.0 if r.throttle else 0.0, 100.0, "mean"))
    for pid, title, unit, get, scale, how in spec:
        series = []
        for g in sorted(by_gpu):
            pts = [(r.t, v) for r in by_gpu[g] if (v := get(r)) is not None]
            if pts:
                a = np.asarray(pts, float)
                series.append((f"GPU {g}", [None if v is None else v * scale
                                            for v in _bucket(a[:, 0], a[:, 1], edges, ())[how]]))
        if series:
            plots.append(_plot(pid, title, "time", x, series, unit))
    return plots


# -- tables ------------------------------------------------------------------------------------------
def _f(v: Any, fmt: str = "{:.1f}") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return fmt.format(v) if isinstance(v, int | float) else _e(v)


def _pct_of(d: Mapping[str, Any] | None, key: str) -> Any:
    return None if not isinstance(d, Mapping) else d.get(key)


def _stage_table(summary: Mapping[str, Any]) -> str:
    names = summary.get("names") or {}
    rows = [(f"{st.get('index')}", st.get("name", ""), st) for st in summary.get("stages") or []]
    k = summary.get("overall_stage")
    rows.append(("all" if k is None else f"= {k}", "overall" if k is None else "at capacity",
                 {"stats": summary.get("overall") or {}, "gpu": (summary.get("overall") or {}).get("gpu")}))
    streaming = any("ttft_ms" in (r[2].get("stats") or {}) for r in rows)
    slo = any("goodput" in (r[2].get("stats") or {}) for r in rows)
    gpu = any((r[2].get("gpu") or {}).get("readings") for r in rows)
    head = ["stage", "name", "offered", "requests", "completed", "errors", "late", "retried", "req/s",
            "latency p50 ms", "p99", "p99.9", "max", "from sent p99"]
    if streaming:
        tp, cg = names.get("tpot_ms", "TPOT"), names.get("chunk_gap_ms", "ITL")
        head += ["TTFT p50", "TTFT p99", f"{tp} p50", f"{tp} p99", f"{cg} p99", "output tok/s"]
    if slo:
        head += ["goodput req/s", "met SLOs"]
    if gpu:
        head += ["SM active mean", "SM p95", "memory max", "power W", "throttled", "energy J", "J/request", "J/token"]
    out = ["<div class=wide><table class=stages><thead><tr>", "".join(f"<th>{_e(h)}</th>" for h in head), "</tr></thead><tbody>"]
    for idx, name, st in rows:
        s = st.get("stats") or {}
        g = st.get("gpu") or {}
        offered = offered_text(st, " req/s", " conc.")
        lat, svc = s.get("latency_ms"), s.get("service_latency_ms")
        cells = [_e(idx), _e(name), _e(offered), _f(s.get("requests"), "{}"), _f(s.get("completed"), "{}"),
                 _f(sum((s.get("errors") or {}).values()), "{}"), _f(s.get("late"), "{}"), _f(s.get("retried"), "{}"),
                 _f(s.get("request_throughput"), "{:.2f}"), _f(_pct_of(lat, "p50")), _f(_pct_of(lat, "p99")),
                 _f(_pct_of(lat, "p999")), _f(_pct_of(lat, "max")), _f(_pct_of(svc, "p99"))]
        if streaming:
            cells += [_f(_pct_of(s.get("ttft_ms"), "p50")), _f(_pct_of(s.get("ttft_ms"), "p99")),
                      _f(_pct_of(s.get("tpot_ms"), "p50"), "{:.2f}"), _f(_pct_of(s.get("tpot_ms"), "p99"), "{:.2f}"),
                      _f(_pct_of(s.get("chunk_gap_ms"), "p99"), "{:.2f}"), _f(s.get("output_throughput"))]
        if slo:
            att = s.get("slo_attainment")
            cells += [_f(s.get("goodput"), "{:.2f}"), "–" if att is None else f"{att * 100:.1f} %"]
        if gpu:
            def pc(v: Any) -> str:
                return "–" if v is None else f"{v * 100:.1f} %"
            thr = g.get("throttled_frac")
            cells += [pc(g.get("sm_active_mean")), pc(g.get("sm_active_p95")), pc(g.get("mem_used_frac_max")),
                      _f(g.get("power_w_mean"), "{:.0f}"),
                      "–" if thr is None else f"{thr * 100:.0f} %" + (f" ({_e(g['throttle_reason'])})"
                                                                        if g.get("throttle_reason") else ""),
                      _f(g.get("energy_j"), "{:.0f}"), _f(g.get("j_per_request"), "{:.3g}"),
                      _f(g.get("j_per_output_token"), "{:.3g}")]
        out.append("<tr>" + "".join(f"<td class=num>{c}</td>" if i > 1 else f"<td>{c}</td>"
                                    for i, c in enumerate(cells)) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _per_gpu_table(readings: Sequence[GpuReading], t0: float, t1: float) -> str:
    """Each GPU over the whole run, when there were several (the stage table adds them up)."""
    from .gpu import gpu_stats

    per = gpu_stats(readings, t0, t1 + 1e-9).get("per_gpu") or {}
    if not per:
        return ""
    def pc(v: Any) -> str:
        return "–" if v is None else f"{v * 100:.1f} %"
    rows = "".join(f"<tr><td>{_e(k)}</td><td class=num>{pc(v.get('sm_active_mean'))}</td>"
                   f"<td class=num>{pc(v.get('nvml_util_mean'))}</td><td class=num>{pc(v.get('mem_used_frac_max'))}</td>"
                   f"<td class=num>{_f(v.get('power_w_mean'), '{:.0f}')}</td><td class=num>{_f(v.get('energy_j'), '{:.0f}')}</td></tr>"
                   for k, v in per.items())
    return ("<table class=per-gpu id=per-gpu><thead><tr><th>GPU (whole run)</th><th>SM active mean</th>"
            "<th>NVML utilisation mean</th><th>memory max</th><th>power W</th><th>energy J</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>")


def _capacity(cap: Mapping[str, Any] | None) -> str:
    if not cap:
        return ""
    limited = {"slo": "the SLOs", "errors": "errors", "throughput": "throughput (the service fell behind)",
               "max_rate": "the highest rate allowed (it never failed)",
               "max_trials": "the trial budget (it never failed)"}.get(str(cap.get("limited_by")), cap.get("limited_by"))
    out = [f"<h2>Capacity</h2><p class=verdict-cap><b id=capacity>{_f(cap.get('capacity_rps'), '{:.4g}')} req/s</b> "
           f"is the highest rate that met the criteria; limited by {_e(limited)}.</p>",
           "<table class=trials><thead><tr><th>trial</th><th>offered req/s</th><th>passed</th><th>achieved req/s</th>"
           "<th>met SLOs</th><th>p99 latency ms</th><th>errors</th><th>why not</th></tr></thead><tbody>"]
    for i, t in enumerate(cap.get("trials") or []):
        att = t.get("attainment")
        er = t.get("error_ratio")
        out.append(f"<tr class={'pass' if t.get('passed') else 'fail'}><td>{i}</td>"
                   f"<td class=num>{_f(t.get('rate'), '{:.4g}')}</td><td>{'yes' if t.get('passed') else 'no'}</td>"
                   f"<td class=num>{_f(t.get('throughput'), '{:.4g}')}</td>"
                   f"<td class=num>{'–' if att is None else f'{att * 100:.1f} %'}</td>"
                   f"<td class=num>{_f(t.get('p99_latency_ms'))}</td>"
                   f"<td class=num>{'–' if er is None else f'{er * 100:.2f} %'}</td><td>{_e(t.get('why'))}</td></tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _header(summary: Mapping[str, Any]) -> str:
    valid = summary.get("valid", True)
    reasons = summary.get("invalid_reasons") or []
    if valid:
        verdict = ("<div class='verdict ok' id=verdict>Valid run: the load generator kept to its schedule; "
                   "the numbers below describe the server.</div>")
    else:
        verdict = ("<div class='verdict bad' id=verdict>INVALID run: the latencies and rates below are not the "
                   "server's, because:"
                   f"<ul>{''.join(f'<li>{_e(r)}.</li>' for r in reasons)}</ul></div>")
    c = summary.get("client") or {}
    send = c.get("send_lag_ms") or {}
    slo = summary.get("slo") or {}
    kv = [("URL", summary.get("url")), ("protocol", summary.get("protocol")),
          ("metric names as", summary.get("metrics_as")),
          ("duration", f"{_f(summary.get('duration_s'))} s"),
          ("SLOs", ", ".join(f"{k} ≤ {v * 1000:g} ms" for k, v in slo.items()) or "none given"),
          ("client", f"{c.get('workers', '–')} workers, {_f(c.get('cpu_percent'))} % CPU, send lag p99 "
                     f"{_f(send.get('p99'), '{:.2f}')} ms, {c.get('late', 0)} requests late "
                     f"(> {_f(c.get('late_threshold_ms'), '{:g}')} ms), "
                     f"{(summary.get('overall') or {}).get('retried', 0)} retried on a fresh connection"),
          ("GPU data", summary.get("gpu_source") or "none")]
    return verdict + "<dl class=kv>" + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in kv) + "</dl>"


_CSS = """
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2330;background:#f6f7f9}
main{max-width:1200px;margin:0 auto;padding:20px}h1{font-size:22px;margin:0 0 8px}h2{font-size:17px;margin:26px 0 8px}
.verdict{padding:10px 14px;border-radius:8px;margin:10px 0;font-weight:600}.verdict ul{margin:6px 0 0;font-weight:400}
.verdict.ok{background:#e5f4e0;border:2px solid #3a9d23}.verdict.bad{background:#fde2e1;border:2px solid #d1343a}
.kv{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:8px 0}.kv dt{color:#5b6475}.kv dd{margin:0}
table{border-collapse:collapse;width:100%;background:#fff;font-size:12.5px;margin:6px 0}
th,td{border-bottom:1px solid #dfe3ea;padding:4px 6px;text-align:left}th{background:#eef1f5}
td.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}tr.fail td{color:#9b2226}
.wide{overflow-x:auto}.plot{background:#fff;border:1px solid #dfe3ea;border-radius:8px;padding:8px;margin:10px 0;min-height:60px}
.plot h3{font-size:14px;margin:0 0 4px}.muted{color:#5b6475}.nodata{color:#9b2226}.warn{color:#8a5a00;background:#fff6df;padding:6px 10px;border-radius:6px}
footer{color:#5b6475;font-size:12px;margin:30px 0 10px}
"""

# Records script errors on <body data-errors>, for tests and for a reader wondering why a plot is empty.
_ERRORS_JS = ("window.__errs=[];window.addEventListener('error',function(e){window.__errs.push(String(e.message));"
              "document.body.setAttribute('data-errors',window.__errs.join(' | '));});")

# Builds every plot from the JSON data block; records problems on <body data-errors> for tests and readers.
_JS = r"""
(function(){
var D=JSON.parse(document.getElementById('loadtest-data').textContent);
var PAL=D.palette;
function bands(u){var ctx=u.ctx;D.stages.forEach(function(s,i){
  var x0=u.valToPos(s.start,'x',true),x1=u.valToPos(s.end,'x',true);
  x0=Math.max(x0,u.bbox.left);x1=Math.min(x1,u.bbox.left+u.bbox.width);if(x1<=x0)return;
  ctx.save();ctx.fillStyle=i%2?'rgba(31,111,209,0.07)':'rgba(120,120,120,0.07)';
  ctx.fillRect(x0,u.bbox.top,x1-x0,u.bbox.height);ctx.fillStyle='#5b6475';
  ctx.font=(11*devicePixelRatio)+'px sans-serif';ctx.fillText(s.name,x0+4,u.bbox.top+12*devicePixelRatio);
  ctx.restore();});}
function pctLabel(v){return (100*(1-Math.pow(10,-v))).toFixed(Math.max(0,Math.ceil(v-1e-9)-2))+'%';}
D.plots.forEach(function(p){
  var el=document.getElementById('plot-'+p.id);
  var n=0;for(var k=1;k<p.data.length;k++)for(var j=0;j<p.data[k].length;j++)if(p.data[k][j]!=null)n++;
  el.setAttribute('data-points',n);
  if(typeof uPlot==='undefined'){el.insertAdjacentHTML('beforeend',
    '<p class=nodata>The chart library (uPlot) was not found when this report was written.</p>');return;}
  var series=[{label:p.xlabel}];p.series.forEach(function(s,i){
    var c=PAL[i%PAL.length];var o={label:s,stroke:c,width:1.5,spanGaps:false};
    if(p.points&&s.indexOf('ideal')<0){o.paths=function(){return null};o.points={show:true,size:8,fill:c};}
    if(s.indexOf('ideal')>=0)o.dash=[6,4];series.push(o);});
  var xaxis={label:p.xlabel};
  if(p.kind==='pct'){xaxis.values=function(u,vals){return vals.map(pctLabel);};
    xaxis.splits=function(u){var m=u.scales.x.max,out=[];for(var i=0;i<=Math.floor(m);i++)out.push(i);return out;};}
  var opts={width:Math.max(300,el.clientWidth-16),height:260,series:series,
    scales:{x:{time:false}},axes:[xaxis,{label:p.ylabel}],legend:{live:true},
    hooks:p.kind==='time'?{drawClear:[bands]}:{}};
  new uPlot(opts,p.data,el);
});
document.body.setAttribute('data-rendered',D.plots.length);
})();
"""


def _error_table(cols: Columns) -> str:
    """Each error class seen: what it means, then what the server did, sentence by sentence, with counts."""
    if not cols.legend:
        return ""
    rows = []
    for cls, meaning in ERROR_CLASSES.items():
        if cls not in cols.legend:
            continue
        said = sorted(((n, d) for (c, d), n in cols.details.items() if c == cls), reverse=True)[:5]
        rows.append(f"<tr><td>{_e(cls)}</td><td>{_e(meaning)}</td><td>"
                    + "<br>".join(f"{n} × {_e(d)}" for n, d in said) + "</td></tr>")
    return ("<h2>Error classes</h2><table class=errors id=error-classes><thead><tr><th>class</th><th>meaning</th>"
            "<th>what happened (requests × sentence)</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def render(summary: Mapping[str, Any], records: Iterable[RequestRecord], readings: Sequence[GpuReading]) -> str:
    """The report page as a string (write_html writes it). `records` is read once, in intended-time order
    (as records.jsonl holds them), and may be a stream."""
    stages = list(summary.get("stages") or [])
    cols = Columns(records, str(summary.get("metrics_as", "vllm")))
    t0 = min([float(s["start_s"]) for s in stages] + ([cols.first_t] if cols.first_t is not None else []) or [0.0])
    t1 = max([float(s["end_s"]) for s in stages] + [float(summary.get("duration_s") or 0.0)]
             + ([cols.last_t] if cols.count else []))
    plots, notes = _latency_plots(cols, t0, t1, summary.get("names") or {}, stages)
    tp = _throughput_plot(stages)
    if tp is not None:
        plots.insert(2 if len(plots) >= 2 else len(plots), tp)
    cp = _capacity_plot(summary.get("capacity"))
    if cp is not None:
        plots.insert(0, cp)
    if readings:
        plots.extend(_gpu_plots(readings, t0, t1))
        gpu_note = (f"<p class=warn id=gpu-note>{_e(summary['gpu_note'])}.</p>" if summary.get("gpu_note") else "") \
            + _per_gpu_table(readings, t0, t1)
    else:
        why = str(summary.get("gpu_source") or "no GPU readings were taken during this run")
        why = why[len("no GPU data: "):] if why.lower().startswith("no gpu data: ") else why
        gpu_note = f"<p class=nodata id=no-gpu>No GPU data: {_e(why)}.</p>"
    vendor = _vendor()
    data = {"stages": [{"name": f"{s.get('index')} {s.get('name', '')}".strip(), "start": s["start_s"],
                        "end": s["end_s"]} for s in stages], "plots": plots, "palette": PALETTE}
    blob = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    title = f"gpuscope loadtest: {summary.get('url', '')}"
    sections = []
    for p in plots:
        sections.append(f"<div class=plot id='plot-{_e(p['id'])}'><h3>{_e(p['title'])}</h3></div>")
        if p["id"] == "gpu_sm":
            sections.insert(len(sections) - 1, "<h2>GPU</h2>" + gpu_note)
    if not readings:
        sections.append("<h2>GPU</h2>" + gpu_note)
    errors_legend = _error_table(cols)
    parts = [
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'; img-src data:\">",
        '<meta name=viewport content="width=device-width,initial-scale=1">',
        f"<title>{_e(title[:200])}</title><style>{_CSS}{vendor[1] if vendor else ''}</style></head><body><main>",
        "<h1>gpuscope loadtest report</h1>", _header(summary),
        "<h2>Per stage</h2>", '<p class=muted>Latency is measured from each request\'s intended send time (no '
        "coordinated omission); “from sent” is from the actual send. Times in ms.</p>", _stage_table(summary),
        _capacity(summary.get("capacity")), "<h2>Plots</h2>",
        "".join(f"<p class=muted>{_e(n)}</p>" for n in notes),
        "".join(sections),
        errors_legend,
        f"<footer>gpuscope {_e(__version__)} · {cols.count} requests · {len(readings)} GPU readings</footer>",
        f"</main><script type='application/json' id='loadtest-data'>{blob}</script>",
        f"<script>{_ERRORS_JS}</script>",
        f"<script>{vendor[0]}</script>" if vendor else "",
        f"<script>{_JS}</script></body></html>\n",
    ]
    return "".join(parts)


def write_html(path: str, summary: Mapping[str, Any], records: Iterable[RequestRecord],
               readings: Sequence[GpuReading]) -> None:
    """Write the report to `path` atomically. Raises OSError (the caller says it in one sentence)."""
    write_atomic(path, render(summary, records, readings))
