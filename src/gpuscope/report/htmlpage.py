"""The `gpuscope run` report as one self-contained HTML file: inline CSS and SVG, no script, nothing
fetched (a Content-Security-Policy forbids it), readable offline and safe to mail around.

Everything that came from outside (command lines, process names, users, verdict texts) is
HTML-escaped. Sections: summary, what to change first, verdict timeline with evidence, per GPU the
metric panels with verdict bands, the per-process table.
"""

from __future__ import annotations

import datetime as _dt
import os
import tempfile
from collections.abc import Callable, Sequence
from html import escape
from typing import Any

from .._version import __version__
from ..catalog import CLOCK_EVENT_REASONS
from ..diagnose.thresholds import DEFAULT
from .svg import Axis, Band, Line, fmt_time, panel
from .timeline import gpu_order

#: Colours per verdict kind; anything else gets a grey.
VERDICT_COLORS = {
    "healthy": "#3a9d23", "compute_bound": "#1b7f3b", "memory_bound": "#1f8a9e", "tensor_cores_unused": "#e08a00",
    "memory_access_bound": "#c8a400", "transfer_bound": "#7b4fc9", "launch_or_sync_bound": "#d1343a",
    "input_starved": "#c2399b", "idle_allocated": "#8a5a2b", "idle": "#9aa0a8", "underutilized": "#d9b44a",
    "sync_bound": "#b02a30", "launch_bound": "#e0525a", "host_bound": "#a0522d",
    "gpu_lost": "#222222", "throttled": "#e4572e", "power_capped": "#f0a35e", "memory_growth": "#b5179e",
    "hardware": "#8b0000", "imbalance": "#5c6bc0",
}
#: Every clock-event reason but an idle GPU: those that hold the clocks below what the work could use.
SLOWDOWN = {bit: name for bit, name in CLOCK_EVENT_REASONS.items() if name != "gpu_idle"}

_CSS = """
:root{--fg:#1d2330;--muted:#5b6475;--line:#dfe3ea;--bg:#f6f7f9;--card:#fff}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;
color:var(--fg);background:var(--bg)}main{max-width:1100px;margin:0 auto;padding:20px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 10px}h3{font-size:15px;margin:18px 0 6px}
.card{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:14px 16px;margin:10px 0}
.sim{background:#fff3cd;border:2px solid #e0a800;color:#6b4e00;font-weight:700;padding:10px 14px;
border-radius:8px;margin:10px 0;letter-spacing:.02em}
.kv{margin:0;display:grid;grid-template-columns:max-content 1fr;gap:3px 16px}.kv dt{color:var(--muted)}.kv dd{margin:0}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px;word-break:break-all}
table{border-collapse:collapse;width:100%;background:var(--card);font-size:13px}
th,td{border-bottom:1px solid var(--line);padding:5px 8px;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600}td.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
.swatch{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:-1px;margin-right:5px}
.legend{display:flex;flex-wrap:wrap;gap:4px 16px;font-size:12.5px;color:var(--muted);margin:2px 0 4px}
.legend .dash{display:inline-block;width:18px;border-top:2px dashed;vertical-align:3px;margin-right:5px}
.legend .solid{display:inline-block;width:18px;border-top:2px solid;vertical-align:3px;margin-right:5px}
.sharebar{display:flex;height:16px;border-radius:4px;overflow:hidden;border:1px solid var(--line);margin:3px 0}
.sharebar span{display:block;height:100%}
figure{margin:8px 0 14px}figcaption{font-weight:600;font-size:13px}
svg.panel{width:100%;height:auto;display:block}svg .tick{font-size:11px;fill:#5b6475}
svg .unit{font-size:11px;fill:#5b6475}
.change{border-left:4px solid #d1343a}.ok{border-left:4px solid #3a9d23}.muted{color:var(--muted)}
.ours{font-weight:600}.tag{font-size:11px;border-radius:3px;padding:0 4px;background:#eef1f5;color:var(--muted)}
footer{color:var(--muted);font-size:12px;margin:30px 0 10px}
.scroll{overflow-x:auto}details{font-weight:400;color:var(--muted);max-width:26em}details summary{cursor:pointer}
"""


def _e(v: Any) -> str:
    return escape("" if v is None else str(v), quote=True)


def _color(kind: str) -> str:
    return VERDICT_COLORS.get(kind, "#9aa0a8")


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:.1f} %"


def _bytes(v: float | None) -> str:
    if v is None:
        return "–"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= div:
            return f"{v / div:.1f} {unit}"
    return f"{v:.0f} B"


def _evidence(ev: dict[str, Any]) -> str:
    out = []
    for k, v in ev.items():
        if v is None:
            continue
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):  # rows: shared_by, stack_threads
            s = " | ".join(", ".join(f"{a} {_value(a, b)}" for a, b in x.items() if b is not None) for x in v)
            out.append(f"<span class=mono>{_e(k)}</span>&nbsp;{_e(s)}")
            continue
        s = _value(k, v)
        out.append(f"<span class=mono>{_e(k)}</span>&nbsp;{_e(s)}")
    return "; ".join(out)


def _value(k: str, v: Any) -> str:
    """One evidence value in its unit, by its key's suffix."""
    if isinstance(v, float):
        if k.endswith("_cores"):
            return f"{v:.2f} cores"
        if k.endswith("_bytes_per_s") or k == "bytes_per_s":
            return f"{v / 1e9:.2f} GB/s"
        if k.endswith("_bytes"):
            return _bytes(v)
        if k.endswith("_s"):
            return f"{v:.1f} s"
        if k.endswith("_hertz"):
            return f"{v / 1e6:.0f} MHz"
        if 0.0 <= v <= 1.0:
            return f"{v * 100:.1f} %"
        return f"{v:.3g}"
    if isinstance(v, list):
        return ", ".join(map(str, v)) or "–"
    return str(v)


def _fmt_energy(j: float | None) -> str:
    if j is None:
        return "not measured"
    return f"{j / 1000:.1f} kJ ({j / 3600:.1f} Wh)" if j >= 1000 else f"{j:.0f} J"


# -- sections ---------------------------------------------------------------------------------------
def _summary(r: dict[str, Any]) -> str:
    started = r.get("started_at")
    when = _dt.datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds") if started else "–"
    code = f"{r['exit_code']}" + (" (interrupted)" if r.get("interrupted") else "")
    if r.get("killed_by_signal"):
        code += f" — ended by signal {r['killed_by_signal']}"
    gs = r.get("gpu_start_s")
    rows = [("Command", f"<code>{_e(r.get('command'))}</code>"), ("Host", _e(r.get("hostname"))),
            ("Started", _e(when)), ("Duration", _e(fmt_time(r["duration_s"]))), ("Exit code", _e(code)),
            ("Energy (all GPUs)", _e(_fmt_energy(r.get("energy_joules")))),
            ("First on a GPU", _e("never" if gs is None else f"{gs:.1f} s after the start"))]
    out = ['<section class="card"><dl class="kv">']
    out += [f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows]
    out.append("</dl></section>")
    share = r.get("verdict_share") or {}
    out.append("<h2>Time share per verdict</h2>")
    if not share:
        out.append(f'<p class="muted">No verdict: the GPUs were never watched for a steady '
                   f'{DEFAULT.min_window_s:.0f} s.</p>')
    for gpu, kinds in sorted(share.items(), key=lambda kv: gpu_order(kv[0])):
        ordered = sorted(kinds.items(), key=lambda kv: -kv[1])
        bar = "".join(f'<span style="width:{v * 100:.2f}%;background:{_color(k)}" title="{_e(k)} {v * 100:.0f} %">'
                      "</span>" for k, v in ordered)
        text = ", ".join(f'<span class="swatch" style="background:{_color(k)}"></span>{_e(k)} {v * 100:.0f} %'
                         for k, v in ordered)
        e = (r.get("energy_joules_by_gpu") or {}).get(gpu)
        out.append(f'<div class="card"><b>GPU {_e(gpu)}</b> <span class="muted">energy {_e(_fmt_energy(e))}</span>'
                   f'<div class="sharebar">{bar}</div>{text}</div>')
    cf = r.get("change_first")
    out.append("<h2>What to change first</h2>")
    if cf:
        advice = "".join(f"<li>{_e(a)}</li>" for a in cf.get("advice") or [])
        out.append(f'<div class="card change"><span class="swatch" style="background:{_color(cf["kind"])}"></span>'
                   f'<b>{_e(cf["kind"])}</b> on GPU {_e(cf["gpu"])} ({_e(fmt_time(cf.get("seconds") or 0))} in all)'
                   f"<p>{_e(cf['summary'])}</p>" + (f"<ul>{advice}</ul>" if advice else "") + "</div>")
    else:
        out.append('<div class="card ok">Nothing to change: no bottleneck verdict during this run.</div>')
    return "".join(out)


def _timeline_table(r: dict[str, Any]) -> str:
    spans = [(s, True) for s in r.get("spans") or []] + [(s, False) for s in r.get("side_spans") or []]
    spans.sort(key=lambda sp: (gpu_order(sp[0]["gpu"]), sp[0]["start_s"], not sp[1]))
    out = ["<h2>Verdict timeline</h2>"]
    if not spans:
        return out[0] + '<p class="muted">No verdicts.</p>'
    out.append("<table><thead><tr><th>GPU</th><th>from</th><th>to</th><th>verdict</th><th>what it means</th>"
               "<th>evidence</th></tr></thead><tbody>")
    for s, primary in spans:
        tag = "" if primary else ' <span class="tag">side</span>'
        n = s.get("verdicts", 1)
        out.append(f"<tr><td>{_e(s['gpu'])}</td><td class=num>{_e(fmt_time(s['start_s']))}</td>"
                   f"<td class=num>{_e(fmt_time(s['end_s']))}</td>"
                   f'<td><span class="swatch" style="background:{_color(s["kind"])}"></span>{_e(s["kind"])}{tag}'
                   f'<div class="muted">{n} verdict{"s" if n != 1 else ""}</div></td>'
                   f"<td>{_e(s['summary'])}</td><td>{_evidence(s.get('evidence') or {})}</td></tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _traces(trace: dict[str, Any]) -> str:
    """`run --trace`: each trace asked for, its file and verdict, or why none came."""
    out = ["<h2>Traces</h2>"]
    if not trace.get("requests"):
        return out[0] + '<p class="muted">None needed: no GPU\'s verdict stayed unsettled.</p>'
    out.append("<table><thead><tr><th>GPU</th><th>asked at</th><th>processes</th><th>trace</th><th>verdict</th>"
               "</tr></thead><tbody>")
    for r in trace["requests"]:
        what = (f'<span class="swatch" style="background:{_color(r["verdict"])}"></span>{_e(r["verdict"])}'
                f"<div>{_e(r['summary'])}</div>" if r.get("verdict") else _e(r.get("note") or "no trace came"))
        out.append(f"<tr><td>{_e(r['gpu'])}</td><td class=num>{_e(fmt_time(r['requested_at_s']))}</td>"
                   f"<td>{_e(', '.join(map(str, r.get('pids') or [])) or '–')}</td>"
                   f"<td><code>{_e(r.get('file') or '–')}</code></td><td>{what}</td></tr>")
    out.append("</tbody></table>")
    if not trace.get("kept"):
        out.append('<p class="muted">The traces were removed at the end of the run (no report to keep them beside).</p>')
    return "".join(out)


def _legend(items: Sequence[tuple[str, str, bool]]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><span class="{"dash" if dashed else "solid"}" style="border-color:{c}"></span>{_e(label)}</span>'
        for label, c, dashed in items) + "</div>"


def _verdict_legend(kinds: Sequence[str]) -> str:
    if not kinds:
        return ""
    return '<div class="legend">Verdict bands: ' + "".join(
        f'<span><span class="swatch" style="background:{_color(k)};opacity:.55"></span>{_e(k)}</span>'
        for k in kinds) + "</div>"


def _gpu_section(r: dict[str, Any], info: dict[str, Any]) -> str:
    gpu = info["gpu"]
    pts = (r.get("series") or {}).get(gpu)
    head = f"<h3>GPU {_e(gpu)} — {_e(info.get('name'))}</h3>"
    if not pts or not pts.get("t"):
        return head + '<p class="muted">No samples.</p>'
    t = pts["t"]
    t0, t1 = 0.0, max(r["duration_s"], t[-1])
    spans = [s for s in r.get("spans") or [] if s["gpu"] == gpu]
    bands = [Band(s["start_s"], s["end_s"], _color(s["kind"]),
                  f"{s['kind']}: {fmt_time(s['start_s'])} – {fmt_time(s['end_s'])}\n{s['summary']}") for s in spans]
    merged = (pts.get("samples_per_bucket") or 1) > 1

    def line(key: str, label: str, color: str, dashed: bool = False) -> Line:
        s = pts.get(key) or {"mean": [None] * len(t), "min": None, "max": None}
        return Line(label, color, t, s["mean"], s["min"] if merged else None, s["max"] if merged else None, dashed)

    def fig(caption: str, lines: list[Line], axis: Axis, hlines: Sequence[tuple[float, str, str]] = ()) -> str:
        if all(v is None for ln in lines for v in ln.y):
            return ""
        legend = [(ln.label, ln.color, ln.dashed) for ln in lines] + [(lab, c, True) for _, c, lab in hlines]
        return (f"<figure><figcaption>{_e(caption)}</figcaption>{_legend(legend)}"
                f"{panel(lines, t0, t1, axis, bands, f'GPU {gpu}: {caption}', hlines)}</figure>")

    gb = lambda v: f"{v:.3g}"  # noqa: E731
    out = [head, _verdict_legend(sorted({s["kind"] for s in spans}))]
    out.append(fig("Activity: what the GPU really does (SM, tensor, DRAM) vs NVML 'utilization'", [
        line("gpu_sm_active_ratio", "SM active", "#0072b2"), line("gpu_tensor_active_ratio", "tensor active", "#009e73"),
        line("gpu_dram_active_ratio", "DRAM active", "#e69f00"),
        line("gpu_utilization_ratio", "NVML utilization", "#6b6b6b", dashed=True)],
        Axis("%", 100.0, 0.0, 100.0, lambda v: f"{v:.0f}")))
    out.append(fig("PCIe throughput", [line("gpu_pcie_rx_bytes_per_second", "rx (host → GPU)", "#56b4e9"),
                                       line("gpu_pcie_tx_bytes_per_second", "tx (GPU → host)", "#d55e00")],
                   Axis("GB/s", 1e-9, 0.0, None, gb)))
    limit = info.get("power_limit_watts")
    out.append(fig("Power", [line("gpu_power_watts", "power", "#cc79a7")], Axis("W", 1.0, 0.0, None, lambda v: f"{v:.0f}"),
                   [(limit, "#cc79a7", f"power limit {limit:.0f} W")] if limit else []))
    total = info.get("memory_total_bytes")
    out.append(fig("GPU memory used", [line("gpu_memory_used_bytes", "used", "#0072b2")],
                   Axis("GiB", 2**-30, 0.0, None, gb), [(total, "#0072b2", f"total {total / 2**30:.0f} GiB")] if total else []))
    mx = info.get("sm_clock_max_hertz")
    out.append(fig("SM clock", [line("gpu_sm_clock_hertz", "SM clock", "#009e73")],
                   Axis("MHz", 1e-6, 0.0, None, lambda v: f"{v:.0f}"), [(mx, "#009e73", f"max {mx / 1e6:.0f} MHz")] if mx else []))
    out.append(fig("Temperature", [line("gpu_temperature_celsius", "GPU die", "#d55e00")],
                   Axis("°C", 1.0, 0.0, None, lambda v: f"{v:.0f}")))
    out.append(_clock_events(gpu, t, pts.get("gpu_clock_event_reasons") or [], t0, t1, bands))
    return "".join(out)


def _clock_events(gpu: str, t: list[float], masks: list[int], t0: float, t1: float, bands: list[Band]) -> str:
    """A strip per slowdown reason seen: where the clocks were held down, and why."""
    union = 0
    for m in masks:
        union |= int(m)
    seen = [(bit, name) for bit, name in SLOWDOWN.items() if union & bit]
    if not seen:
        return '<p class="muted">Clock-event reasons: no slowdown (power cap, thermal, …) seen.</p>'
    palette = ["#e4572e", "#f0a35e", "#8b0000", "#b5179e", "#5c6bc0", "#c8a400", "#1f8a9e", "#555", "#999", "#333"]
    lines = []
    for k, (bit, reason) in enumerate(seen):
        on = [(k + 1) * 1.0 if int(m) & bit else None for m in masks]
        lines.append(Line(reason, palette[k % len(palette)], t, on))
    axis = Axis("reason", 1.0, 0.0, len(seen) + 1.0, lambda v: "")
    legend = _legend([(ln.label, ln.color, False) for ln in lines])
    return (f"<figure><figcaption>Clock-event reasons (slowdowns; a line where the reason was active)</figcaption>"
            f"{legend}{panel(lines, t0, t1, axis, bands, f'GPU {gpu}: clock-event reasons')}</figure>")


def _processes(r: dict[str, Any]) -> str:
    rows = r.get("processes") or []
    out = ["<h2>Processes</h2>",
           '<p class="muted">The run\'s processes (the command and all its descendants) first, then other '
           "users' processes seen on the GPUs meanwhile.</p>"]
    if not rows:
        return "".join(out) + '<p class="muted">None seen.</p>'
    out.append('<div class="scroll"><table><thead><tr><th>pid</th><th>whose</th><th>name</th><th>user</th><th>GPU</th>'
               "<th>verdict</th><th>on GPU from</th><th>GPU memory max</th><th>SM share mean</th>"
               "<th>CPU cores mean / max</th><th>busiest thread max</th><th>busy threads max</th><th>RSS max</th>"
               "<th>command line</th></tr></thead><tbody>")
    for p in rows:
        cpu = ("–" if p.get("cpu_cores_mean") is None else
               f"{p['cpu_cores_mean']:.2f} / {(p.get('cpu_cores_max') or 0):.2f}")
        first = p.get("gpu_first_seen_s")
        out.append(
            f'<tr class="{"ours" if p.get("ours") else ""}"><td class=num>{_e(p["pid"])}</td>'
            f"<td>{'this run' if p.get('ours') else 'other'}</td><td>{_e(p.get('name'))}</td><td>{_e(p.get('user'))}</td>"
            f"<td>{_e(p.get('gpu') if p.get('gpu') is not None else '–')}</td>"
            f"<td class=verdict>{_process_verdict(p)}</td>"
            f"<td class=num>{_e('–' if first is None else fmt_time(first))}</td>"
            f"<td class=num>{_e(_bytes(p.get('gpu_memory_max_bytes')))}</td>"
            f"<td class=num>{_e(_pct(p.get('sm_ratio_mean')))}</td><td class=num>{_e(cpu)}</td>"
            f"<td class=num>{_e(_pct(p.get('thread_cpu_max_ratio')))}</td>"
            f"<td class=num>{_e(_busy(p))}</td>"
            f"<td class=num>{_e(_bytes(p.get('rss_max_bytes')))}</td><td><code>{_e(p.get('cmdline'))}</code></td></tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _process_verdict(p: dict[str, Any]) -> str:
    """A process row's verdict over the run: the longest kind, the others' shares, and what it means."""
    kind = p.get("verdict")
    if not kind:
        return "–"
    share = p.get("verdict_share") or {}
    others = ", ".join(f"{_e(k)} {v * 100:.0f} %" for k, v in share.items() if k != kind)
    return (f'<span class="swatch" style="background:{_color(kind)}"></span><b>{_e(kind)}</b>'
            + (f" {share[kind] * 100:.0f} %" if kind in share and len(share) > 1 else "")
            + (f'<div class="muted">also {others}</div>' if others else "")
            + f'<details><summary>why</summary>{_e(p.get("verdict_summary"))}</details>')


def _busy(p: dict[str, Any]) -> str:
    """The most threads busy at once, and the busiest threads' names."""
    n = p.get("threads_busy_max")
    if n is None:
        return "–"
    names = ", ".join(f"{t.get('name') or '?'} {t.get('cpu_ratio', 0) * 100:.0f} %" for t in p.get("busy_threads") or [])
    return f"{n:.0f}" + (f" ({names})" if names else "")


def render_html(report: dict[str, Any]) -> str:
    """The report dict from runcmd.run as one HTML page."""
    sim = report.get("simulated")
    title = f"gpuscope run: {report.get('command') or ''}"
    parts = ["<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
             "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">",
             '<meta name=viewport content="width=device-width,initial-scale=1">',
             f"<title>{_e(title[:200])}</title><style>{_CSS}</style></head><body><main>",
             "<h1>gpuscope run report</h1>"]
    if sim:
        parts.append(f'<div class="sim" id="simulated">SIMULATED — these numbers come from the simulated node '
                     f"(scenario '{_e(sim)}'), not from real GPUs.</div>")
    parts.append(_summary(report))
    parts.append(_timeline_table(report))
    if report.get("trace") is not None:
        parts.append(_traces(report["trace"]))
    parts.append("<h2>Metrics per GPU</h2>")
    parts.append('<p class="muted">Time in seconds since the command started. Lines are means; a light band '
                 "around a line spans min–max where samples were merged. Background colours are the verdicts; "
                 "hover a chart for values.</p>")
    for info in report.get("gpus") or []:
        parts.append(f'<section class="gpu" id="gpu-{_e(info["gpu"])}">{_gpu_section(report, info)}</section>')
    parts.append(_processes(report))
    now = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    parts.append(f"<footer>gpuscope {_e(__version__)} · written {_e(now)}"
                 + (" · SIMULATED" if sim else "") + "</footer></main></body></html>\n")
    return "".join(parts)


def write_html(report: dict[str, Any], path: str, render: Callable[[dict[str, Any]], str] = render_html) -> None:
    """Write the report atomically (a reader never sees half a file). Raises OSError."""
    write_atomic(path, render(report))


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it: all of it or, on failure, nothing
    (no half-written report, no temporary file left). Raises OSError."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".gpuscope-report-", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
